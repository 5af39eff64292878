"""Pruning schedules: *when* to recompute the masks and *how sparse* to make them.

`ConstantSparsity` and `PolynomialDecay` take the same arguments as
`tfmot.sparsity.keras.ConstantSparsity` / `PolynomialDecay` and return the same
`(should_prune, sparsity)` at every step. They are written in `keras.ops`, so
they evaluate on every Keras backend (inside a jitted JAX step too); on
TensorFlow those are the same TensorFlow ops in the same order and dtypes as
tfmot's, so the float32 values agree bit for bit. They are reimplemented here
because importing `tensorflow_model_optimization` switches the whole process to
legacy Keras (`TF_USE_LEGACY_KERAS=1`). Importing this module never imports
TensorFlow. tfmot's own schedule objects run TensorFlow ops: they work with the
TensorFlow backend only.

A schedule is called with the training step, which for `ktm.Pruning` is the
number of optimizer updates made so far (`model.optimizer.iterations`, read
after the update): 1 after the first update. Gradient accumulation therefore
does not distort it, and step 0 is never evaluated during training, as in
tfmot, whose `pruning_step` also starts at 1 in the first training batch.
"""

from __future__ import annotations

import math
import numbers

import keras
import numpy as np

from keras_tpu_mem.backends.step import StepContext

ops = keras.ops

_PACKAGE = "keras_tpu_mem"


def _check_int(value, name, *, minimum=None, allow=()):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {value!r} ({type(value).__name__}).")
    value = int(value)
    if value in allow:
        return value
    if minimum is not None and value < minimum:
        extra = " or " + " or ".join(str(a) for a in allow) if allow else ""
        raise ValueError(f"`{name}` must be an int >= {minimum}{extra}, got {value}.")
    return value


def _check_sparsity(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"`{name}` must be a float in [0, 1), got {value!r} ({type(value).__name__})."
        )
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(
            f"`{name}` must be in [0, 1) (the fraction of weights set to zero; 1.0 would "
            f"remove every weight), got {value}."
        )
    return value


class PruningSchedule:
    """Base class: maps a training step to `(should_prune, sparsity)`.

    Subclasses implement `__call__(step)` returning a scalar boolean tensor
    (recompute the masks at this step?) and a scalar float32 tensor (the
    fraction of weights to zero when they do), using `keras.ops` so that the
    schedule runs inside the compiled training step on any backend, and
    `get_config`.

    `ktm.Pruning` also accepts any object with that call signature, e.g. a
    schedule from `tfmot.sparsity.keras` (duck-typed; keras_tpu_mem never
    imports tfmot; those run TensorFlow ops, so with the TensorFlow backend
    only).
    """

    begin_step: int
    end_step: int
    frequency: int

    def __call__(self, step):
        raise NotImplementedError

    def get_config(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    @staticmethod
    def _should_prune_in_step(step, begin_step, end_step, frequency):
        # tfmot's exact expression: in [begin, end] (end < 0: forever) and on a
        # multiple of `frequency` counted from begin_step.
        # (`ops.mod` is a floor modulo on every backend, as tf.math.floormod.)
        is_in_pruning_range = ops.logical_and(
            ops.greater_equal(step, begin_step),
            ops.logical_or(ops.less_equal(step, end_step),
                           ops.convert_to_tensor(end_step < 0)),
        )
        is_pruning_turn = ops.equal(ops.mod(ops.subtract(step, begin_step), frequency), 0)
        return ops.logical_and(is_in_pruning_range, is_pruning_turn)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.get_config().items()))))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ConstantSparsity(PruningSchedule):
    """The same sparsity at every pruning step (tfmot's `ConstantSparsity`).

    Masks are recomputed at steps `begin_step`, `begin_step + frequency`, ...
    up to `end_step` inclusive (`-1`: until training ends), each time to
    `target_sparsity`. Steps are optimizer updates, the first being 1.

    Args:
        target_sparsity: Fraction of weights set to zero, in [0, 1).
        begin_step: First step at which masks are computed (int >= 0).
        end_step: Last step at which masks may be recomputed, >= `begin_step`,
            or -1 (default) to keep recomputing until training ends. The masks
            keep applying after it.
        frequency: Recompute the masks every `frequency` steps (int >= 1).

    Example:

    ```python
    import keras_tpu_mem as ktm
    schedule = ktm.ConstantSparsity(0.5, begin_step=200, frequency=100)
    should_prune, sparsity = schedule(300)   # (True, 0.5)
    ```
    """

    def __init__(self, target_sparsity, begin_step, end_step=-1, frequency=100):
        self.target_sparsity = _check_sparsity(target_sparsity, "target_sparsity")
        self.begin_step = _check_int(begin_step, "begin_step", minimum=0)
        self.end_step = _check_int(end_step, "end_step", minimum=0, allow=(-1,))
        self.frequency = _check_int(frequency, "frequency", minimum=1)
        if self.end_step != -1 and self.end_step < self.begin_step:
            raise ValueError(
                f"`end_step` ({self.end_step}) must be >= `begin_step` ({self.begin_step}), "
                "or -1 to prune until training ends."
            )

    def __call__(self, step):
        return (
            self._should_prune_in_step(step, self.begin_step, self.end_step, self.frequency),
            ops.convert_to_tensor(self.target_sparsity, dtype="float32"),
        )

    @property
    def final_sparsity(self) -> float:
        """The sparsity the schedule ends at (`target_sparsity`)."""
        return self.target_sparsity

    def get_config(self):
        return {
            "target_sparsity": self.target_sparsity,
            "begin_step": self.begin_step,
            "end_step": self.end_step,
            "frequency": self.frequency,
        }


