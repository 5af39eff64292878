"""`Distillation`: knowledge distillation as a callback on the student's own `fit`.

Two ways to get the teacher's logits into the student's train step:

* **live teacher** – `Distillation(teacher)`: the frozen teacher runs in
  inference mode inside the compiled step, on every replica (and on every
  micro-batch under `GradientAccumulation`);
* **cached logits** – `cache_teacher_logits(teacher, dataset)` runs the teacher
  once and returns a dataset whose elements carry its logits next to each
  example (optionally saved to disk, `load_teacher_logits(path)` reads them
  back); `Distillation()` (no teacher) reads them from the batch. The teacher is
  then not part of the training program at all: its weights take no
  accelerator memory.

Element structure of a cached dataset: `(data, logits)`, where `data` is the
original element unchanged (`x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`)
and `logits` is a dict with one of two layouts:

* `{"ktm_teacher_logits": [..., classes]}` (all classes), or
* `{"ktm_teacher_top_k_values": [..., k], "ktm_teacher_top_k_indices": [..., k]}`.

The logits travel inside each element, so `shuffle`, `batch`, `unbatch`,
`repeat`, `cache` and `tpu.distribute(...)` keep them with their examples.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import keras
import numpy as np

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import logger
from keras_tpu_mem.engine import EngineCallback

LOGITS_KEY = "ktm_teacher_logits"
TOP_K_VALUES_KEY = "ktm_teacher_top_k_values"
TOP_K_INDICES_KEY = "ktm_teacher_top_k_indices"
_KEYS = frozenset((LOGITS_KEY, TOP_K_VALUES_KEY, TOP_K_INDICES_KEY))

_FORMAT = "keras_tpu_mem.teacher_logits"
_FORMAT_VERSION = 1
_METADATA_FILE = "ktm_teacher_logits.json"
# Examples are written to disk in parts of about this many bytes, so that
# caching a dataset larger than host memory never holds more than one part.
_PART_BYTES = 256 * 2**20

ops = keras.ops


def _tensorflow():
    """TensorFlow, imported where only the TensorFlow backend's code paths need it.

    The KL term and the array cache are `keras.ops`/numpy and import no
    TensorFlow, so this module imports on a JAX-only install.
    """
    import tensorflow as tf

    return tf


def _on_tensorflow() -> bool:
    return keras.backend.backend() == "tensorflow"


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------
def _check_number(value, name, accepted):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        if (ops.is_tensor(value) and len(value.shape) == 0
                and keras.backend.is_float_dtype(keras.backend.standardize_dtype(value.dtype))):
            return float(value)
        raise TypeError(f"`{name}` must be {accepted}, got {value!r} ({type(value).__name__}).")
    return float(value)


def _check_temperature(value, where=""):
    value = _check_number(value, "temperature", "a float > 0 or a callable of the epoch")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`temperature` must be a finite float > 0{where}, got {value}.")
    return value


def _check_alpha(value, where=""):
    value = _check_number(value, "alpha", "a float in [0, 1] or a callable of the epoch")
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"`alpha` must be a float in [0, 1]{where}, got {value}.")
    return value


def _check_top_k(top_k):
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"`top_k` must be None or an int >= 1, got {top_k!r}.")
    if top_k < 1:
        raise ValueError(f"`top_k` must be None or an int >= 1, got {top_k}.")
    return top_k


def _check_top_k_classes(top_k, num_classes, who):
    if top_k is not None and num_classes is not None and top_k > num_classes:
        raise ValueError(
            f"`top_k`={top_k} is larger than the number of classes ({num_classes}) of "
            f"{who}. Use top_k <= {num_classes}, or top_k=None to keep all logits."
        )


def _single_output(value, who):
    if isinstance(value, (dict, list, tuple)):
        raise TypeError(
            f"Distillation needs {who} with a single logits output, got a "
            f"{type(value).__name__} of outputs."
        )
    return value


def _ends_in_probabilities(model) -> str | None:
    """Name of the final activation when the model outputs probabilities."""
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    last = layers[-1]
    if isinstance(last, keras.layers.Softmax):
        return "softmax"
    activation = getattr(last, "activation", None)
    for fn in (keras.activations.softmax, keras.activations.sigmoid):
        if activation is fn:
            return fn.__name__
    return None


def _output_classes(model):
    """The static size of the model's last output axis, or None when unknown."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError, TypeError):
        return None
    if not outputs or len(outputs) != 1:
        return None
    shape = tuple(outputs[0].shape)
    return shape[-1] if shape else None


def _tf_variable(variable):
    """The TensorFlow variable behind a Keras variable."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def _owner(variable):
    """The strategy a variable is distributed by, or None for a plain variable."""
    if not _on_tensorflow():
        return None  # no tf.distribute: variables are laid out by keras.distribution
    tf_var = _tf_variable(variable)
    if isinstance(tf_var, _tensorflow().distribute.DistributedValues):
        return tf_var.distribute_strategy
    return None


def _outside(model, owner):
    """Paths of the model's variables not distributed by `owner` (None: plain variables)."""
    return [v.path for v in model.weights if _owner(v) is not owner]


def _student_owner(student):
    """`(True, owner)` when all the student's variables share one owner, else `(False, None)`.

    A student with mixed variables (some made under a strategy, some not) gives
    nothing sensible to compare a teacher with.
    """
    owners = {id(_owner(v)): _owner(v) for v in student.weights}
    if len(owners) != 1:
        return False, None
    return True, next(iter(owners.values()))


def _describe_strategy(strategy):
    # The default strategy's class is private (`_DefaultDistributionStrategy`).
    name = type(strategy).__name__.lstrip("_")
    return f"{name} ({strategy.num_replicas_in_sync} replica(s))"


