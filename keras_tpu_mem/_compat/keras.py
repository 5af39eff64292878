"""Keras internals (any backend). Versions: checked on Keras 3.12.0, 3.15.1 and
keras-nightly 3.16.0.dev2026102704; `tests/test_compat.py` names each one."""

from __future__ import annotations

import itertools
import sys
from typing import NamedTuple


# ------------------------------------------------------------------ losses
def scale_loss_for_distribution(value):
    """Divides a mean-reduced loss by the replica count, as Keras does (3.12-3.16:
    `keras.src.losses.loss.scale_loss_for_distribution`)."""
    from keras.src.losses.loss import scale_loss_for_distribution as scale

    return scale(value)


def unscale_loss_for_distribution(value):
    """Inverse of `scale_loss_for_distribution` (3.12-3.16, same module)."""
    from keras.src.losses.loss import unscale_loss_for_distribution as unscale

    return unscale(value)


def reduce_weighted_values(values, **kwargs):
    """Keras' own weighted, masked reduction of a per-example loss (3.12-3.16:
    `keras.src.losses.loss.reduce_weighted_values(values, sample_weight, mask,
    reduction, dtype)`)."""
    from keras.src.losses.loss import reduce_weighted_values as reduce

    return reduce(values, **kwargs)


# ------------------------------------------------------------------ models
def functional_class():
    """The class of Functional models (3.12-3.16: `keras.src.models.functional.Functional`;
    Keras exports no public name for it)."""
    from keras.src.models.functional import Functional

    return Functional


def flatten_layers(layer, include_self=True, recursive=True) -> list:
    """Every layer under `layer`, depth first (3.12-3.16: `Layer._flatten_layers`)."""
    return list(layer._flatten_layers(include_self=include_self, recursive=recursive))


def inbound_node(operation, node_index):
    """The call node of a Functional graph that made a tensor (3.12-3.16:
    `Operation._inbound_nodes`)."""
    return operation._inbound_nodes[node_index]


def convert_input_args(layer) -> bool:
    """Whether `Layer.__call__` casts the inputs to the compute dtype (3.12-3.16:
    `Layer._convert_input_args`)."""
    return layer._convert_input_args


def set_convert_input_args(layer, value: bool) -> None:
    layer._convert_input_args = value


def autocast_scope(dtype):
    """Context in which float variables read as `dtype` (3.12-3.16:
    `keras.src.backend.common.variables.AutocastScope`)."""
    from keras.src.backend.common.variables import AutocastScope

    return AutocastScope(dtype)


# ----------------------------------------------------------------- trainer
def call_has_training_arg(model) -> bool:
    """Whether `model.call` takes `training` (3.12-3.16: `Layer._call_has_training_arg`)."""
    return model._call_has_training_arg


def compute_loss(model, x, y, y_pred, sample_weight, training=True):
    """The compiled loss plus `model.losses`, as Keras' own train step computes it
    (3.12-3.16: `Trainer._compute_loss`, which calls a user's `compute_loss`)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=training)


def loss_tracker(model):
    """The `Mean` metric behind the logged `loss` (3.12-3.16: `Trainer._loss_tracker`)."""
    return model._loss_tracker


def compiled_loss_object(model):
    """Identity of the compiled loss container, for cache keys (3.12-3.16:
    `Trainer._compile_loss`); None before compile."""
    return getattr(model, "_compile_loss", None)


def compiled_metrics_object(model):
    """Likewise for the compiled metrics (3.12-3.16: `Trainer._compile_metrics`)."""
    return getattr(model, "_compile_metrics", None)


def aggregate_additional_loss(model, loss):
    """One entry of `model.losses` reduced as Keras reduces it (3.12-3.16:
    `Trainer._aggregate_additional_loss`)."""
    return model._aggregate_additional_loss(loss)


def symbolic_build(model, data_batch) -> None:
    """Builds model, compiled loss and metrics from a batch without running the
    model (3.12-3.16: `Trainer._symbolic_build`)."""
    model._symbolic_build(data_batch=data_batch)


def has_symbolic_build(model) -> bool:
    return hasattr(model, "_symbolic_build")


def model_strategy(model):
    """The tf.distribute strategy a model was created under, without falling back to
    the current one (3.12-3.16: `Trainer._distribute_strategy`); None if unset."""
    return getattr(model, "_distribute_strategy", None)


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the model's running `fit` start at `epoch` when set from `on_train_begin`
    (3.12-3.16: `Trainer._initial_epoch`, which every backend's `fit` reads right after
    `on_train_begin` as `self._initial_epoch or initial_epoch`; Keras'
    `BackupAndRestore` sets it the same way and never clears it). None clears it."""
    if not hasattr(model, "_initial_epoch"):
        raise RuntimeError("This Keras has no `Trainer._initial_epoch`: a fit cannot be "
                           "resumed mid-run. keras_tpu_mem supports Keras 3.12-3.16.")
    model._initial_epoch = epoch