@keras.saving.register_keras_serializable(package=_PACKAGE)
class PolynomialDecay(PruningSchedule):
    """Sparsity rising from `initial_sparsity` to `final_sparsity` (tfmot's `PolynomialDecay`).

    At a pruning step `s` (every `frequency` steps from `begin_step` to
    `end_step` inclusive) the sparsity is

        final + (initial - final) * (1 - p) ** power,
        p = clip((s - begin_step) / (end_step - begin_step), 0, 1)

    which rises quickly at first and flattens towards `final_sparsity`
    (Zhu & Gupta, 2017). Steps are optimizer updates, the first being 1.
    Choose `end_step - begin_step` as a multiple of `frequency` so that the last
    recomputation happens exactly at `end_step`, at `final_sparsity`.

    Args:
        initial_sparsity: Sparsity at `begin_step`, in [0, 1).
        final_sparsity: Sparsity at `end_step` and after, in [0, 1).
        begin_step: First pruning step (int >= 0).
        end_step: Last pruning step (int > `begin_step`).
        power: Exponent of the decay (a number > 0; 3 by default).
        frequency: Recompute the masks every `frequency` steps (int >= 1).

    Example:

    ```python
    import keras_tpu_mem as ktm
    schedule = ktm.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=1000)
    should_prune, sparsity = schedule(500)   # (True, 0.7)
    ```
    """

    def __init__(self, initial_sparsity, final_sparsity, begin_step, end_step, power=3,
                 frequency=100):
        self.initial_sparsity = _check_sparsity(initial_sparsity, "initial_sparsity")
        self.final_sparsity = _check_sparsity(final_sparsity, "final_sparsity")
        self.begin_step = _check_int(begin_step, "begin_step", minimum=0)
        if end_step == -1:
            raise ValueError(
                "PolynomialDecay needs a finite `end_step` (the step at which the sparsity "
                "reaches `final_sparsity`); -1 is only meaningful for ConstantSparsity."
            )
        self.end_step = _check_int(end_step, "end_step", minimum=0)
        if self.end_step <= self.begin_step:
            # tfmot accepts end_step == begin_step and then computes 0 / 0 = NaN
            # as the sparsity of its first pruning step.
            raise ValueError(
                f"`end_step` ({self.end_step}) must be > `begin_step` ({self.begin_step}): "
                "the sparsity decays over (end_step - begin_step) steps. For a single "
                "pruning step use ConstantSparsity(s, begin_step=k, end_step=k)."
            )
        if isinstance(power, bool) or not isinstance(power, numbers.Real):
            raise TypeError(f"`power` must be a number > 0, got {power!r}.")
        if not (math.isfinite(power) and power > 0):
            raise ValueError(f"`power` must be a finite number > 0, got {power}.")
        self.power = power
        self.frequency = _check_int(frequency, "frequency", minimum=1)

    def __call__(self, step):
        # The same ops, in the same order and dtypes, as tfmot 0.8.1 (on
        # TensorFlow: tf.divide, tf.maximum, tf.minimum, tf.pow, tf.multiply,
        # tf.add on float32), so that the float32 sparsity agrees bit for bit.
        # Python constants become float32 first, as tf.math does with them.
        def f32(value):
            return ops.convert_to_tensor(np.float32(value), dtype="float32")

        p = ops.minimum(
            f32(1.0),
            ops.maximum(
                f32(0.0),
                ops.divide(ops.cast(ops.subtract(step, self.begin_step), "float32"),
                           f32(self.end_step - self.begin_step)),
            ),
        )
        sparsity = ops.add(
            ops.multiply(f32(self.initial_sparsity - self.final_sparsity),
                         ops.power(ops.subtract(f32(1.0), p), f32(self.power))),
            f32(self.final_sparsity),
        )
        return (
            self._should_prune_in_step(step, self.begin_step, self.end_step, self.frequency),
            sparsity,
        )

    def get_config(self):
        return {
            "initial_sparsity": self.initial_sparsity,
            "final_sparsity": self.final_sparsity,
            "begin_step": self.begin_step,
            "end_step": self.end_step,
            "power": self.power,
            "frequency": self.frequency,
        }