def _copy_into_strategy(teacher, strategy, owner, *, who, advice):
    """A frozen copy of `teacher` whose variables are created under `strategy`.

    `keras.models.clone_model` (under `strategy.scope()`) rebuilds the teacher
    from its config, then its weights are assigned. Sequential and Functional
    models always clone; a subclassed model clones only through its
    `get_config()` / `from_config()`. Whatever cannot be cloned into the same
    variable structure raises: a teacher with other weights than the user's
    must never be distilled from.
    """
    where = _describe_strategy(strategy)

    def cannot(reason):
        return ValueError(
            f"{who}: the teacher {teacher.name!r} has variables outside the "
            f"{where} it must run under (e.g. {_outside(teacher, owner)[0]!r}), and it "
            f"could not be copied into that strategy: {reason}. {advice}"
        )

    try:
        with strategy.scope():
            copy = keras.models.clone_model(teacher)
            build_config = teacher.get_build_config()
            if not copy.built and build_config is not None:
                copy.build_from_config(build_config)
    except Exception as error:  # whatever clone_model raises: say so, with the cause chained
        # The cause is also in the message: Keras' traceback filtering drops
        # `__cause__` when the error leaves `fit`.
        said = " ".join(str(error).split())
        said = said if len(said) <= 240 else said[:240] + "..."
        raise cannot(f"keras.models.clone_model failed ({type(error).__name__}: {said})"
                     ) from error
    if not copy.built:
        raise cannot("its clone is not built and the teacher records no input shape to "
                     "build it from")
    source, target = teacher.weights, copy.weights
    if len(source) != len(target) or any(
            tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype
            for a, b in zip(source, target)):
        raise cannot(
            f"its clone has {len(target)} variables of other shapes or dtypes than the "
            f"teacher's {len(source)} (a get_config() that does not describe the model?)")
    stray = _outside(copy, owner)
    if stray:
        raise cannot(f"the clone's variable {stray[0]!r} was not created under the strategy")
    # Frozen: `trainable=False` is what Keras reads to exclude variables from
    # training; the step also calls it with training=False under stop_gradient.
    copy.trainable = False
    _assign_weights(copy, teacher, strategy)
    logger.info(
        "%s: copied the teacher %r (%d variables, %d parameters) into the %s, because "
        "its variables were created outside that strategy's scope; the copy is frozen "
        "and runs in inference mode (create or load the teacher under strategy.scope() "
        "to use it as is).", who, teacher.name, len(source), teacher.count_params(), where)
    return copy


def _assign_weights(copy, teacher, strategy):
    """Assigns the teacher's current weights to its copy (no new variables).

    Each value is read into host memory before entering `strategy.scope()` (a
    variable of another strategy is read as that strategy allows), one variable
    at a time, then assigned in that scope's cross-replica context, which
    writes every replica's copy.
    """
    for target, source in zip(copy.weights, teacher.weights):
        value = keras.ops.convert_to_numpy(source)
        with strategy.scope():
            target.assign(value)


# --------------------------------------------------------------------------
# the KL term
# --------------------------------------------------------------------------
def distillation_kl(student_logits, temperature, teacher_logits=None, *,
                    top_k_values=None, top_k_indices=None):
    """Per-example `KL(softmax(t/T) || softmax(s/T))` over the last axis, in float32.

    Give either the teacher's full `teacher_logits` or its top-k
    (`top_k_values`, `top_k_indices`). With top-k, the teacher distribution is
    `softmax` over the kept classes only (renormalised, zero elsewhere), and the
    KL is taken against the student's full distribution:
    `sum_{i in K} p_i (log p_i - log q_i)`.

    Returns:
        A float32 tensor of the logits' shape without the last axis.
    """
    # keras.ops: on TensorFlow the same tf.nn.log_softmax / tf.exp /
    # tf.reduce_sum as before (take_along_axis is the batched gather), and the
    # same program runs in a jitted JAX step.
    temperature = ops.cast(temperature, "float32")
    s = ops.cast(student_logits, "float32") / temperature
    log_q = ops.log_softmax(s, axis=-1)
    if teacher_logits is not None:
        t = ops.cast(teacher_logits, "float32") / temperature
        log_p = ops.log_softmax(t, axis=-1)
        return ops.sum(ops.exp(log_p) * (log_p - log_q), axis=-1)
    t = ops.cast(top_k_values, "float32") / temperature
    log_p = ops.log_softmax(t, axis=-1)
    indices = ops.cast(top_k_indices, "int32")
    log_q_kept = ops.take_along_axis(log_q, indices, axis=-1)
    return ops.sum(ops.exp(log_p) * (log_p - log_q_kept), axis=-1)


def _top_k(logits, k):
    """The k largest logits (float32, descending) and their int32 class indices."""
    values, indices = ops.top_k(ops.cast(logits, "float32"), k=k)
    return values, ops.cast(indices, "int32")


def _regularization_loss(model):
    """The regularisation part of Keras' `compute_loss` (replica-scaled), or None.

    None too when the model overrides `compute_loss`: its total cannot be split,
    so all of it is weighted by `1 - alpha`.
    """
    from keras_tpu_mem.engine import overrides

    if overrides(model, "compute_loss"):
        return None
    losses = model.losses
    if not losses:
        return None
    total = None
    for loss in losses:
        value = ops.cast(keras_compat.aggregate_additional_loss(model, loss), "float32")
        total = value if total is None else total + value
    return total