#: Keras' data adapter classes (3.12-3.16, `keras.src.trainers.data_adapters`) -> the
#: kind of data `fit` was given, as a user names it.
_DATA_KINDS = {
    "ArrayDataAdapter": "arrays",
    "PyDatasetAdapter": "keras.utils.PyDataset",
    "TFDatasetAdapter": "tf.data.Dataset",
    "GeneratorDataAdapter": "Python generator",
    "GrainDatasetAdapter": "grain dataset",
    "TorchDataLoaderAdapter": "torch DataLoader",
}


class _FitData(NamedTuple):
    kind: str  # one of `_DATA_KINDS`' values, or the adapter's class name
    shuffled: bool  # whether Keras itself reorders the batches at each epoch
    source: object  # the PyDataset / tf.data.Dataset fit reads, or None for others
    steps_per_epoch: int | None  # fit's `steps_per_epoch` (None: a pass per epoch)
    num_batches: int | None  # the data's batches per pass, where Keras knows them
    steps_per_execution: int  # the batches one call of the train function reads


def fit_data(model) -> _FitData | None:
    """What the `fit` running on `model` reads (`_FitData`: kind, shuffled, source,
    steps per epoch, batches per pass, steps per execution), from a callback of
    that fit; None where it cannot be read.

    Keras keeps a fit's data adapter nowhere but in the call (3.12-3.16: the local
    `epoch_iterator` of `Trainer.fit` on every backend, an `EpochIterator` whose
    `data_adapter` is `ArrayDataAdapter` with `_shuffle`, `PyDatasetAdapter` with
    `shuffle` and `py_dataset`, `TFDatasetAdapter` with `_dataset`, ...; its
    `steps_per_epoch`, `_num_batches` and `steps_per_execution`), so it is read
    from that call's frame.
    `shuffled` is True for `fit(shuffle=True)` with arrays or a PyDataset of known
    length."""
    epoch_iterator = _fit_epoch_iterator(model)
    adapter = getattr(epoch_iterator, "data_adapter", None)
    if adapter is None:
        return None
    name = type(adapter).__name__
    shuffled, source = False, None
    if name == "ArrayDataAdapter":
        shuffled = bool(getattr(adapter, "_shuffle", False))
    elif name == "PyDatasetAdapter":
        source = adapter.py_dataset
        shuffled = bool(adapter.shuffle) and source.num_batches is not None
    elif name == "TFDatasetAdapter":
        source = getattr(adapter, "_dataset", None)
    return _FitData(_DATA_KINDS.get(name, name), shuffled, source,
                    epoch_iterator.steps_per_epoch, getattr(epoch_iterator, "_num_batches", None),
                    int(epoch_iterator.steps_per_execution))