def check_schedule(schedule):
    """Checks that `schedule` can be called as `schedule(step) -> (should_prune, sparsity)`.

    Returns it unchanged (ours, tfmot's or any duck-typed object).
    """
    if isinstance(schedule, PruningSchedule):
        return schedule
    if not callable(schedule):
        raise TypeError(
            "`schedule` must be a pruning schedule: ktm.ConstantSparsity, "
            "ktm.PolynomialDecay, a tfmot.sparsity.keras schedule, or any callable "
            f"step -> (should_prune, sparsity); got {schedule!r} "
            f"({type(schedule).__name__})."
        )
    ctx = StepContext.outside()
    if not ctx.runs_tensorflow_ops() and _is_tfmot(schedule):
        raise TypeError(
            f"`schedule` {schedule!r} is a tfmot schedule, which runs TensorFlow ops: it "
            f"works with the TensorFlow backend only, and the Keras backend is "
            f"{ctx.backend_label}. Use ktm.{type(schedule).__name__} with the same "
            "arguments (ktm.ConstantSparsity / ktm.PolynomialDecay give tfmot's values)."
        )
    # The step as the training step gives it (optimizer.iterations: int64 on
    # TensorFlow; JAX without x64 has no int64, so int32 there).
    step_dtype = ctx.update_count_dtype()
    try:
        result = schedule(ops.convert_to_tensor(1, dtype=step_dtype))
    except Exception as err:
        raise TypeError(
            f"`schedule` {schedule!r} could not be called with a step tensor "
            f"({step_dtype} scalar): {type(err).__name__}: {err}"
        ) from err
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise TypeError(
            f"`schedule(step)` must return (should_prune, sparsity), got {result!r}."
        )
    should, sparsity = (ops.convert_to_tensor(v) for v in result)
    if len(should.shape) != 0 or len(sparsity.shape) != 0:
        raise TypeError(
            "`schedule(step)` must return two scalars (should_prune, sparsity); got "
            f"shapes {tuple(should.shape)} and {tuple(sparsity.shape)}."
        )
    should_dtype = keras.backend.standardize_dtype(should.dtype)
    sparsity_dtype = keras.backend.standardize_dtype(sparsity.dtype)
    if should_dtype != "bool" or not keras.backend.is_float_dtype(sparsity_dtype):
        raise TypeError(
            "`schedule(step)` must return (bool, float) scalars; got "
            f"({should_dtype}, {sparsity_dtype})."
        )
    return schedule