# --------------------------------------------------------------------------
# the callback
# --------------------------------------------------------------------------
class Distillation(EngineCallback):
    """Adds a distillation term to the student's loss, inside its own `fit`.

    The loss the student differentiates becomes

        (1 - alpha) * compiled_loss + alpha * T**2 * mean_batch KL(softmax(t/T) || softmax(s/T))

    where `s` are the student's logits, `t` the teacher's and `T` the
    temperature (Hinton et al., 2015; the `T**2` keeps the gradient scale
    independent of `T`). The KL term is computed in float32 whatever the
    student's compute dtype (a float32 teacher with a bfloat16 student works),
    reduced like Keras' own losses (`sum_over_batch_size`: sample weights and
    the output mask apply, divided by the number of examples) and scaled for the
    replicas exactly as Keras scales its loss, so the loss and the update are
    the same on 1 or N replicas. Under `GradientAccumulation` the term is the
    mean of each micro-batch, which the engine averages like the compiled loss:
    the update equals the full batch's.

    **Sample weights** (and `class_weight`, which Keras turns into sample
    weights) weight the distillation term as they weight the compiled loss, so
    a padding example with weight 0 contributes nothing at all.

    **Regularisation losses** (`kernel_regularizer`, `add_loss`) keep their
    full weight; only the compiled loss is weighted by `1 - alpha`. (A model
    that overrides `compute_loss` has its whole loss weighted by `1 - alpha`.)

    The logged `loss` is the total that is differentiated.

    **Teacher.** With a `teacher` model, it runs frozen (`training=False`,
    `tf.stop_gradient`, none of its variables trained; BatchNormalization uses
    its moving statistics) inside the compiled step, on each replica's (micro-)
    batch. It must be built and output logits of the student's shape. With
    `teacher=None` the logits come from a dataset made by `cache_teacher_logits`
    (or `load_teacher_logits`): the teacher takes no memory during training.

    **A teacher from anywhere.** A teacher created or loaded under the student's
    strategy scope is used as is. One whose variables live elsewhere (loaded
    with `keras.models.load_model` before `strategy.scope()`, or trained on the
    default strategy) is copied into the student's strategy at the first `fit`
    (`keras.models.clone_model` under `student.distribute_strategy.scope()`,
    then its weights; frozen; one INFO line on the `keras_tpu_mem` logger), so
    that its variables live where the replicas run. `self.teacher` stays the
    model you passed; `step_teacher` is the one the step runs. Later fits of the
    same callback reuse the copy (no second clone, no new variables) and assign
    it the teacher's current weights, so a teacher changed between fits is
    distilled as it is now. The copy costs the teacher's size again, on every
    replica, for the callback's lifetime; creating the teacher under the scope
    avoids it. A teacher `clone_model` cannot rebuild with the same variables
    (a subclassed model without a working `get_config()`) raises a ValueError
    saying to create or load it under `strategy.scope()`.

    **Top-k.** `top_k=k` keeps the teacher's k largest logits: the teacher
    distribution is renormalised over those k classes (zero elsewhere) and the
    KL is taken against the student's full softmax. This is an approximation:
    it drops the teacher's mass outside the top k (small when the teacher is
    confident) and pushes the student's mass there towards zero. With a cached
    top-k dataset, `top_k=None` uses the cached k; a smaller `top_k` uses the
    first k cached values.

    `temperature` and `alpha` may be callables of the epoch (0-based); they are
    held in Keras variables updated at the start of every epoch, so changing
    them never retraces the step, and after a `BackupAndRestore` resume they are
    recomputed from the restored epoch.

    The student stays the user's model: nothing is wrapped, and after `fit` it
    is saved, evaluated and used as usual.

    Args:
        teacher: A built `keras.Model` outputting logits, or `None` to read
            logits cached in the dataset by `cache_teacher_logits`.
        temperature: Softmax temperature `T > 0`, or a callable `epoch -> T`.
        alpha: Weight of the distillation term in `[0, 1]` (`1 - alpha` weights
            the compiled loss), or a callable `epoch -> alpha`.
        top_k: `None` (all logits) or the number of teacher logits kept.

    Example:

    ```python
    import numpy as np, keras, tensorflow as tf
    import keras_tpu_mem as ktm

    x = np.random.rand(256, 8).astype("float32")
    y = np.random.randint(0, 4, 256)
    teacher = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64, activation="relu"),
                                keras.layers.Dense(4)])
    student = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    for model in (teacher, student):
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    teacher.fit(x, y, epochs=2, verbose=0)

    # Live teacher inside the student's step:
    student.fit(x, y, batch_size=32, epochs=1, verbose=0,
                callbacks=[ktm.Distillation(teacher, temperature=2.0, alpha=0.5)])

    # Or: run the teacher once, train without it.
    cached = ktm.cache_teacher_logits(teacher, tf.data.Dataset.from_tensor_slices((x, y)).batch(64))
    student.fit(cached.shuffle(256).batch(32), epochs=1, verbose=0,
                callbacks=[ktm.Distillation(temperature=2.0, alpha=0.5)])
    ```
    """

    name = "distillation"
    order = 50

    def __init__(self, teacher=None, *, temperature: float | Callable = 2.0,
                 alpha: float | Callable = 0.5, top_k: int | None = None):
        super().__init__()
        if teacher is not None:
            if not isinstance(teacher, keras.Model):
                raise TypeError(
                    "`teacher` must be a keras.Model or None (to read logits cached with "
                    f"ktm.cache_teacher_logits), got {type(teacher).__name__}."
                )
            if not teacher.built:
                raise ValueError(
                    "The teacher is not built, so it has no trained weights to distil "
                    "(it would be built with fresh random weights inside the student's "
                    "step). Build it first: define it with keras.Input, load it with "
                    "keras.models.load_model, or call it on a batch."
                )
        self.teacher = teacher
        self.top_k = _check_top_k(top_k)
        if teacher is not None:
            _check_top_k_classes(self.top_k, _output_classes(teacher), "the teacher")
        self._temperature_fn = temperature if callable(temperature) else None
        self._alpha_fn = alpha if callable(alpha) else None
        self.temperature = None if callable(temperature) else _check_temperature(temperature)
        self.alpha = None if callable(alpha) else _check_alpha(alpha)
        self._variables = None  # (temperature, alpha) Keras variables, made in install
        self._variables_strategy = None
        # The model the step runs: the teacher, or its copy under the student's
        # strategy (set in install). The copy is kept as (teacher, strategy, copy)
        # so that later fits reuse it instead of cloning again.
        self._step_teacher = None
        self._teacher_copy = None

    @property
    def step_teacher(self):
        """The model that runs inside the student's step (None before the first fit).

        `teacher` itself when its variables live under the student's strategy;
        otherwise the frozen copy made there (see the class docstring).
        """
        return self._step_teacher

    def _teacher_for(self, student):
        """The teacher, or its copy under the student's strategy, for this fit."""
        teacher = self.teacher
        comparable, owner = _student_owner(student)
        if not comparable or not _outside(teacher, owner):
            return teacher  # already where the student's replicas run: used as is
        # Its variables live elsewhere (made before `strategy.scope()`, or under
        # another strategy): the replicas would read them across devices at
        # every step (on a TPU not assumed to work at all). Run a copy made there.
        strategy = student.distribute_strategy
        cached = self._teacher_copy
        if cached is not None and cached[0] is teacher and cached[1] is strategy:
            # No second clone; the copy takes the teacher's current weights, so a
            # teacher trained further between two fits is distilled as it is now
            # (as a teacher under the strategy would be).
            _assign_weights(cached[2], teacher, strategy)
            return cached[2]
        copy = _copy_into_strategy(
            teacher, strategy, owner, who="Distillation",
            advice="Create or load the teacher inside the same `strategy.scope()` as the "
                   "student (e.g. `with tpu.scope(): teacher = keras.models.load_model(...)`)"
                   ", or cache its logits with ktm.cache_teacher_logits and pass "
                   "teacher=None.")
        self._teacher_copy = (teacher, strategy, copy)
        return copy

    # ----------------------------------------------------------- config
    def get_config(self):
        """The schedule and top-k; the teacher (a model) is saved separately."""

        def value(constant, fn):
            if fn is None:
                return constant
            return keras.saving.serialize_keras_object(fn)

        return {
            "temperature": value(self.temperature, self._temperature_fn),
            "alpha": value(self.alpha, self._alpha_fn),
            "top_k": self.top_k,
        }

    @classmethod
    def from_config(cls, config, teacher=None):
        config = dict(config)
        for key in ("temperature", "alpha"):
            if isinstance(config.get(key), dict):
                config[key] = keras.saving.deserialize_keras_object(config[key])
        return cls(teacher, **config)

    # --------------------------------------------------- current values
    def _value(self, constant, fn, epoch, check):
        if fn is None:
            return constant
        return check(fn(epoch), where=f" (returned by the schedule for epoch {epoch})")

    def _assign(self, epoch):
        temperature = self._value(self.temperature, self._temperature_fn, epoch,
                                  _check_temperature)
        alpha = self._value(self.alpha, self._alpha_fn, epoch, _check_alpha)
        t_var, a_var = self._variables
        t_var.assign(temperature)
        a_var.assign(alpha)

    # ----------------------------------------------------------- engine
    def install(self, model):
        # On JAX there is no tf.distribute: variables are laid out by the active
        # keras.distribution (build the teacher in the same `distribution.scope()`).
        strategy = model.distribute_strategy if _on_tensorflow() else None
        teacher = self.teacher
        if teacher is not None:
            if teacher is model:
                raise ValueError("The teacher is the student itself; pass a separate model.")
            trainable = {id(_tf_variable(v)) for v in model.trainable_weights}
            shared = [v.path for v in teacher.weights if id(_tf_variable(v)) in trainable]
            if shared:
                raise ValueError(
                    "The teacher shares variables with the student's trainable weights "
                    f"({', '.join(shared[:3])}{', ...' if len(shared) > 3 else ''}); "
                    "Distillation keeps the teacher frozen, so use a separate teacher model."
                )
            t_classes, s_classes = _output_classes(teacher), _output_classes(model)
            if t_classes is not None and s_classes is not None and t_classes != s_classes:
                raise ValueError(
                    f"The teacher outputs {t_classes} logits per example but the student "
                    f"outputs {s_classes}; Distillation needs the same classes in the same "
                    "order."
                )
            which = _ends_in_probabilities(teacher)
            if which:
                raise ValueError(
                    f"The teacher's last layer applies {which}: Distillation needs logits. "
                    "Remove the final activation (and compile with from_logits=True)."
                )
        which = _ends_in_probabilities(model)
        if which:
            raise ValueError(
                f"The student's last layer applies {which}: Distillation needs logits. "
                "Remove the final activation and compile the loss with from_logits=True."
            )
        if teacher is None or not _on_tensorflow():
            self._step_teacher = teacher
        else:
            self._step_teacher = self._teacher_for(model)
        if self._variables is None or self._variables_strategy is not strategy:
            import contextlib

            with strategy.scope() if strategy is not None else contextlib.nullcontext():
                self._variables = (
                    keras.Variable(1.0, dtype="float32", trainable=False,
                                   name="distillation_temperature"),
                    keras.Variable(0.0, dtype="float32", trainable=False,
                                   name="distillation_alpha"),
                )
            self._variables_strategy = strategy
        # Constants are final now; schedules are set at every epoch start (a
        # resumed fit starts at the restored epoch).
        self._assign(int(getattr(model, "_initial_epoch", None) or 0))

    def step_variables(self):
        # Temperature and alpha: set between steps (schedules), read by the step.
        return list(self._variables or ())

    def frozen_variables(self):
        # The teacher's weights enter the JAX step as inputs, not as constants
        # embedded in the program (and are never differentiated nor returned).
        return list(self._step_teacher.weights) if self._step_teacher is not None else []

    def on_epoch_begin(self, epoch, logs=None):
        if self._variables is not None:
            self._assign(epoch)

    def split_extras(self, data):
        if _is_cached_element(data):
            if self.teacher is not None:
                raise ValueError(
                    "The dataset carries cached teacher logits and Distillation was also "
                    "given a teacher: pass teacher=None to train from the cached logits, "
                    "or a dataset without them to use the live teacher."
                )
            data, logits = data
            return data, dict(logits)
        if self.teacher is None:
            raise ValueError(
                "Distillation(teacher=None) reads teacher logits cached in the dataset, but "
                "its elements carry none. Make the dataset with "
                "ktm.cache_teacher_logits(teacher, dataset) or "
                "ktm.load_teacher_logits(path), or pass the teacher model."
            )
        return data, {}

    def transform_loss(self, loss, ctx):
        student = _single_output(ctx.y_pred, "a student")
        classes = student.shape[-1]
        temperature, alpha = self._variables
        if self.teacher is not None:
            teacher = self._step_teacher(ctx.x, training=False)
            teacher = ops.stop_gradient(_single_output(teacher, "a teacher"))
            if tuple(teacher.shape)[1:] != tuple(student.shape)[1:]:
                raise ValueError(
                    f"The teacher's logits have shape {teacher.shape} per batch but the "
                    f"student's have {student.shape}; Distillation needs the same shape "
                    "(the same classes in the same order)."
                )
            if self.top_k is None:
                kl = distillation_kl(student, temperature.value, teacher)
            else:
                _check_top_k_classes(self.top_k, classes, "the teacher")
                values, indices = _top_k(teacher, self.top_k)
                kl = distillation_kl(student, temperature.value, top_k_values=values,
                                     top_k_indices=indices)
        else:
            kl = self._cached_kl(student, ctx.extras, temperature.value)
        mask = getattr(student, "_keras_mask", None)
        # Keras' own reduction: sample weights and mask apply, divided by the
        # number of examples, then by the number of replicas.
        term = keras_compat.reduce_weighted_values(kl, sample_weight=ctx.sample_weight, mask=mask,
                                                  reduction="sum_over_batch_size", dtype="float32")
        alpha = ops.cast(alpha.value, "float32")
        term = alpha * ops.square(ops.cast(temperature.value, "float32")) * term
        # Regularisation losses (kernel_regularizer, add_loss) keep their full
        # weight: `loss` includes them, so give back the alpha part.
        regularization = _regularization_loss(ctx.model)
        if regularization is not None:
            term = term + alpha * regularization
        return ops.cast(1.0 - alpha, loss.dtype) * loss + ops.cast(term, loss.dtype)

    def _cached_kl(self, student, extras, temperature):
        classes = student.shape[-1]
        if LOGITS_KEY in extras:
            logits = extras[LOGITS_KEY]
            if tuple(logits.shape)[1:] != tuple(student.shape)[1:]:
                raise ValueError(
                    f"The cached teacher logits have shape {logits.shape} per batch but the "
                    f"student's logits have {student.shape}; the cache was made with "
                    "another teacher (different classes)."
                )
            if self.top_k is None:
                return distillation_kl(student, temperature, logits)
            _check_top_k_classes(self.top_k, classes, "the cached teacher logits")
            values, indices = _top_k(logits, self.top_k)
        else:
            values, indices = extras[TOP_K_VALUES_KEY], extras[TOP_K_INDICES_KEY]
            cached_k = values.shape[-1]
            if tuple(values.shape)[1:-1] != tuple(student.shape)[1:-1]:
                raise ValueError(
                    f"The cached teacher top-k logits have shape {values.shape} per batch, "
                    f"which does not match the student's logits {student.shape}."
                )
            _check_top_k_classes(cached_k, classes, "the student")
            if self.top_k is not None:
                if self.top_k > cached_k:
                    raise ValueError(
                        f"Distillation(top_k={self.top_k}) but the dataset caches only the "
                        f"teacher's top {cached_k} logits; use top_k <= {cached_k} or "
                        "top_k=None (all cached)."
                    )
                values, indices = values[..., : self.top_k], indices[..., : self.top_k]
        return distillation_kl(student, temperature, top_k_values=values,
                               top_k_indices=indices)