def fit_frame(model):
    """The frame of the `fit` running on `model` (3.12-3.16: `Trainer.fit` of every
    backend, whose `self` is the model), seen from a callback of it: on the stack for
    as long as that fit runs. None outside a fit."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            return frame
        frame = frame.f_back
    return None


def _fit_epoch_iterator(model):
    """The `EpochIterator` of the `fit` running on `model` (3.12-3.16: the local
    `epoch_iterator` of `Trainer.fit` on every backend), read from that call's frame;
    None outside a fit."""
    frame = fit_frame(model)
    return None if frame is None else frame.f_locals.get("epoch_iterator")


def epoch_starts(steps_per_epoch: int | None, num_batches: int | None,
                 steps_per_execution: int):
    """Yields, for epochs 0, 1, 2, ... of an uninterrupted `fit`, how many batches
    of its current pass over the data it has read when the epoch begins; 0 where
    the epoch begins a new pass (a new iterator over the data).

    Keras' `EpochIterator._enumerate_iterator` (3.12-3.16) makes a new iterator at
    every epoch unless `steps_per_epoch` is given; then one iterator runs on across
    epochs (a stream: `dataset.repeat()`, or data longer than an epoch), ending an
    epoch early once `num_batches` (the data's batches, when known) are read and
    starting the next pass at the following epoch. This replays that rule, counting
    in calls of `steps_per_execution` batches as Keras does."""
    calls = len(range(0, steps_per_epoch or 0, steps_per_execution))
    seen = 0
    while True:
        yield seen
        if not steps_per_epoch:
            continue  # a pass per epoch: every epoch starts at 0
        if num_batches:
            left = -(-(num_batches - seen) // steps_per_execution)  # calls before the end
            seen += min(calls, max(left, 0)) * steps_per_execution
            if seen >= num_batches:
                seen = 0
        else:
            seen += calls * steps_per_execution


def epoch_start_batches(epoch: int, steps_per_epoch: int | None, num_batches: int | None,
                        steps_per_execution: int) -> int:
    """How many batches of its current pass over the data an uninterrupted `fit` has
    read when epoch `epoch` (0-based) begins (`epoch_starts`' rule)."""
    starts = epoch_starts(steps_per_epoch, num_batches, steps_per_execution)
    return next(itertools.islice(starts, epoch, None))


def position_fit_data(model, epoch: int) -> int:
    """Puts the data of the `fit` running on `model`, which a restart began at epoch
    `epoch`, where an uninterrupted fit's data is when that epoch begins; returns the
    batches read to get there (none unless `steps_per_epoch` makes the data a stream
    across epochs). Called from the epoch's first `on_train_batch_begin`, after Keras
    made the epoch's iterator and counted its first call, before that call reads.

    Reads and sets `EpochIterator`'s `_current_iterator` and `_steps_seen` (3.12-3.16:
    the iterator the epoch's calls read, and the batches read from it, which decides
    where Keras ends an epoch and starts the next pass; see `epoch_start_batches`).

    Raises:
        RuntimeError: No running fit of `model` is found, or its iterator is not
            Keras' as known here.
    """
    epoch_iterator = _fit_epoch_iterator(model)
    if epoch_iterator is None or not hasattr(epoch_iterator, "_steps_seen"):
        raise RuntimeError(
            "keras_tpu_mem could not find the running fit's data iterator "
            "(`EpochIterator._steps_seen`): it supports Keras 3.12-3.16.")
    batches = epoch_start_batches(
        epoch, epoch_iterator.steps_per_epoch, epoch_iterator._num_batches,
        int(epoch_iterator.steps_per_execution))
    if batches:
        iterator = epoch_iterator._current_iterator
        for _ in range(batches):
            next(iterator)
        epoch_iterator._steps_seen += batches
    return batches


def backend_trainer_class():
    """Keras' trainer class of the active backend, to tell whether a model overrides
    `train_step`. TensorFlow: `TensorFlowTrainer` (3.12-3.15), renamed `Trainer` in
    3.16; JAX: `JAXTrainer` (3.12-3.16)."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras.src.backend.tensorflow import trainer

        return getattr(trainer, "TensorFlowTrainer", None) or trainer.Trainer
    if backend == "jax":
        from keras.src.backend.jax import trainer

        return getattr(trainer, "JAXTrainer", None) or trainer.Trainer
    raise RuntimeError(f"keras_tpu_mem has no engine for the {backend!r} backend.")


# ------------------------------------------------------------ distribution
def variable_layout(variable):
    """The layout a variable was given (a `TensorLayout`, a backend sharding or None)
    (3.12-3.16: `KerasVariable._layout`, which the JAX variable distributes every
    assigned value to and which optimizer slots copy from their weight)."""
    return getattr(variable, "_layout", None)


def set_variable_layout(variable, layout) -> None:
    """Gives a variable a layout: later assignments are distributed to it (3.12-3.16:
    `KerasVariable._layout`)."""
    variable._layout = layout


def distribution_layout_map(distribution):
    """A `keras.distribution.ModelParallel`'s `LayoutMap`, or None for another
    distribution (3.12-3.16: `ModelParallel._layout_map`; Keras has no getter)."""
    return getattr(distribution, "_layout_map", None)


def model_building(optimizer):
    """The `keras.Model` whose method is building `optimizer` now, or None.

    3.12-3.16: `fit`, `evaluate` and `compile`'s symbolic build call
    `self.optimizer.build(self.trainable_variables)` from a method of the model
    (`Trainer._symbolic_build`), so a frame a few levels up holds the model as
    `self`. Keras gives a distribution no other way to meet the model its
    optimizer belongs to.
    """
    import sys

    import keras

    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, keras.Model):
            own = getattr(candidate, "optimizer", None)
            if own is optimizer or getattr(own, "inner_optimizer", None) is optimizer:
                return candidate
        frame = frame.f_back
    return None


_SYMBOLIC_BUILDS = ("_symbolic_build", "_maybe_symbolic_build")


def in_symbolic_build() -> bool:
    """Whether the caller runs inside Keras' symbolic build of a model (its compiled
    loss and metrics, from the first batch of the data) rather than a training step.

    3.12-3.15: `fit` and `evaluate` call `Trainer._symbolic_build(iterator=...)`,
    which draws the first batch from the data before any callback runs (always on
    JAX; under a tf.distribute strategy on TensorFlow); 3.16's JAX trainer draws it
    in `_maybe_symbolic_build` and passes it on. A `keras.utils.PyDataset`
    with one worker is read synchronously, so `_symbolic_build` is a caller a few
    frames up. Keras tells a dataset no other way what its batch is for.
    """
    import sys

    frame = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name in _SYMBOLIC_BUILDS and "keras" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def name_scope_callers() -> list:
    """The objects that opened the current Keras name scopes, innermost last (3.12-3.16:
    the global attribute `"name_scope_stack"` of `keras.src.backend.common.global_state`,
    a list of `keras.name_scope`s whose `caller` an optimizer sets to itself when it
    creates its variables)."""
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack") or []
    return [getattr(scope, "caller", None) for scope in stack]


# ------------------------------------------------------- deferred variables
# A variable created in a `keras.StatelessScope` has no value: Keras keeps its
# shape, dtype, layout and initializer and makes the value on first need
# (`KerasVariable.__init__` and `_deferred_initialize`). `keras_tpu_mem.shapes`
# builds whole models that way; these are the internals it reaches. Checked on
# Keras 3.15.1 (what the tests run); an older Keras 3 source read has the same
# names (its `JaxVariable.__init__` takes `layout=` and calls `KerasVariable.__init__`).
# The `intercept_*` functions replace a Keras method by a wrapper, once: one
# interceptor per method (installing another replaces the first, never stacks).

def in_stateless_scope() -> bool:
    """Whether a `keras.StatelessScope` is active (3.15.1:
    `keras.src.backend.common.stateless_scope.in_stateless_scope`)."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope as active

    return active()


def has_value(variable) -> bool:
    """Whether a variable holds a value (3.15.1: `KerasVariable._value`, None only
    for a variable created in a stateless scope and not initialised since; on
    TensorFlow it is the `tf.Variable`, on JAX the array)."""
    return getattr(variable, "_value", None) is not None


def variable_initializer(variable):
    """The initializer a variable without a value will be made from, else None
    (3.15.1: `KerasVariable._initializer`; reading `.value` calls it)."""
    return getattr(variable, "_initializer", None)


def set_variable_initializer(variable, initializer) -> None:
    """Replaces the initializer of a variable without a value (3.15.1:
    `KerasVariable._initializer`)."""
    variable._initializer = initializer


def uninitialized_variables() -> list:
    """Keras' list of the variables that the next exit of an outermost
    `StatelessScope(initialize_variables=True)` will initialise (3.15.1: the global
    attribute "uninitialized_variables" of `keras.src.backend.common.global_state`,
    appended to by `register_uninitialized_variable`, emptied by
    `initialize_all_variables`)."""
    from keras.src.backend.common import global_state

    return list(global_state.get_global_attribute("uninitialized_variables") or [])


def set_uninitialized_variables(variables) -> None:
    """Sets that list (3.15.1: the same global attribute)."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute("uninitialized_variables", list(variables))


def initialize_variable_layout(variable) -> None:
    """Gives a variable without a layout the active distribution's, as Keras does when
    it initialises one (JAX 3.15.1: `JaxVariable._initialize_layout`, which asks
    `distribution.get_variable_layout(variable)`; the TensorFlow variable has no
    layouts: nothing to do)."""
    initialize_layout = getattr(variable, "_initialize_layout", None)
    if initialize_layout is not None:
        initialize_layout()


def initialize_deferred(variable) -> None:
    """Keras' own initialisation of a variable without a value, from its initializer
    (3.15.1: `KerasVariable._deferred_initialize`; the TensorFlow variable makes its
    `tf.Variable` in `tf.init_scope()`, the JAX one lays the value out as
    `_initialize_with_initializer` does)."""
    variable._deferred_initialize()


def set_initialized_value(variable, value) -> None:
    """Gives a variable without a value the already laid out `value` (3.15.1: JAX's
    `JaxVariable._initialize_with_initializer` sets `_value` so for a variable it
    initialises sharded; the initializer is then dropped, as
    `_deferred_initialize` drops it)."""
    variable._value = value
    variable._initializer = None


def _wrap_once(owner, attribute: str, key, make) -> None:
    """Replaces `owner.<attribute>` (a function in the class's own dict) by
    `make(original)`; a second call with the same `key` is a no-op, one with another
    `key` replaces the first wrapper (never wraps a wrapper)."""
    current = owner.__dict__[attribute]
    if getattr(current, "_ktm_key", None) is key:
        return
    original = getattr(current, "_ktm_original", current)
    wrapper = make(original)
    wrapper._ktm_key = key
    wrapper._ktm_original = original
    setattr(owner, attribute, wrapper)


def intercept_variable_init(interceptor) -> None:
    """Routes every Keras variable's construction through
    `interceptor(init, variable, initializer, shape, dtype, *args, **kwargs)`, where
    `init` is Keras' own `__init__` (installed once per `interceptor`).

    3.15.1: the backends' variable classes (TensorFlow's `Variable`, JAX's
    `JaxVariable`) inherit `__init__` from `keras.src.backend.common.variables.Variable`
    (`KerasVariable`); with NNX on, `JaxVariable.__init__` calls it.
    """
    import functools

    from keras.src.backend.common.variables import Variable

    def make(init):
        @functools.wraps(init)
        def __init__(self, initializer, shape=None, dtype=None, *args, **kwargs):
            interceptor(init, self, initializer, shape, dtype, *args, **kwargs)

        return __init__

    _wrap_once(Variable, "__init__", interceptor, make)


def intercept_slot_creation(interceptor) -> None:
    """Routes `optimizer.add_variable_from_reference(reference, name, initializer)`
    through `interceptor(own, base, optimizer, reference, name, initializer)`: `own` is
    the optimizer class's method, `base` Keras' backend-neutral one (installed once
    per `interceptor`).

    3.15.1: every optimizer slot (momentum, velocity, accumulator) is made by
    `BaseOptimizer.add_variable_from_reference` (`add_optimizer_variables` calls it);
    the TensorFlow optimizer (`keras.src.backend.tensorflow.optimizer.TFOptimizer`)
    overrides it to colocate the slot with `reference.value`, which reads the
    reference's value.
    """
    import functools

    import keras
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    owners = [BaseOptimizer]
    if keras.backend.backend() == "tensorflow":
        from keras.src.backend.tensorflow.optimizer import TFOptimizer

        owners.append(TFOptimizer)
    base = BaseOptimizer.__dict__["add_variable_from_reference"]
    base = getattr(base, "_ktm_original", base)

    def make(own):
        @functools.wraps(own)
        def add_variable_from_reference(self, reference_variable, name=None,
                                        initializer="zeros"):
            return interceptor(own, base, self, reference_variable, name, initializer)

        return add_variable_from_reference

    for owner in owners:
        _wrap_once(owner, "add_variable_from_reference", interceptor, make)


def intercept_variable_key(interceptor) -> None:
    """Routes the TensorFlow optimizer's `_var_key(variable)` through
    `interceptor(own, optimizer, variable)` (installed once per `interceptor`; nothing
    to do on JAX).

    3.15.1: optimizers index their slots by `_var_key(variable)`; Keras'
    TensorFlow optimizer (`TFOptimizer._var_key`) reads `variable.value` for the
    `tf.Variable`'s `_unique_id`, which a variable without a value does not have.
    The JAX optimizer keys by `id(variable)`.
    """
    import functools

    import keras

    if keras.backend.backend() != "tensorflow":
        return
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    def make(own):
        @functools.wraps(own)
        def _var_key(self, variable):
            return interceptor(own, self, variable)

        return _var_key

    _wrap_once(TFOptimizer, "_var_key", interceptor, make)


def compile_metric_variables(model) -> list:
    """The variables of the metric objects given to `model.compile(metrics=...,
    weighted_metrics=...)`, whether or not Keras has built its `CompileMetrics` yet.

    `model.metrics_variables` lists them only once a fit or an evaluate has built the
    compiled metrics; a metric passed as an object (keras-hub's tasks compile with
    `weighted_metrics=[SparseCategoricalAccuracy()]`) made its variables when it was
    constructed. Keras 3.12-3.16 keep the objects as given in
    `model._compile_metrics._user_metrics` / `._user_weighted_metrics` (lists or dicts,
    nested; strings are made into metrics at build).
    """
    import keras

    compile_metrics = getattr(model, "_compile_metrics", None)
    if compile_metrics is None:
        return []
    found = []
    for attribute in ("_user_metrics", "_user_weighted_metrics"):
        given = getattr(compile_metrics, attribute, None)
        for metric in keras.tree.flatten(given) if given is not None else ():
            if isinstance(metric, keras.metrics.Metric):
                found.extend(metric.variables)
    return found


def rekey_optimizer(optimizer) -> None:
    """Recomputes a built optimizer's index of its weights (3.15.1:
    `BaseOptimizer.build` maps `_var_key(weight)` to the weight's position in
    `_trainable_variables`, in `_trainable_variables_indices`); needed on TensorFlow
    after the weights' `tf.Variable`s are made, as keys depend on them."""
    weights = getattr(optimizer, "_trainable_variables", None)
    if weights is None or not getattr(optimizer, "built", False):
        return
    optimizer._trainable_variables_indices = {
        optimizer._var_key(weight): index for index, weight in enumerate(weights)}


