"""Keras internals (any backend). Versions: checked on Keras 3.12.0, 3.15.1 and
keras-nightly 3.16.0.dev2026102704; `tests/test_compat.py` names each one."""

from __future__ import annotations


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