# --------------------------------------------------------------------------
# cached logits
# --------------------------------------------------------------------------
def _is_cached_element(data) -> bool:
    return (
        isinstance(data, tuple)
        and len(data) == 2
        and isinstance(data[1], dict)
        and bool(data[1])
        and set(data[1]) <= _KEYS
    )


def _teacher_runner(teacher, strategy, top_k):
    """A compiled function: global batch of inputs -> teacher logits, on all replicas."""
    tf = _tensorflow()

    replicas = strategy.num_replicas_in_sync

    def replica_fn(x):
        out = _single_output(teacher(x, training=False), "a teacher")
        out = tf.cast(out, tf.float32)
        if top_k is None:
            return {LOGITS_KEY: out}
        _check_top_k_classes(top_k, out.shape[-1], "the teacher")
        values, indices = _top_k(out, top_k)
        return {TOP_K_VALUES_KEY: values, TOP_K_INDICES_KEY: indices}

    @tf.function(reduce_retracing=True, autograph=False)
    def run(per_replica_x):
        return strategy.run(replica_fn, args=(per_replica_x,))

    def call(x):
        size = int(tf.shape(tf.nest.flatten(x)[0])[0])
        per = -(-size // replicas)
        pad = per * replicas - size

        def padded(t):
            t = tf.convert_to_tensor(t)
            if pad:
                t = tf.concat([t, tf.repeat(t[-1:], pad, axis=0)], axis=0)
            return t

        x = tf.nest.map_structure(padded, x)
        if replicas == 1:
            per_replica = x
        else:
            per_replica = strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.nest.map_structure(
                    lambda t: t[ctx.replica_id_in_sync_group * per:
                                (ctx.replica_id_in_sync_group + 1) * per], x))
        outputs = run(per_replica)
        # Replica results in replica order: the order of the batch's slices.
        return {k: np.concatenate([t.numpy() for t in strategy.experimental_local_results(v)],
                                  axis=0)[:size]
                for k, v in outputs.items()}

    return call