def optimizer_slot_positions(optimizer, weights) -> list[list[int]]:
    """Per weight of `weights`, the positions in `optimizer.variables` of its own slots
    (momentum, velocity, ...; none for a weight the optimizer was not built for).

    3.12-3.16: a built optimizer numbers its weights (`_get_variable_index`: the
    weight's position in `_trainable_variables`, keyed by `_var_key`) and keeps each
    kind of slot as a list by that number (Adam's `_momentums` and `_velocities`,
    SGD's `momentums`, ...): every list attribute holding one optimizer variable (or
    None) per weight is such a list. A wrapper (`LossScaleOptimizer`) keeps them on
    its `inner_optimizer`, whose variables are among its own.
    """
    positions = {id(v): i for i, v in enumerate(optimizer.variables)}
    found = [[] for _ in weights]
    owners = [optimizer, getattr(optimizer, "inner_optimizer", None)]
    for owner in owners:
        if owner is None or not getattr(owner, "built", False):
            continue
        count = len(owner._trainable_variables)
        slot_lists = [
            value for name, value in vars(owner).items()
            if name not in ("_variables", "_trainable_variables")
            and isinstance(value, list) and len(value) == count
            and any(v is not None for v in value)
            and all(v is None or id(v) in positions for v in value)]
        indices = owner._trainable_variables_indices
        for out, weight in zip(found, weights):
            index = indices.get(owner._var_key(weight))
            if index is None:
                continue
            out.extend(positions[id(slots[index])] for slots in slot_lists
                       if slots[index] is not None)
    return [sorted(set(p)) for p in found]