def never_pruned_message(schedule, updates: int, step: int, started) -> str:
    """What a fit that never reached a pruning step says (nothing was pruned).

    Args:
        schedule: The fit's schedule; its first pruning step is named when it
            has tfmot's `begin_step` and `frequency` (pruning steps are
            `begin_step + j * frequency`, counted in optimizer updates from 1).
        updates: The optimizer updates the fit made.
        step: `optimizer.iterations` at the fit's end.
        started: `started(s)` says whether the schedule pruned at some step in [1, s].
    """
    begin = getattr(schedule, "begin_step", None)
    frequency = getattr(schedule, "frequency", None)
    first = None
    if isinstance(begin, numbers.Integral) and isinstance(frequency, numbers.Integral):
        turn = int(begin) if begin >= 1 else int(frequency)  # the first turn >= 1
        # A turn at zero sparsity (PolynomialDecay from 0) prunes nothing; the next does.
        first = next((s for s in (turn, turn + int(frequency)) if started(s)), None)
    where = (f"the schedule's first pruning step is {first}" if first is not None else
             "the schedule has no pruning step at or before it")
    return (f"Pruning: nothing was pruned. The fit made {updates} optimizer updates "
            f"(optimizer.iterations ended at {step}) and {where}. Pruning steps are "
            "begin_step + j * frequency: lower `begin_step` or `frequency`, or fit longer.")


def pruning_turn(schedule, step: int) -> bool | None:
    """Whether `step` is one of `schedule`'s turns, `begin_step + j * frequency` up to
    `end_step` (on the host, no tensor); None where the turns are not known (a
    `PruningSchedule` subclass or tfmot's schedule decides in its `__call__`).

    Example:

    ```python
    pruning_turn(PolynomialDecay(0.0, 0.8, begin_step=0, end_step=1000, frequency=100), 300)  # True
    ```
    """
    if type(schedule) not in (ConstantSparsity, PolynomialDecay):
        return None
    begin, end = schedule.begin_step, schedule.end_step
    return (begin <= step and (end < 0 or step <= end)
            and (step - begin) % schedule.frequency == 0)


def _is_tfmot(schedule) -> bool:
    """Whether `schedule` comes from tensorflow_model_optimization (never imported here)."""
    return type(schedule).__module__.split(".")[0] == "tensorflow_model_optimization"


def schedule_config(schedule) -> dict:
    """A serialisable description of a schedule (ours or a tfmot one)."""
    if isinstance(schedule, PruningSchedule):
        return keras.saving.serialize_keras_object(schedule)
    get_config = getattr(schedule, "get_config", None)
    config = get_config() if callable(get_config) else None
    # tfmot's schedules return {"class_name": ..., "config": {...}}; the two
    # built-in ones have the same arguments as ours.
    if isinstance(config, dict) and config.get("class_name") in _BY_NAME:
        return keras.saving.serialize_keras_object(
            _BY_NAME[config["class_name"]](**config["config"])
        )
    raise TypeError(
        f"The schedule {schedule!r} cannot be serialised: give it a `get_config` "
        "(subclass ktm.PruningSchedule and register it with "
        "keras.saving.register_keras_serializable)."
    )


def schedule_from_config(config):
    return keras.saving.deserialize_keras_object(config)


_BY_NAME = {"ConstantSparsity": ConstantSparsity, "PolynomialDecay": PolynomialDecay}

__all__ = [
    "ConstantSparsity",
    "PolynomialDecay",
    "PruningSchedule",
    "check_schedule",
    "pruning_turn",
    "schedule_config",
    "schedule_from_config",
]