def _numpy_structure(data):
    tf = _tensorflow()

    def to_numpy(t):
        if isinstance(t, (tf.SparseTensor, tf.RaggedTensor)):
            raise TypeError(
                "cache_teacher_logits supports datasets of dense tensors; got a "
                f"{type(t).__name__}."
            )
        return t.numpy()

    return tf.nest.map_structure(to_numpy, data)


def _concat(parts):
    return keras.tree.map_structure(lambda *xs: np.concatenate(xs, axis=0), *parts)


def _nbytes(structure):
    return sum(getattr(a, "nbytes", 0) for a in keras.tree.flatten(structure))


# --------------------------------------------------------------------------
# cached logits from arrays: a PyDataset, and the npz format
# --------------------------------------------------------------------------
_NPZ_FORMAT = "keras_tpu_mem.teacher_logits.npz"
_NPZ_VERSION = 1
_NPZ_SUFFIX = ".npz"
_NPZ_METADATA = "metadata"  # a 0-d unicode array holding the JSON metadata
_DATA_PARTS = ("x", "y", "sample_weight")


def _is_tf_dataset(value) -> bool:
    # Without importing TensorFlow: a tf.data.Dataset can only exist if it is loaded.
    import sys

    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(value, tf.data.Dataset)


def _structure_spec(value):
    """A JSON description of a nest of arrays (dicts by sorted key, lists, tuples)."""
    if isinstance(value, dict):
        return {"dict": {str(k): _structure_spec(value[k]) for k in sorted(value)}}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple":
                [_structure_spec(v) for v in value]}
    return "array"


def _leaves(value, spec):
    if spec == "array":
        return [value]
    if "dict" in spec:
        return [leaf for k, sub in spec["dict"].items() for leaf in _leaves(value[k], sub)]
    kind = "list" if "list" in spec else "tuple"
    return [leaf for v, sub in zip(value, spec[kind]) for leaf in _leaves(v, sub)]


def _count_leaves(spec) -> int:
    if spec == "array":
        return 1
    subs = spec["dict"].values() if "dict" in spec else spec.get("list", spec.get("tuple"))
    return sum(_count_leaves(sub) for sub in subs)


def _rebuild(spec, leaves):
    """The nest `spec` describes, taking its arrays from the iterator `leaves`."""
    if spec == "array":
        return next(leaves)
    if "dict" in spec:
        return {k: _rebuild(sub, leaves) for k, sub in spec["dict"].items()}
    if "list" in spec:
        return [_rebuild(sub, leaves) for sub in spec["list"]]
    return tuple(_rebuild(sub, leaves) for sub in spec["tuple"])


def _split_data(data):
    """`(parts, single)`: the `x`, `y`, `sample_weight` present, and whether `data` is bare `x`."""
    if isinstance(data, (tuple, list)):
        if not 1 <= len(data) <= 3:
            raise ValueError(
                "`dataset` given as arrays must be x, (x,), (x, y) or (x, y, sample_weight); "
                f"got a {type(data).__name__} of {len(data)} items.")
        return list(data), False
    return [data], True


def _to_numpy_nest(value, where):
    try:
        return keras.tree.map_structure(lambda a: np.asarray(ops.convert_to_numpy(a)), value)
    except Exception as err:
        raise TypeError(
            f"`dataset` must be a tf.data.Dataset or arrays (numpy arrays or tensors); its "
            f"{where} could not be read as arrays ({type(err).__name__}: {err})."
        ) from err