def intercept_direct_assign(interceptor) -> None:
    """Routes every write of a Keras variable's value outside a stateless scope through
    `interceptor(own, variable, value)` (installed once per `interceptor`).

    3.15.1: `Variable.assign` calls `_direct_assign(value)`, defined by the backend
    variable class `keras.Variable` derives from (TensorFlow's `Variable` assigns to
    the `tf.Variable` in `_value`, JAX's `JaxVariable` sets `_value` after laying the
    value out); inside a stateless scope `assign` records the update instead.
    """
    import functools

    import keras

    def make(own):
        @functools.wraps(own)
        def _direct_assign(self, value):
            return interceptor(own, self, value)

        return _direct_assign

    owner = next(c for c in keras.Variable.__mro__ if "_direct_assign" in c.__dict__)
    _wrap_once(owner, "_direct_assign", interceptor, make)


def intercept_model_runs(interceptor) -> None:
    """Routes every Keras model's `fit`, `evaluate` and `predict` through
    `interceptor(own, model, method, *args, **kwargs)`, `method` being the name
    (installed once per `interceptor`).

    3.12-3.16: the three are defined by the backend's trainer class, which
    `keras.Model` derives from (`JAXTrainer`; TensorFlow's `TensorFlowTrainer`,
    `Trainer` in 3.16); a subclass that overrides one and calls `super()`
    (keras-hub's `PipelineModel`: preprocessing, then Keras' own) reaches the
    wrapper too.
    """
    import functools

    import keras

    for method in ("fit", "evaluate", "predict"):
        def make(own, method=method):
            @functools.wraps(own)
            def run(self, *args, **kwargs):
                return interceptor(own, self, method, *args, **kwargs)

            return run

        owner = next(c for c in keras.Model.__mro__ if method in c.__dict__)
        _wrap_once(owner, method, interceptor, make)
