"""`Pruning`: magnitude pruning during `fit`, inside the compiled step.

tfmot's `prune_low_magnitude` wraps every layer, needs a recompile and refuses
Keras 3 models. Here pruning is a `fit` callback that plugs into the engine: the
model keeps its own layers, and the masks are applied *inside* the compiled step
after each optimizer update, on every replica. Written once, in `keras.ops` and
Keras variables; what differs between backends the `StepContext` does (its
verbs: a state variable laid out like its weight, the update count, an assignment
on every replica, a conditional update).

How it works, per pruned weight `w` (a layer kernel):

* a mask of `w`'s shape lives in a Keras variable owned by the callback, never
  by the model, so nothing is added to what `model.save` writes
  (`pruning.new_mask`: on TensorFlow replica-local, sync-on-read; on JAX laid
  out like its kernel and carried in the jitted step's state). Under XLA it is
  boolean (1 byte a weight); TensorFlow without XLA gives it `w`'s dtype,
  because there a multiply is about 3x faster than the select kernel
  (`pruning.mask_dtype`);
* after every optimizer update the engine calls `after_update`: the schedule
  is evaluated at `step = optimizer.iterations` (updates made so far); when it
  says so, the masks are recomputed from the magnitudes of the freshly updated
  weights (`pruning.update_masks`: inside a `tf.cond` on TensorFlow, as a
  `keras.ops.cond`'s outputs on JAX; JAX runs the updates that are not a turn of
  our schedules in a second step without it, `quiet_update`), then
  `w <- where(mask, w, 0)` (a float mask: `multiply_no_nan(w, mask)`, exact +0.0
  over inf/NaN) is written with `pruning.assign_in_step` (on TensorFlow to every
  replica's copy). Every replica computes the same mask: none is communicated;
* the threshold (the k-th largest magnitude) is found by bisection on the
  float bit patterns (31 counting passes, `pruning/masks.py`) instead of
  tfmot's full `top_k` sort: the same mask, but no O(n log n) sort and no
  n-element index buffer, which is what a TPU wants for multi-million-entry
  kernels;
* on `fit` start (after `BackupAndRestore` has restored the weights and the
  optimizer) the masks are derived from what was checkpointed: once the
  schedule has pruned at some step <= `optimizer.iterations`, mask = (w != 0);
  before that, all ones. Because pruned entries are exactly zero after every
  update, this is the mask the interrupted run had.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
import warnings
from typing import NamedTuple

import keras
import numpy as np
from keras import ops

from keras_tpu_mem._utils import logger
from keras_tpu_mem.engine import Engine, EngineCallback, StepContext
from keras_tpu_mem.events import EventFileWriter
from keras_tpu_mem.pruning.masks import (
    apply_mask,
    block_mask,
    m_by_n_mask,
    magnitude_mask,
    smallest_kept,
)
from keras_tpu_mem.pruning.schedules import (
    ConstantSparsity,
    PolynomialDecay,
    check_schedule,
    never_pruned_message,
    pruning_turn,
    schedule_config,
    schedule_from_config,
)
from keras_tpu_mem.pruning.selection import (
    PrunableWeight,
    check_pair,
    find_prunable_weights,
    normalise_selection,
    select_layers,
)

_POOLING_TYPES = ("AVG", "MAX")

# Schedules whose pruning steps are exactly tfmot's `begin_step + j * frequency`
# (within end_step): the step tests below are simplified with that. Not a
# user's PruningSchedule subclass, whose `__call__` may decide otherwise.
_OWN_SCHEDULES = (ConstantSparsity, PolynomialDecay)


class Pruning(EngineCallback):
    """Magnitude pruning during `fit`, inside the compiled step.

    Prunes the kernels of Dense, EinsumDense (keras-hub transformers),
    Conv1D/2D/3D (and transposed), DepthwiseConv1D/2D, SeparableConv1D/2D
    (pointwise kernel, as tfmot) and Embedding layers, and the weights returned
    by `get_prunable_weights()` of any custom layer (tfmot's `PrunableLayer`
    protocol). Biases and normalisation weights are never pruned.

    After **every optimizer update** (inside the compiled step, on every
    replica, so also with `steps_per_execution > 1` and under XLA) the pruned
    entries are set to exactly zero. At the schedule's pruning steps the masks
    are first recomputed from the magnitudes of the updated weights. Steps
    count optimizer updates (`optimizer.iterations`, 1 after the first update),
    so `GradientAccumulation` does not distort the schedule.

    The model keeps its own layers: no wrapper, no recompile, nothing added to
    what `model.save` writes. Masks are derived from the weights' zeros when
    `fit` starts, so a run resumed by `keras.callbacks.BackupAndRestore` (or a
    second `fit`) continues with the masks it had.

    Args:
        schedule: `ktm.ConstantSparsity`, `ktm.PolynomialDecay`, a
            `tfmot.sparsity.keras` schedule, or any callable
            `step -> (should_prune, sparsity)` built from TensorFlow ops.
        layers: Which layers to prune: None (all supported layers), or a layer
            name, a layer class, or a list of them. A selected layer that
            contains layers (e.g. MultiHeadAttention, a nested model) brings
            its prunable sublayers.
        block_size: `(height, width)` of the blocks pruned together by pooled
            magnitude (rank-2 weights only: Dense, Embedding). `(1, 1)`
            (default) prunes single weights.
        block_pooling_type: `"AVG"` or `"MAX"`: how a block's magnitudes are
            pooled.
        m_by_n: `(m, n)` for N:M structured sparsity, e.g. `(2, 4)`: in every
            aligned group of n consecutive weights along the input-channel axis
            (the contracted axis: `in` of a Dense kernel `[in, out]`, the
            `in_channels` axis of a Conv kernel) the m smallest are zero. The
            schedule then only decides *when* masks are recomputed; the
            sparsity is m / n, and a schedule ending at another sparsity is
            refused.
        log_dir: If given, per-weight sparsity and threshold (the smallest kept
            magnitude, pooled for blocks: the magnitude below which weights are
            pruned; not written for `m_by_n`), and the schedule's sparsity, are
            written as TensorBoard scalars (tags `pruning/<weight path>/sparsity`,
            `.../threshold`, `pruning/schedule_sparsity`) at each epoch end, at
            step `optimizer.iterations`.

    Example:

    ```python
    import numpy as np, keras
    import keras_tpu_mem as ktm

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.random.rand(512, 64), np.random.randint(0, 10, 512)
    model.fit(x, y, batch_size=32, epochs=4, callbacks=[
        ktm.Pruning(ktm.PolynomialDecay(0.0, 0.8, begin_step=0, end_step=60, frequency=10))])
    print(ktm.sparsity_report(model))          # each kernel 80% zeros
    ktm.strip_pruning(model).save("pruned.keras")
    ```
    """

    name = "pruning"
    order = 90

    def __init__(self, schedule, *, layers=None, block_size=(1, 1), block_pooling_type="AVG",
                 m_by_n=None, log_dir=None):
        super().__init__()
        self.schedule = check_schedule(schedule)
        self.layers = normalise_selection(layers)
        self.block_size = check_pair(block_size, "block_size", "block height, width")
        if min(self.block_size) < 1:
            raise ValueError(f"`block_size` values must be >= 1, got {self.block_size}.")
        if not isinstance(block_pooling_type, str) or (
            block_pooling_type.upper() not in _POOLING_TYPES
        ):
            raise ValueError(
                f"`block_pooling_type` must be 'AVG' or 'MAX', got {block_pooling_type!r}."
            )
        self.block_pooling_type = block_pooling_type.upper()
        self.m_by_n = None
        if m_by_n is not None:
            m, n = check_pair(m_by_n, "m_by_n", "m zeros in every n weights")
            if m < 1 or n < 1 or m >= n:
                raise ValueError(
                    f"`m_by_n` must be (m, n) with 0 < m < n (m zeros in every n weights, "
                    f"e.g. (2, 4)), got {(m, n)}."
                )
            self.m_by_n = (m, n)
            if self.block_size != (1, 1):
                raise ValueError(
                    f"Give `m_by_n` or `block_size`, not both (got m_by_n={self.m_by_n}, "
                    f"block_size={self.block_size})."
                )
            final = getattr(self.schedule, "final_sparsity",
                            getattr(self.schedule, "target_sparsity", None))
            if isinstance(final, numbers.Real) and not math.isclose(final, m / n,
                                                                     abs_tol=1e-6):
                raise ValueError(
                    f"With m_by_n={self.m_by_n} the sparsity is fixed at {m}/{n} = {m / n:g}, "
                    f"but the schedule ends at {final:g}. Use e.g. "
                    f"ConstantSparsity({m / n:g}, begin_step=..., frequency=...): the schedule "
                    "then only decides when the N:M masks are recomputed."
                )
        if log_dir is not None:
            if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
                raise TypeError(f"`log_dir` must be a non-empty path, got {log_dir!r}.")
            if importlib.util.find_spec("tensorboard") is None:
                raise ImportError(
                    "Pruning(log_dir=...) writes TensorBoard scalars, which needs the "
                    "`tensorboard` package (TensorFlow >= 2.21 no longer installs it): "
                    "pip install tensorboard."
                )
            log_dir = os.fspath(log_dir)
        self.log_dir = log_dir
        self._weights: list[PrunableWeight] = []
        self._writer = None
        self._needs_sync = False
        self._deferred = False
        self._started_fn = None  # the backend's search for the first pruning step
        self._announced = False
        self._first_step = 0  # optimizer.iterations when the fit began

    # ------------------------------------------------------------ config
    def get_config(self):
        layers = None
        if self.layers is not None:
            layers = [item if isinstance(item, str)
                      else {"class_name": keras.saving.get_registered_name(item)}
                      for item in self.layers]
        return {
            "schedule": schedule_config(self.schedule),
            "layers": layers,
            "block_size": list(self.block_size),
            "block_pooling_type": self.block_pooling_type,
            "m_by_n": None if self.m_by_n is None else list(self.m_by_n),
            "log_dir": self.log_dir,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        schedule = schedule_from_config(config.pop("schedule"))
        layers = config.pop("layers", None)
        if layers is not None:
            resolved = []
            for item in layers:
                if isinstance(item, dict):
                    name = item["class_name"]
                    found = keras.saving.get_registered_object(
                        name, module_objects=vars(keras.layers))
                    if found is None:
                        raise ValueError(f"Unknown layer class {name!r} in `layers`.")
                    item = found
                resolved.append(item)
            layers = resolved
        return cls(schedule, layers=layers, **config)

    # ------------------------------------------------------------ engine
    @property
    def pruned_weights(self) -> list[str]:
        """Paths of the weights pruned in the current/last `fit`."""
        return [w.path for w in self._weights]

    def install(self, model):
        self._deferred = False
        self._needs_sync = True
        if self.log_dir is not None:
            self._writer = EventFileWriter(self.log_dir)
        chosen = select_layers(model, self.layers)  # unknown names fail here
        if not all(layer.built for layer in chosen):
            ctx = StepContext.outside(model)
            if not ctx.builds_in_step():
                raise ValueError(
                    f"Pruning on {ctx.backend_label} needs a built model (define it with "
                    "keras.Input or call `model.build(input_shape)` before `fit`).")
            # Keras builds a lazily built model's layers in the first trace of the
            # step, where the engine asks for `init_state`, which then finds the
            # weights and makes their masks (all ones: an unbuilt model has not been
            # trained, and BackupAndRestore refuses it).
            self._deferred = True
            self._weights = []
            return
        self._setup(model)

    def _setup(self, model):
        weights = find_prunable_weights(model, self.layers)
        self._check_shapes(weights)
        self._weights = weights
        if not self._announced:
            self._announced = True
            total = sum(int(np.prod(w.variable.shape)) for w in weights)
            what = (f"{self.m_by_n[0]}:{self.m_by_n[1]} structured" if self.m_by_n else
                    "block " + "x".join(map(str, self.block_size))
                    if self.block_size != (1, 1) else "magnitude")
            logger.info(
                "Pruning: %s pruning of %d weights (%s parameters) in %d layers, schedule %r.",
                what, len(weights), f"{total:,}", len({id(w.layer) for w in weights}),
                self.schedule,
            )

    @staticmethod
    def _mask_dtype(ctx, variable):
        # A 1-byte mask fuses into the optimizer's update under XLA. Without XLA
        # (TensorFlow), its select kernel is about 3x slower than `MulNoNan` (70 vs
        # 22 us on a 256x256 float32 kernel, 2-core CPU): there the mask takes the
        # weight's dtype and masking is a multiply (`apply_mask`).
        return "bool" if ctx.compiles_with_xla() else variable.dtype

    def init_state(self, ctx):
        """`PruningState`: a mask of ones per pruned weight (what `_sync_masks` makes
        them at the fit's first batch). For a model Keras builds in the step's first
        trace (`builds_in_step`), the weights are found here, in that trace."""
        if self._deferred:
            self._deferred = False
            self._setup(ctx.model)
        return PruningState(tuple(ctx.ones_like(w.variable, self._mask_dtype(ctx, w.variable))
                                  for w in self._weights))

    @property
    def masks(self) -> list[np.ndarray]:
        """The current masks of the pruned weights (`pruned_weights` order) as boolean
        numpy arrays: True where a weight entry is kept. Empty before the first `fit`
        (and, for a model Keras builds in the step, before its first step)."""
        model = getattr(self, "_engine_model", None)
        engine = Engine.of(model) if model is not None else None
        state = engine.feature_state(self) if engine is not None else None
        if state is None:
            return []
        return [ops.convert_to_numpy(mask).astype(bool) for mask in state.masks]

    def uninstall(self, model):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _check_shapes(self, weights):
        if self.block_size != (1, 1):
            bad = [f"{w.path} {tuple(w.variable.shape)}" for w in weights
                   if len(w.variable.shape) != 2]
            if bad:
                raise ValueError(
                    f"block_size={self.block_size} needs rank-2 weights (Dense, Embedding); "
                    f"these are not: {', '.join(bad)}. Select the layers to prune with "
                    "`layers=`."
                )
        if self.m_by_n:
            m, n = self.m_by_n
            bad = [w.path for w in weights if w.kind == "depthwise"]
            if bad:
                raise ValueError(
                    f"m_by_n={self.m_by_n}: depthwise kernels have no input-channel "
                    f"reduction to group along ({', '.join(bad)}). Exclude them with `layers=`."
                )
            short = [f"{w.path} (axis {w.axis} of length {w.variable.shape[w.axis]})"
                     for w in weights if w.variable.shape[w.axis] < n]
            if short:
                raise ValueError(
                    f"m_by_n={self.m_by_n}: the input axis is shorter than n={n} for "
                    f"{', '.join(short)}. Exclude these layers with `layers=`."
                )
            ragged = [w.path for w in weights if w.variable.shape[w.axis] % n]
            if ragged:
                logger.warning(
                    "Pruning m_by_n=%s: the input axis of %s is not a multiple of %d; its "
                    "last, partial group keeps at most %d entries.", self.m_by_n,
                    ", ".join(ragged), n, n - m,
                )

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)
        if self._needs_sync:
            # Here, not in install/on_train_begin: BackupAndRestore restores the
            # weights and the optimizer in its on_train_begin.
            self._needs_sync = False
            self._sync_masks()

    def on_train_begin(self, logs=None):
        self._first_step = int(np.asarray(self.model.optimizer.iterations.value))

    def on_train_end(self, logs=None):
        step = int(np.asarray(self.model.optimizer.iterations.value))
        if self._weights and not self._pruning_started(step):  # silent no more
            warnings.warn(never_pruned_message(self.schedule, step - self._first_step, step,
                                               self._pruning_started), stacklevel=2)
        super().on_train_end(logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is not None and self._weights:
            self._write_summaries()

    # ------------------------------------------------------------ the step
    def quiet_update(self, update: int) -> bool:
        """Whether update `update` (`optimizer.iterations` after it) keeps the masks:
        not one of our schedule's turns (a foreign schedule's are not known: False)."""
        return pruning_turn(self.schedule, update) is False

    def _should_prune(self, step, ctx=None):
        """`(should_prune, sparsity_fn)` for the step's `after_update` (`ctx`: its context).

        For our schedules the predicate is tfmot's, simplified with what is known
        in Python (begin_step 0, end_step -1, frequency 1 drop their tests; steps
        are never negative), and the sparsity is only computed, inside the cond,
        on the steps that prune: fewer ops in every step.
        """
        schedule = self.schedule
        if type(schedule) in _OWN_SCHEDULES:
            begin, end, frequency = schedule.begin_step, schedule.end_step, schedule.frequency
            tests = []
            if frequency > 1:
                since_begin = step - begin if begin else step
                # (`ops.mod` is a floor modulo on every backend, as tf.math.floormod.)
                tests.append(ops.equal(ops.mod(since_begin, frequency), 0))
            if begin > 0:
                tests.append(ops.greater_equal(step, begin))
            if end >= 0:
                tests.append(ops.less_equal(step, end))
            should = ops.convert_to_tensor(True) if not tests else tests[0]
            for test in tests[1:]:
                should = ops.logical_and(should, test)
            return should, lambda: ops.cast(schedule(step)[1], "float32")
        should, sparsity = self._schedule(step, ctx)
        return should, lambda: sparsity

    def _schedule(self, step, ctx=None):
        """The schedule at `step`, as `(bool, float32)`; `ctx`: the step's context (None:
        outside a step)."""
        should, sparsity = self.schedule(step)
        should = ops.cast(should, "bool")
        sparsity = ops.cast(sparsity, "float32")
        if type(self.schedule) not in _OWN_SCHEDULES:
            # A foreign schedule's sparsity is checked here: outside [0, 1) it keeps
            # the previous masks (and TensorFlow without XLA asserts).
            valid = ops.logical_and(ops.greater_equal(sparsity, 0.0), ops.less(sparsity, 1.0))
            should = (ctx or StepContext.outside()).checked(
                should, valid, "Pruning: the schedule returned a sparsity outside [0, 1):",
                sparsity, step)
        return should, sparsity

    def _new_masks(self, sparsity) -> list:
        def mask(w):
            value = ops.convert_to_tensor(w.variable.value)
            if self.m_by_n:
                return m_by_n_mask(value, self.m_by_n, w.axis)
            if self.block_size != (1, 1):
                return block_mask(value, sparsity, self.block_size, self.block_pooling_type)[0]
            return magnitude_mask(ops.abs(value), sparsity)[0]

        return [mask(w) for w in self._weights]

    def after_update(self, ctx):
        """Inside the step, after the optimizer update: recompute the masks when the
        schedule says so, then zero the pruned entries of every pruned weight; returns
        the masks (`PruningState`).

        On TensorFlow this writes the weights; on JAX the engine runs it in a
        `keras.StatelessScope`, where every `.value` is this step's post-update
        value and every assignment becomes part of the step's new state.
        """
        state = ctx.state
        if not ctx.quiet:  # a quiet update (`quiet_update`) keeps the masks as they are
            step = ctx.update_count()  # updates made, this one included
            should, sparsity_fn = self._should_prune(step, ctx)
            state = ctx.state_where(
                should, lambda: PruningState(tuple(self._new_masks(sparsity_fn()))))
        for w, mask in zip(self._weights, state.masks, strict=True):
            value = ops.convert_to_tensor(w.variable.value)
            ctx.assign(w.variable, apply_mask(value, mask, ctx))
        return state

    # ------------------------------------------------------------ resume
    def _pruning_started(self, step: int) -> bool:
        """Whether the schedule recomputed masks at some step in [1, step].

        Walks the steps from 1 and stops at the first that pruned. Our schedules
        prune only on their turns (`pruning_turn`); if any turn prunes with a positive
        sparsity, the first or the second does (ConstantSparsity: all alike;
        PolynomialDecay: zero at the first only when initial_sparsity is 0, then positive
        unless final_sparsity is 0 too): at most two steps are evaluated."""
        if step < 1:
            return False
        first, stride = 1, 1
        if type(self.schedule) in _OWN_SCHEDULES:
            stride = self.schedule.frequency
            first = self.schedule.begin_step or stride  # the first turn >= 1
            step = min(step, first + stride)
            if self.schedule.end_step >= 0:
                step = min(step, self.schedule.end_step)
        if self._started_fn is None:
            structured = self.m_by_n is not None

            def prunes(s):
                should, sparsity = self._schedule(s)
                return should if structured else ops.logical_and(should, sparsity > 0)

            self._started_fn = StepContext.outside().first_step_where(
                prunes, first, stride, traceable=type(self.schedule) in _OWN_SCHEDULES)
        return self._started_fn(step)

    def _sync_masks(self):
        if not self._weights:  # a model Keras builds in the step: masks made there
            return
        step = int(np.asarray(self.model.optimizer.iterations.value))
        started = self._pruning_started(step)
        ctx = StepContext.outside(self.model)
        fn = _nonzero if started else _ones
        Engine.attach(self._engine_model).set_feature_state(self, PruningState(tuple(
            ctx.computed_like(w.variable, fn, self._mask_dtype(ctx, w.variable))
            for w in self._weights)))

    # ------------------------------------------------------------ logging
    def _write_summaries(self):
        """The schedule's sparsity and each weight's sparsity and threshold, computed
        on the host and written with the TensorFlow-free event writer."""
        model = self.model  # on JAX the property syncs Keras' state into the variables
        step = int(np.asarray(model.optimizer.iterations.value))
        step_tensor = ops.convert_to_tensor(step, StepContext.outside().update_count_dtype())
        _, sparsity = self._schedule(step_tensor)
        values = {"pruning/schedule_sparsity": float(sparsity)}
        for w, mask in zip(self._weights, self.masks):
            values[f"pruning/{w.path}/sparsity"] = 1.0 - float(mask.mean())
            if not self.m_by_n:
                values[f"pruning/{w.path}/threshold"] = float(smallest_kept(
                    w.variable.value, mask, self.block_size, self.block_pooling_type))
        self._writer.scalars(step, values)
        self._writer.flush()


class PruningState(NamedTuple):
    """What `Pruning` carries from step to step (its `init_state`).

    Attributes:
        masks: One mask per pruned weight, in `pruned_weights` order: nonzero where
            the weight's entry is kept (bool under XLA, else the weight's dtype).
    """

    masks: tuple


def _nonzero(value):
    """A weight's mask after pruning began: where it is not zero."""
    return ops.not_equal(value, 0)


def _ones(value):
    """A weight's mask before pruning began: all of it."""
    return ops.ones_like(value, dtype="bool")


__all__ = ["Pruning"]