class TeacherLogits(keras.utils.PyDataset):
    """Examples with the teacher's logits, as batches in order: what `fit` takes.

    Made by `cache_teacher_logits(teacher, (x, y), batch_size=...)` or
    `load_teacher_logits("cache.npz")`; works with every Keras backend. Batch
    `i` holds examples `[i * batch_size, (i + 1) * batch_size)` (the last batch
    may be smaller) as `(data, logits)`: `data` is `x`, `(x,)`, `(x, y)` or
    `(x, y, sample_weight)` as given, and `logits` a dict
    `{"ktm_teacher_logits": [b, classes]}` or
    `{"ktm_teacher_top_k_values": [b, k], "ktm_teacher_top_k_indices": [b, k]}`
    (float32 values, int32 indices): the structure `Distillation()` reads.
    Batches are not shuffled (`fit(shuffle=True)` does not shuffle a
    PyDataset): shuffle the arrays before caching if the order matters.

    Args:
        data: The examples, `x` or a tuple `(x[, y[, sample_weight]])` of numpy arrays.
        logits: The dict of per-example teacher arrays (see above).
        batch_size: Examples per batch (int >= 1).
        **kwargs: `keras.utils.PyDataset` arguments (`workers`, ...).

    Example:

    ```python
    cached = ktm.cache_teacher_logits(teacher, (x, y), batch_size=64)
    (x0, y0), logits0 = cached[0]         # the first 64 examples and their logits
    student.fit(cached, epochs=2, callbacks=[ktm.Distillation(temperature=2.0)])
    ```
    """

    def __init__(self, data, logits, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.batch_size = _check_batch_size(batch_size)
        if not isinstance(logits, dict) or not logits or not set(logits) <= _KEYS:
            raise ValueError(f"`logits` must be a dict with keys among {sorted(_KEYS)}.")
        self.data = data
        self.logits = {k: np.asarray(v) for k, v in logits.items()}
        self.num_examples = len(next(iter(self.logits.values())))
        for leaf in keras.tree.flatten(data):
            if len(leaf) != self.num_examples:
                raise ValueError(
                    f"Every array must hold {self.num_examples} examples (as the logits); "
                    f"got one of shape {tuple(np.shape(leaf))}.")

    @property
    def top_k(self) -> int | None:
        """The k of a top-k cache, None when all logits are kept."""
        values = self.logits.get(TOP_K_VALUES_KEY)
        return None if values is None else int(values.shape[-1])

    def __len__(self):
        return -(-self.num_examples // self.batch_size)

    def _slice(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(f"batch {index} out of range for {len(self)} batches")
        index %= len(self)
        return slice(index * self.batch_size, (index + 1) * self.batch_size)

    def __getitem__(self, index):
        part = self._slice(index)
        data = keras.tree.map_structure(lambda a: a[part], self.data)
        return data, {k: v[part] for k, v in self.logits.items()}

    def without_logits(self):
        """A PyDataset of the same batches without the logits (the original `data`)."""
        return _Batches(self)

    def save(self, path):
        """Writes the examples and logits to the `.npz` file `path` (see docs/distillation.md)."""
        path = _npz_path(path)
        parts, single = _split_data(self.data)
        arrays, structures = {}, {}
        for name, value in zip(_DATA_PARTS, parts):
            spec = _structure_spec(value)
            structures[name] = spec
            leaves = _leaves(value, spec)
            if spec == "array":
                arrays[name] = leaves[0]
            else:
                arrays.update({f"{name}_{i}": leaf for i, leaf in enumerate(leaves)})
        names = {LOGITS_KEY: "logits", TOP_K_VALUES_KEY: "top_k_values",
                 TOP_K_INDICES_KEY: "top_k_indices"}
        arrays.update({names[k]: v for k, v in self.logits.items()})
        metadata = {"format": _NPZ_FORMAT, "version": _NPZ_VERSION,
                    "num_examples": self.num_examples, "batch_size": self.batch_size,
                    "top_k": self.top_k, "single_x": single, "structures": structures}
        arrays[_NPZ_METADATA] = np.array(json.dumps(metadata))
        # Through a file object: np.savez would append ".npz" to a name without it.
        with open(path, "xb") as f:
            np.savez(f, **arrays)


class _Batches(keras.utils.PyDataset):
    """The batches of a `TeacherLogits` without the logits."""

    def __init__(self, cached):
        super().__init__()
        self._cached = cached

    def __len__(self):
        return len(self._cached)

    def __getitem__(self, index):
        part = self._cached._slice(index)
        return keras.tree.map_structure(lambda a: a[part], self._cached.data)


def _check_batch_size(batch_size):
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"`batch_size` must be an int >= 1, got {batch_size!r}.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be an int >= 1, got {batch_size}.")
    return int(batch_size)


def _npz_path(path):
    path = os.fspath(path)
    if not path.endswith(_NPZ_SUFFIX):
        raise ValueError(
            f"`path` {path!r}: a cache of arrays is one .npz file; give a name ending in "
            "'.npz' (a directory is for caching a tf.data.Dataset).")
    if os.path.exists(path):
        raise ValueError(f"`path` {path!r} already exists; the cache is never overwritten.")
    return path


def _cache_arrays(teacher, data, *, batch_size, top_k, path):
    batch_size = _check_batch_size(batch_size)
    top_k = _check_top_k(top_k)
    _check_top_k_classes(top_k, _output_classes(teacher), "the teacher")
    if path is not None:
        path = _npz_path(path)
    parts, single = _split_data(data)
    parts = [_to_numpy_nest(p, name) for p, name in zip(parts, _DATA_PARTS)]
    data = parts[0] if single else tuple(parts)
    bad = [np.shape(a) for a in keras.tree.flatten(parts)
           if np.ndim(a) == 0 or np.asarray(a).dtype == object]
    if bad:
        raise TypeError(
            "`dataset` must be a tf.data.Dataset or arrays with a leading example axis "
            f"(x, (x, y) or (x, y, sample_weight)); got an array of shape {bad[0]} or "
            "of objects.")
    x = parts[0]
    sizes = {len(leaf) for leaf in keras.tree.flatten(data)}
    if len(sizes) != 1:
        raise ValueError(f"`dataset` arrays must all hold the same number of examples; got "
                         f"lengths {sorted(sizes)}.")
    size = sizes.pop()
    if size == 0:
        raise ValueError("`dataset` is empty: there is nothing to cache.")
    # Padded to whole batches (the last example repeated, then cropped): under
    # a DataParallel distribution every predict batch must divide by the
    # devices, which a partial last batch would not.
    pad = -size % batch_size
    if pad:
        x_in = keras.tree.map_structure(
            lambda a: np.concatenate([a, np.repeat(a[-1:], pad, axis=0)]), x)
    else:
        x_in = x
    logits = _single_output(teacher.predict(x_in, batch_size=batch_size, verbose=0),
                            "a teacher")
    logits = np.asarray(ops.convert_to_numpy(ops.cast(logits, "float32")))[:size]
    if top_k is None:
        extras = {LOGITS_KEY: logits}
    else:
        # A stable descending sort: among equal logits the lower class first,
        # as tf.math.top_k / jax.lax.top_k order them.
        indices = np.argsort(-logits, axis=-1, kind="stable")[..., :top_k].astype(np.int32)
        extras = {TOP_K_VALUES_KEY: np.take_along_axis(logits, indices, axis=-1),
                  TOP_K_INDICES_KEY: indices}
    cached = TeacherLogits(data, extras, batch_size)
    logger.info("cache_teacher_logits: %d examples, %s.", size,
                "all logits" if top_k is None else f"top {top_k} logits")
    if path is not None:
        cached.save(path)
    return cached


def _load_npz(path, batch_size):
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} does not exist: no teacher-logit cache to load.")
    with np.load(path, allow_pickle=False) as f:
        if _NPZ_METADATA not in f.files:
            raise ValueError(f"{path!r} is not a keras_tpu_mem teacher-logit cache "
                             f"(no {_NPZ_METADATA!r} entry).")
        metadata = json.loads(str(f[_NPZ_METADATA]))
        if metadata.get("format") != _NPZ_FORMAT or metadata.get("version") != _NPZ_VERSION:
            raise ValueError(
                f"{path!r} is not a keras_tpu_mem teacher-logit cache of version "
                f"{_NPZ_VERSION} (found format={metadata.get('format')!r}, "
                f"version={metadata.get('version')!r}).")
        arrays = {name: f[name] for name in f.files if name != _NPZ_METADATA}
    parts = []
    for name in _DATA_PARTS:
        spec = metadata["structures"].get(name)
        if spec is None:
            break
        if spec == "array":
            parts.append(arrays[name])
        else:
            count = _count_leaves(spec)
            parts.append(_rebuild(spec, iter(arrays[f"{name}_{i}"] for i in range(count))))
    data = parts[0] if metadata["single_x"] else tuple(parts)
    if "logits" in arrays:
        extras = {LOGITS_KEY: arrays["logits"]}
    else:
        extras = {TOP_K_VALUES_KEY: arrays["top_k_values"],
                  TOP_K_INDICES_KEY: arrays["top_k_indices"]}
    return TeacherLogits(data, extras, metadata["batch_size"] if batch_size is None
                         else batch_size)


def cache_teacher_logits(teacher, dataset, *, batch_size: int = 32,
                         top_k: int | None = None, path: str | os.PathLike | None = None):
    """Runs the teacher once and returns the examples with its logits attached.

    **Arrays** (any backend, no TensorFlow needed): `dataset` is `x`, `(x,)`,
    `(x, y)` or `(x, y, sample_weight)` of numpy arrays or backend tensors
    (`x` may be a dict or tuple of arrays). The teacher runs once with
    `teacher.predict(x, batch_size=batch_size)` (in inference mode, under the
    active `keras.distribution` on JAX, else on the default device; the input
    is padded to a multiple of `batch_size` for that, then cropped). Returned:
    a `TeacherLogits`, a `keras.utils.PyDataset` yielding batches of
    `batch_size` examples **in the input order** (the last may be smaller),
    each `(data_batch, logits_batch)` in the element structure below; pass it
    to `fit` as it is. With `path` (a file name ending in `.npz`) the examples
    and logits are also written there in the documented npz format
    (docs/distillation.md), which `load_teacher_logits(path)` reads on either
    backend.

    **A tf.data.Dataset** (TensorFlow): the teacher runs in inference mode
    (`training=False`) under the current strategy (the one whose scope is
    active, else the teacher's), each batch split over the replicas. A teacher
    whose variables live outside the active strategy runs as a copy made under
    it (as for `Distillation`; logged), kept only while caching. Every
    returned element is `(data, logits)`:
    `data` is the input element unchanged and `logits` a dict of the teacher's
    float32 logits (all classes, or the `top_k` largest values and their
    indices). Because the logits sit inside each element, shuffling and
    re-batching the result keeps them with their examples. Train the student
    with `Distillation()` (no teacher) on it.

    The returned dataset holds **single examples** (the input's batches are
    split): shuffle and batch it as you would the original examples, e.g.
    `tpu.distribute(cached.shuffle(n), global_batch_size)`.

    Without `path` the examples and logits are kept in host memory. With
    `path` they are written there (in parts of about 256 MiB, with
    `tf.data.Dataset.save`) and the returned dataset reads them back from disk;
    a later run, on another machine, calls `load_teacher_logits(path)` and
    never loads the teacher.

    If the student was created under a strategy scope and has not been trained
    yet, call `prepare_student(student, batched_cached_dataset)` before its first
    `fit` (Keras builds such a model from the raw first batch before any
    callback runs).

    Args:
        teacher: A built `keras.Model` with one logits output.
        dataset: Arrays `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)` (see
            above), or a finite `tf.data.Dataset` of **batches** (`x`, `(x, y)`
            or `(x, y, sample_weight)`, as passed to `fit`), iterated once.
        batch_size: With arrays: the teacher's predict batch and the batch the
            returned PyDataset yields (an int >= 1; under `DataParallel` a
            multiple of the device count). Ignored for a dataset (its own
            batches are used).
        top_k: `None` to keep all logits, or how many of the largest to keep
            (with their class indices): k/classes of the storage.
        path: Optional place to save the cache: with arrays a `.npz` file that
            does not exist yet; with a dataset a directory that does not exist
            yet or is empty.

    Returns:
        With arrays, a `TeacherLogits` PyDataset of `(data, logits)` batches;
        with a dataset, a `tf.data.Dataset` of `(data, logits)` single examples.

    Example:

    ```python
    # Arrays, on any backend: batches in order, ready for fit.
    cached = ktm.cache_teacher_logits(teacher, (x, y), batch_size=64, path="logits.npz")
    student.fit(cached, epochs=3, callbacks=[ktm.Distillation()])
    cached = ktm.load_teacher_logits("logits.npz")        # later, without the teacher

    # A tf.data pipeline (TensorFlow):
    cached = ktm.cache_teacher_logits(teacher, train_ds.batch(256), path="gs://bucket/logits")
    # later, anywhere, without the teacher:
    cached = ktm.load_teacher_logits("gs://bucket/logits")
    student.fit(cached.shuffle(10_000).batch(128), callbacks=[ktm.Distillation()])
    ```
    """
    if not isinstance(teacher, keras.Model):
        raise TypeError(f"`teacher` must be a keras.Model, got {type(teacher).__name__}.")
    if not teacher.built:
        raise ValueError(
            "The teacher is not built (it has no trained weights). Build or load it first."
        )
    which = _ends_in_probabilities(teacher)
    if which:
        raise ValueError(
            f"The teacher's last layer applies {which}: cache_teacher_logits needs logits. "
            "Remove the final activation."
        )
    if not _is_tf_dataset(dataset):
        return _cache_arrays(teacher, dataset, batch_size=batch_size, top_k=top_k, path=path)
    tf = _tensorflow()
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(
            "`dataset` must be a tf.data.Dataset of batches, e.g. "
            f"tf.data.Dataset.from_tensor_slices((x, y)).batch(256); got "
            f"{type(dataset).__name__}."
        )
    top_k = _check_top_k(top_k)
    _check_top_k_classes(top_k, _output_classes(teacher), "the teacher")
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError(
            "`dataset` is infinite (e.g. `.repeat()`); cache_teacher_logits iterates it "
            "once to the end. Pass the finite dataset and repeat the result instead."
        )
    if _is_cached_element(dataset.element_spec):
        raise ValueError("`dataset` already carries cached teacher logits.")
    if path is not None:
        path = os.fspath(path)
        if tf.io.gfile.exists(path) and tf.io.gfile.listdir(path):
            raise ValueError(
                f"`path` {path!r} already exists and is not empty; choose a new directory "
                "(the cache is never overwritten)."
            )
        tf.io.gfile.makedirs(path)
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        if _outside(teacher, strategy):
            # As for a live teacher: each replica should read variables that
            # live where it runs. MirroredStrategy on one host's CPUs would
            # copy a foreign variable to every replica at each read (measured:
            # it works); a TPU program is not assumed to read host variables
            # at all (not verified here). So a teacher from elsewhere runs as
            # a copy made under this strategy, dropped when caching ends.
            teacher = _copy_into_strategy(
                teacher, strategy, strategy, who="cache_teacher_logits",
                advice="Call cache_teacher_logits outside the strategy scope (the teacher "
                       "then runs on its own strategy), or create or load the teacher "
                       "under that `strategy.scope()`.")
    else:
        strategy = teacher.distribute_strategy
    run = _teacher_runner(teacher, strategy, top_k)
    pending, pending_bytes, parts, total = [], 0, [], 0

    def flush():
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f"part-{len(parts):05d}"
        tf.data.Dataset.from_tensor_slices(_concat(pending)).save(os.path.join(path, name))
        parts.append(name)
        pending, pending_bytes = [], 0

    for batch in dataset:
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        logits = run(x)
        element = (_numpy_structure(batch), logits)
        total += len(next(iter(logits.values())))
        pending.append(element)
        pending_bytes += _nbytes(element)
        if path is not None and pending_bytes >= _PART_BYTES:
            flush()
    if total == 0:
        raise ValueError("`dataset` is empty: there is nothing to cache.")
    logger.info("cache_teacher_logits: %d examples, %s.", total,
                "all logits" if top_k is None else f"top {top_k} logits")
    if path is None:
        return tf.data.Dataset.from_tensor_slices(_concat(pending))
    flush()
    metadata = {"format": _FORMAT, "version": _FORMAT_VERSION, "top_k": top_k,
                "num_examples": total, "parts": parts}
    with tf.io.gfile.GFile(os.path.join(path, _METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=1)
    return load_teacher_logits(path)


def load_teacher_logits(path: str | os.PathLike, *, batch_size: int | None = None):
    """Reads a cache written by `cache_teacher_logits(..., path=...)`, without the teacher.

    Args:
        path: The `.npz` file (cached from arrays; readable on any backend) or
            the directory (cached from a tf.data.Dataset; TensorFlow) given to
            `cache_teacher_logits`.
        batch_size: For a `.npz` cache: the batch the PyDataset yields
            (default: the one it was cached with). Not used for a directory.

    Returns:
        For a `.npz` file, a `TeacherLogits` PyDataset of `(data, logits)`
        batches in the cached order; for a directory, a `tf.data.Dataset` of
        `(data, logits)` single examples, in the order they were cached
        (shuffle it for training).

    Raises:
        ValueError: if `path` holds no teacher-logit cache.

    Example:

    ```python
    cached = ktm.load_teacher_logits("/data/digits_logits")
    student.fit(cached.shuffle(2048).batch(64), callbacks=[ktm.Distillation(temperature=4.0)])
    ```
    """
    path = os.fspath(path)
    if path.endswith(_NPZ_SUFFIX) or os.path.isfile(path):
        return _load_npz(path, batch_size)
    if batch_size is not None:
        raise ValueError(
            "`batch_size` applies to a .npz cache only; a directory cache holds single "
            "examples: batch the returned dataset instead.")
    tf = _tensorflow()
    meta_path = os.path.join(path, _METADATA_FILE)
    if not tf.io.gfile.exists(meta_path):
        raise ValueError(
            f"{path!r} holds no teacher-logit cache (no {_METADATA_FILE}); write one with "
            "ktm.cache_teacher_logits(teacher, dataset, path=...)."
        )
    with tf.io.gfile.GFile(meta_path) as f:
        metadata = json.load(f)
    if metadata.get("format") != _FORMAT or metadata.get("version") != _FORMAT_VERSION:
        raise ValueError(
            f"{meta_path!r} is not a keras_tpu_mem teacher-logit cache of version "
            f"{_FORMAT_VERSION} (found format={metadata.get('format')!r}, "
            f"version={metadata.get('version')!r})."
        )
    dataset = None
    for name in metadata["parts"]:
        part = tf.data.Dataset.load(os.path.join(path, name))
        dataset = part if dataset is None else dataset.concatenate(part)
    return dataset.apply(tf.data.experimental.assert_cardinality(metadata["num_examples"]))


def strip_teacher_logits(dataset):
    """The dataset without its cached logits (the original elements).

    Args:
        dataset: A `tf.data.Dataset` from `cache_teacher_logits` /
            `load_teacher_logits`, or a `TeacherLogits` PyDataset (then a
            PyDataset of the original batches is returned).
    """
    if isinstance(dataset, TeacherLogits):
        return dataset.without_logits()
    if not _is_cached_element(dataset.element_spec):
        raise ValueError("`dataset` carries no cached teacher logits.")
    return dataset.map(lambda data, logits: data)


def prepare_student(student, dataset) -> None:
    """Builds a student made under a strategy scope before its first fit on cached logits.

    Keras builds a model created inside `strategy.scope()` (its compiled loss
    and metrics) from the first batch of the data, *before* any callback runs,
    and would take the cached logits for part of the data. This does that build
    from the first batch of `dataset` without them; afterwards `fit` does not
    rebuild. On the JAX backend Keras' `fit` always builds from the first batch
    before the callbacks run, so every student needs this before its first fit
    on cached logits. On TensorFlow a student created outside any strategy
    scope, or one that has already been trained or evaluated, needs no
    preparation (calling this is harmless).

    Args:
        student: The compiled student model.
        dataset: The **batched** cached dataset you will pass to `fit`.

    Example:

    ```python
    with tpu.scope():
        student = build_student()
        student.compile(optimizer="adam", loss=loss)
    train = tpu.distribute(ktm.load_teacher_logits(path).shuffle(50_000), 1024)
    ktm.prepare_student(student, train)
    student.fit(train, callbacks=[ktm.Distillation()])
    ```
    """
    if not isinstance(student, keras.Model):
        raise TypeError(f"`student` must be a keras.Model, got {type(student).__name__}.")
    if isinstance(dataset, TeacherLogits):
        batch = dataset.without_logits()[0]
        if _on_tensorflow():
            with student.distribute_strategy.scope():
                keras_compat.symbolic_build(student, batch)
        else:
            keras_compat.symbolic_build(student, batch)
        return
    tf = _tensorflow()
    if not isinstance(dataset, tf.data.Dataset) or not _is_cached_element(dataset.element_spec):
        raise ValueError(
            "`dataset` must be the batched tf.data.Dataset of cached teacher logits you "
            "will pass to fit (from cache_teacher_logits / load_teacher_logits)."
        )
    batch = next(iter(strip_teacher_logits(dataset).take(1)))
    with student.distribute_strategy.scope():
        keras_compat.symbolic_build(student, batch)


__all__ = [
    "Distillation",
    "TeacherLogits",
    "cache_teacher_logits",
    "distillation_kl",
    "load_teacher_logits",
    "prepare_student",
    "strip_teacher_logits",
]
