"""`Distillation`: the callback that adds the distillation term to the student's loss.

The teacher's logits come from a live teacher run inside the compiled step
(`Distillation(teacher)`) or from the batch (`Distillation()` on a dataset made
by `cache_teacher_logits` / `load_teacher_logits`, see `elements`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import keras
import numpy as np

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.devices import placement
from keras_tpu_mem.distillation.checks import (
    check_alpha,
    check_temperature,
    check_top_k,
    check_top_k_classes,
    ends_in_probabilities,
    output_classes,
    single_output,
)
from keras_tpu_mem.distillation.elements import (
    LOGITS_KEY,
    TOP_K_INDICES_KEY,
    TOP_K_VALUES_KEY,
    is_cached_element,
)
from keras_tpu_mem.distillation.loss import distillation_kl, regularization_loss, top_k_logits
from keras_tpu_mem.distillation.placement import (
    assign_weights,
    copy_into_strategy,
    outside,
    student_owner,
)
from keras_tpu_mem.engine import Engine, EngineCallback

ops = keras.ops


def _backing(variable):
    """What a Keras variable holds (its backend variable or array): a shared one is one object.
    A deferred variable (`ktm.shapes_only()`) holds nothing: itself (reading it would make a
    new placeholder array each time, whose ids Python reuses)."""
    if isinstance(variable, keras.Variable) and keras_compat.has_value(variable):
        return variable.value
    return variable


class DistillationState(NamedTuple):
    """What `Distillation` carries from step to step (its `init_state`): the current
    temperature and alpha (float32 scalars), set at each epoch's start by schedules."""

    temperature: object
    alpha: object


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
        self.top_k = check_top_k(top_k, teacher)
        self._temperature_fn = temperature if callable(temperature) else None
        self._alpha_fn = alpha if callable(alpha) else None
        self.temperature = None if callable(temperature) else check_temperature(temperature)
        self.alpha = None if callable(alpha) else check_alpha(alpha)
        self._start_epoch = 0  # the epoch the running fit starts at (a resume's)
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
        comparable, owner = student_owner(student)
        if not comparable or not outside(teacher, owner):
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
            assign_weights(cached[2], teacher, strategy)
            return cached[2]
        copy = copy_into_strategy(
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

    def _state_at(self, epoch) -> DistillationState:
        temperature = self._value(self.temperature, self._temperature_fn, epoch,
                                  check_temperature)
        alpha = self._value(self.alpha, self._alpha_fn, epoch, check_alpha)
        return DistillationState(np.asarray(temperature, "float32"),
                                 np.asarray(alpha, "float32"))

    # ----------------------------------------------------------- engine
    def install(self, model):
        # Refuses a teacher and student under different tf.distribute strategies (None
        # on JAX: build the teacher in the student's `distribution.scope()`).
        placement.training_strategy(model, "Distillation")
        teacher = self.teacher
        if teacher is not None:
            if teacher is model:
                raise ValueError("The teacher is the student itself; pass a separate model.")
            trainable = {id(_backing(v)) for v in model.trainable_weights}
            shared = [v.path for v in teacher.weights if id(_backing(v)) in trainable]
            if shared:
                raise ValueError(
                    "The teacher shares variables with the student's trainable weights "
                    f"({', '.join(shared[:3])}{', ...' if len(shared) > 3 else ''}); "
                    "Distillation keeps the teacher frozen, so use a separate teacher model."
                )
            t_classes, s_classes = output_classes(teacher), output_classes(model)
            if t_classes is not None and s_classes is not None and t_classes != s_classes:
                raise ValueError(
                    f"The teacher outputs {t_classes} logits per example but the student "
                    f"outputs {s_classes}; Distillation needs the same classes in the same "
                    "order."
                )
            which = ends_in_probabilities(teacher)
            if which:
                raise ValueError(
                    f"The teacher's last layer applies {which}: Distillation needs logits. "
                    "Remove the final activation (and compile with from_logits=True)."
                )
        which = ends_in_probabilities(model)
        if which:
            raise ValueError(
                f"The student's last layer applies {which}: Distillation needs logits. "
                "Remove the final activation and compile the loss with from_logits=True."
            )
        # Where no variable has a strategy (JAX), `_teacher_for` is the teacher itself.
        self._step_teacher = teacher if teacher is None else self._teacher_for(model)
        self._start_epoch = int(getattr(model, "_initial_epoch", None) or 0)

    def init_state(self, ctx):
        """`DistillationState`: the temperature and alpha of the fit's first epoch
        (schedules set them again at every epoch's start: a resumed fit starts at the
        restored epoch)."""
        return self._state_at(self._start_epoch)

    def frozen_variables(self):
        # The teacher's weights enter the JAX step as inputs, not as constants
        # embedded in the program (and are never differentiated nor returned).
        return list(self._step_teacher.weights) if self._step_teacher is not None else []

    def on_epoch_begin(self, epoch, logs=None):
        if self._temperature_fn is not None or self._alpha_fn is not None:
            Engine.attach(self._engine_model).set_feature_state(self, self._state_at(epoch))

    def split_extras(self, data):
        if is_cached_element(data):
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
        student = single_output(ctx.y_pred, "a student")
        temperature, alpha = ctx.state
        if self.teacher is not None:
            teacher = self._step_teacher(ctx.x, training=False)
            teacher = ops.stop_gradient(single_output(teacher, "a teacher"))
            kl = self._logits_kl(
                student, teacher, temperature, "the teacher",
                "The teacher's logits have shape {logits} per batch but the student's have "
                "{student}; Distillation needs the same shape (the same classes in the same "
                "order).")
        else:
            kl = self._cached_kl(student, ctx.extras, temperature)
        mask = getattr(student, "_keras_mask", None)
        # Keras' own reduction: sample weights and mask apply, divided by the
        # number of examples, then by the number of replicas.
        term = keras_compat.reduce_weighted_values(kl, sample_weight=ctx.sample_weight, mask=mask,
                                                  reduction="sum_over_batch_size", dtype="float32")
        alpha = ops.cast(alpha, "float32")
        term = alpha * ops.square(ops.cast(temperature, "float32")) * term
        # Regularisation losses (kernel_regularizer, add_loss) keep their full
        # weight: `loss` includes them, so give back the alpha part.
        regularization = regularization_loss(ctx.model)
        if regularization is not None:
            term = term + alpha * regularization
        return ops.cast(1.0 - alpha, loss.dtype) * loss + ops.cast(term, loss.dtype)

    def _logits_kl(self, student, logits, temperature, who, mismatch):
        """The KL term against all the teacher's `logits` (or their top k).

        `who` names the logits in the top-k error; `mismatch` is the message
        where their shape is not the student's (`{logits}`, `{student}`: shapes).
        """
        if tuple(logits.shape)[1:] != tuple(student.shape)[1:]:
            raise ValueError(mismatch.format(logits=logits.shape, student=student.shape))
        if self.top_k is None:
            return distillation_kl(student, temperature, logits)
        check_top_k_classes(self.top_k, student.shape[-1], who)
        values, indices = top_k_logits(logits, self.top_k)
        return distillation_kl(student, temperature, top_k_values=values,
                               top_k_indices=indices)

    def _cached_kl(self, student, extras, temperature):
        if LOGITS_KEY in extras:
            return self._logits_kl(
                student, extras[LOGITS_KEY], temperature, "the cached teacher logits",
                "The cached teacher logits have shape {logits} per batch but the student's "
                "logits have {student}; the cache was made with another teacher (different "
                "classes).")
        values, indices = extras[TOP_K_VALUES_KEY], extras[TOP_K_INDICES_KEY]
        cached_k = values.shape[-1]
        if tuple(values.shape)[1:-1] != tuple(student.shape)[1:-1]:
            raise ValueError(
                f"The cached teacher top-k logits have shape {values.shape} per batch, "
                f"which does not match the student's logits {student.shape}."
            )
        check_top_k_classes(cached_k, student.shape[-1], "the student")
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


__all__ = ["Distillation"]
