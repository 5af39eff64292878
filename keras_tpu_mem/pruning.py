"""Magnitude pruning for Keras 3 models: `Pruning`, `strip_pruning`, `sparsity_report`.

tfmot's `prune_low_magnitude` wraps every layer, needs a recompile and refuses
Keras 3 models. Here pruning is an ordinary `fit` callback that plugs into the
engine (`keras_tpu_mem.engine`): the user's model keeps its own layers, and the
masks are applied *inside* the compiled step, right after each optimizer
update, on every replica.

How it works, per pruned weight `w` (a layer kernel):

* a mask of `w`'s shape lives in a replica-local (sync-on-read) Keras
  variable owned by the callback, never by the model, so nothing is added to
  what `model.save` writes. Under XLA (TPUStrategy, `jit_compile=True`) it is
  boolean (1 byte a weight); without XLA it has `w`'s dtype, because there a
  multiply is about 3x faster than TensorFlow's select kernel (`_mask_dtype`);
* after every optimizer update the engine calls `after_update`: the schedule
  is evaluated at `step = optimizer.iterations` (updates made so far); when it
  says so, the masks are recomputed from the magnitudes of the freshly updated
  weights (inside a `tf.cond`), then `w <- where(mask, w, 0)` (without XLA
  `multiply_no_nan(w, mask)`: also exact +0.0 over inf/NaN) is written to every
  replica's copy with the engine's `update_variable` (a merge call and
  `strategy.extended.update`, the way Keras' optimizers write mirrored
  variables). Every replica computes the same mask from the same
  mirrored weights, so no mask is ever communicated;
* the threshold (the k-th largest magnitude) is found by bisection on the
  float bit patterns (31 counting passes) instead of tfmot's full `top_k` sort:
  the same mask, but no O(n log n) sort and no n-element index buffer, which is
  what a TPU wants for multi-million-entry kernels;
* on `fit` start (after `BackupAndRestore` has restored the weights and the
  optimizer) the masks are derived from what was checkpointed: once the
  schedule has pruned at some step <= `optimizer.iterations`, mask = (w != 0);
  before that, all ones. Because pruned entries are exactly zero after every
  update, this is the mask the interrupted run had.
"""

from __future__ import annotations

import math
import numbers
import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import keras
import numpy as np
from keras import ops

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import logger
from keras_tpu_mem.engine import EngineCallback, update_variable
from keras_tpu_mem.pruning_masks import (
    apply_mask,
    block_mask,
    kth_largest,
    m_by_n_mask,
    magnitude_mask,
    smallest_kept,
)
from keras_tpu_mem.pruning_schedules import (
    ConstantSparsity,
    PolynomialDecay,
    PruningSchedule,
    check_schedule,
    schedule_config,
    schedule_from_config,
)

_POOLING_TYPES = ("AVG", "MAX")


def _tensorflow():
    """TensorFlow, imported only on the TensorFlow backend's code paths (the JAX
    path is keras.ops and numpy, so this module imports on a JAX-only install)."""
    import tensorflow as tf

    return tf


def _on_jax() -> bool:
    return keras.backend.backend() == "jax"
# Schedules whose pruning steps are exactly tfmot's `begin_step + j * frequency`
# (within end_step): the step tests below are simplified with that. Not a
# user's PruningSchedule subclass, whose `__call__` may decide otherwise.
_OWN_SCHEDULES = (ConstantSparsity, PolynomialDecay)

# ----------------------------------------------------------------- discovery


@dataclass
class _Weight:
    """One prunable weight: the layer, the variable and its input-channel axis."""

    layer: object
    variable: object
    axis: int  # the axis N:M groups run along (the contracted input axis)
    kind: str  # "dense", "conv", "depthwise", "embedding", "custom", ...
    mask: object = None

    @property
    def path(self) -> str:
        return getattr(self.variable, "path", None) or f"{self.layer.name}/{self.variable.name}"


def _einsum_input_axis(layer) -> int:
    """The last kernel axis that is contracted with the input (EinsumDense)."""
    inputs = layer.equation.split("->")[0].split(",")
    input_spec, kernel_spec = inputs[0].strip(), inputs[1].strip()
    kernel_spec = kernel_spec.replace("...", "")
    contracted = [i for i, c in enumerate(kernel_spec) if c in input_spec]
    return contracted[-1] if contracted else 0


def _layer_weights(layer) -> list[tuple[object, int, str]]:
    """(variable, input axis, kind) for every weight of `layer` that is pruned.

    Biases and normalisation weights are never returned.
    """
    L = keras.layers
    if hasattr(layer, "get_prunable_weights") and callable(layer.get_prunable_weights):
        weights = list(layer.get_prunable_weights())
        for w in weights:
            if not isinstance(w, keras.Variable):
                raise TypeError(
                    f"{layer.name}.get_prunable_weights() must return Keras variables "
                    f"(created with add_weight), got {type(w).__name__}."
                )
        return [(w, (len(w.shape) - 2) if len(w.shape) >= 2 else 0, "custom") for w in weights]
    if isinstance(layer, L.Dense):
        spec = [("kernel", 0, "dense")]
    elif isinstance(layer, L.EinsumDense):
        spec = [("kernel", _einsum_input_axis(layer), "einsum_dense")]
    elif isinstance(layer, (L.SeparableConv1D, L.SeparableConv2D)):
        # As tfmot: the pointwise kernel [1, (1,) in, out]; the depthwise part is tiny.
        spec = [("pointwise_kernel", -2, "separable_conv")]
    elif isinstance(layer, (L.DepthwiseConv1D, L.DepthwiseConv2D)):
        spec = [("kernel", -2, "depthwise")]
    elif isinstance(layer, (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)):
        spec = [("kernel", -1, "conv_transpose")]  # [..., out, in]
    elif isinstance(layer, (L.Conv1D, L.Conv2D, L.Conv3D)):
        spec = [("kernel", -2, "conv")]  # [..., in, out]
    elif isinstance(layer, L.Embedding):
        # The table is the kernel of one_hot(ids) @ table: the vocabulary is the
        # contracted axis (tfmot's rank-2 rule gives the same).
        spec = [("embeddings", 0, "embedding")]
        if getattr(layer, "reverse_embeddings", None) is not None:  # untied ReversibleEmbedding
            spec.append(("reverse_embeddings", 0, "embedding"))
    else:
        return []
    if getattr(layer, "lora_enabled", False):
        raise ValueError(
            f"Layer {layer.name!r} has LoRA enabled: its effective kernel is kernel + A @ B, "
            "which masking the frozen kernel cannot make sparse. Prune before enabling "
            "LoRA, or exclude the layer with `layers=`."
        )
    if getattr(layer, "quantization_mode", None):
        raise ValueError(
            f"Layer {layer.name!r} is quantized ({layer.quantization_mode}); prune the "
            "float model, then quantize it."
        )
    out = []
    for attr, axis, kind in spec:
        variable = getattr(layer, attr)
        if not isinstance(variable, keras.Variable):
            raise TypeError(
                f"{layer.name}.{attr} is a {type(variable).__name__}, not a variable; "
                "keras_tpu_mem cannot prune it."
            )
        axis = axis % len(variable.shape) if len(variable.shape) else 0
        out.append((variable, axis, kind))
    return out


def _all_layers(model):
    return keras_compat.flatten_layers(model, include_self=False, recursive=True)


def _normalise_selection(layers):
    if layers is None:
        return None
    if isinstance(layers, (str, type)):
        layers = [layers]
    if not isinstance(layers, Iterable):
        raise TypeError(
            "`layers` must be None, a layer name, a layer class, or a list of them; got "
            f"{layers!r} ({type(layers).__name__})."
        )
    layers = list(layers)
    if not layers:
        raise ValueError("`layers` is empty: pass None to prune every supported layer.")
    for item in layers:
        if not (isinstance(item, str) or (isinstance(item, type)
                                          and issubclass(item, keras.layers.Layer))):
            raise TypeError(
                "`layers` items must be layer names (str) or keras.layers.Layer subclasses; "
                f"got {item!r} ({type(item).__name__})."
            )
    return layers


def _select_layers(model, selection):
    """The layers `selection` (normalised `layers`) designates; errors for names
    and classes that match no layer."""
    all_layers = _all_layers(model)
    if selection is None:
        return all_layers
    chosen, unmatched = [], []
    for item in selection:
        if isinstance(item, str):
            hits = [layer for layer in all_layers if layer.name == item]
        else:
            hits = [layer for layer in all_layers if isinstance(layer, item)]
        if not hits:
            unmatched.append(item if isinstance(item, str) else item.__name__)
        for hit in hits:
            chosen.append(hit)
            # A selected block (e.g. MultiHeadAttention) brings its sublayers.
            chosen.extend(keras_compat.flatten_layers(hit, include_self=False, recursive=True))
    if unmatched:
        names = ", ".join(repr(layer.name) for layer in all_layers[:20])
        raise ValueError(
            f"`layers` names no layer of the model: {', '.join(map(str, unmatched))}. "
            f"Layers are: {names}{' ...' if len(all_layers) > 20 else ''}."
        )
    return chosen


def find_prunable_weights(model, layers=None) -> list[_Weight]:
    """The weights `Pruning(layers=layers)` would prune in `model`.

    Raises `ValueError` when a name or class in `layers` matches no layer, when
    a selected layer has nothing prunable, or when the model has nothing
    prunable at all.
    """
    selection = _normalise_selection(layers)
    chosen = _select_layers(model, selection)
    found, seen = [], set()
    for layer in chosen:
        for variable, axis, kind in _layer_weights(layer):
            key = id(variable)
            if key in seen:  # shared layers and tied weights are pruned once
                continue
            seen.add(key)
            found.append(_Weight(layer, variable, axis, kind))
    if selection is not None:
        selected_with_weights = {id(w.layer) for w in found}
        for item in selection:
            if isinstance(item, str):
                empty = [layer for layer in chosen if layer.name == item
                         and id(layer) not in selected_with_weights
                         and not any(id(sub) in selected_with_weights for sub in
                                     keras_compat.flatten_layers(layer, include_self=False))]
                if empty:
                    raise ValueError(
                        f"Layer {item!r} ({type(empty[0]).__name__}) has no prunable "
                        "weights: Pruning prunes the kernels of Dense, EinsumDense, Conv, "
                        "DepthwiseConv, SeparableConv and Embedding layers and of layers with "
                        "get_prunable_weights(); biases and normalisation weights never."
                    )
    if not found:
        raise ValueError(
            f"Nothing to prune in model {model.name!r}: no Dense, EinsumDense, Conv*, "
            "DepthwiseConv*, SeparableConv*, Embedding layer or layer with "
            "get_prunable_weights() was found"
            + ("" if selection is None else " among the `layers` selected") + "."
        )
    return found


# ------------------------------------------------------------------- masks
# The mask math is backend-neutral (keras.ops) and lives in `pruning_masks`;
# re-exported here, where it has always been importable from.

# ---------------------------------------------------------------- callback


def _check_pair(value, name, what):
    try:
        pair = tuple(value)
    except TypeError:
        raise TypeError(f"`{name}` must be a pair of ints ({what}), got {value!r}.") from None
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, numbers.Integral)
                             for v in pair):
        raise TypeError(f"`{name}` must be a pair of ints ({what}), got {value!r}.")
    return tuple(int(v) for v in pair)


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
        self.layers = _normalise_selection(layers)
        self.block_size = _check_pair(block_size, "block_size", "block height, width")
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
            m, n = _check_pair(m_by_n, "m_by_n", "m zeros in every n weights")
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
            if _on_jax():
                if _event_writer_class() is None:
                    raise ImportError(
                        "Pruning(log_dir=...) writes TensorBoard scalars, which needs the "
                        "`tensorboard` package: pip install tensorboard.")
            elif not hasattr(_tensorflow().summary, "scalar"):
                raise ImportError(
                    "Pruning(log_dir=...) writes TensorBoard scalars, which needs the "
                    "`tensorboard` package (TensorFlow >= 2.21 no longer installs it): "
                    "pip install tensorboard."
                )
            log_dir = os.fspath(log_dir)
        self.log_dir = log_dir
        self._weights: list[_Weight] = []
        self._writer = None
        self._needs_sync = False
        self._deferred = False
        self._started_fn = None
        self._host_schedule_fn = None  # JAX: the schedule as one jitted function
        self._announced = False

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
            if _on_jax():
                self._writer = _event_writer_class()(self.log_dir, flush_secs=30)
            else:
                self._writer = _tensorflow().summary.create_file_writer(self.log_dir)
        chosen = _select_layers(model, self.layers)  # unknown names fail here
        if not all(layer.built for layer in chosen):
            if _on_jax():
                # Keras' JAX fit builds the model before the step is made; a model
                # still unbuilt here has no kernels to carry masks for.
                raise ValueError(
                    "Pruning on JAX needs a built model (define it with keras.Input or "
                    "call `model.build(input_shape)` before `fit`).")
            # A lazily built model (e.g. subclassed, default strategy): Keras builds
            # its layers in the first trace of the step, before `after_update`,
            # which then finds the weights and creates their masks (all ones: an
            # unbuilt model has not been trained, and BackupAndRestore refuses it).
            self._deferred = True
            self._weights = []
            return
        self._setup(model)

    def _setup(self, model):
        weights = find_prunable_weights(model, self.layers)
        self._check_shapes(weights)
        previous = self._weights
        if (len(previous) == len(weights)
                and all(a.variable is b.variable
                        and a.mask.dtype == _mask_dtype(model, a.variable)
                        for a, b in zip(previous, weights))):
            # The same model again (a second fit): keep the mask variables, which
            # the engine's cached step still refers to; they are re-derived below.
            weights = previous
        elif _on_jax():
            from keras_tpu_mem._compat import jax as jax_compat

            for w in weights:
                # Owned by the callback, not the model; the engine carries its value
                # beside Keras' state. Bool (XLA always compiles on JAX), laid out
                # exactly like its kernel (under ModelParallel: the same shards).
                w.mask = keras.Variable(initializer="ones", shape=tuple(w.variable.shape),
                                        dtype="bool", trainable=False, name="pruning_mask")
                jax_compat.set_variable_value(w.mask, _like(w.variable, True))
        else:
            with model.distribute_strategy.scope():
                for w in weights:
                    # Replica-local: each replica writes its own copy in the step
                    # (all copies are equal: same mirrored weights, same computation).
                    w.mask = keras.Variable(
                        initializer="ones", shape=tuple(w.variable.shape),
                        dtype=_mask_dtype(model, w.variable), trainable=False,
                        synchronization="on_read", aggregation="only_first_replica",
                        name="pruning_mask",
                    )
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

    def step_variables(self):
        return [w.mask for w in self._weights]

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

    def on_epoch_end(self, epoch, logs=None):
        if self._writer is not None and self._weights:
            self._write_summaries()

    # ------------------------------------------------------------ the step
    def _should_prune(self, step):
        """`(should_prune, sparsity_fn)` for the step's `after_update`.

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
        should, sparsity = self._schedule(step)
        return should, lambda: sparsity

    def _schedule(self, step):
        should, sparsity = self.schedule(step)
        if _on_jax():
            should = ops.cast(should, "bool")
            sparsity = ops.cast(sparsity, "float32")
            if type(self.schedule) not in _OWN_SCHEDULES:
                # XLA has no assertions: an out-of-range sparsity from a foreign
                # schedule keeps the previous masks (as under XLA on TensorFlow).
                valid = ops.logical_and(ops.greater_equal(sparsity, 0.0),
                                        ops.less(sparsity, 1.0))
                should = ops.logical_and(should, valid)
            return should, sparsity
        tf = _tensorflow()
        should = tf.cast(should, tf.bool)
        sparsity = tf.cast(sparsity, tf.float32)
        if type(self.schedule) not in _OWN_SCHEDULES:
            # A foreign schedule is only checked here. (XLA drops assertions: there
            # an out-of-range sparsity keeps the previous masks instead.)
            valid = tf.logical_and(tf.math.greater_equal(sparsity, 0.0),
                                   tf.math.less(sparsity, 1.0))
            check = tf.debugging.Assert(
                tf.logical_or(tf.logical_not(should), valid),
                ["Pruning: the schedule returned a sparsity outside [0, 1):", sparsity, step],
            )
            with tf.control_dependencies([check]):
                should = tf.logical_and(should, valid)
        return should, sparsity

    def _new_mask(self, w, sparsity):
        value = ops.convert_to_tensor(w.variable.value)
        if self.m_by_n:
            return m_by_n_mask(value, self.m_by_n, w.axis)
        if self.block_size != (1, 1):
            return block_mask(value, sparsity, self.block_size, self.block_pooling_type)[0]
        return magnitude_mask(ops.abs(value), sparsity)[0]

    def after_update(self, ctx):
        if _on_jax():
            return self._after_update_jax(ctx)
        tf = _tensorflow()
        model = ctx.model
        if self._deferred:
            self._deferred = False
            self._weights = []
            with tf.init_scope():  # create the mask variables eagerly, outside the trace
                self._setup(model)
        step = tf.convert_to_tensor(model.optimizer.iterations)
        should, sparsity_fn = self._should_prune(step)

        def recompute():
            sparsity = sparsity_fn()
            for w in self._weights:
                w.mask.assign(tf.cast(self._new_mask(w, sparsity), w.mask.dtype))
            return tf.constant(True)

        tf.cond(should, recompute, lambda: tf.constant(False))
        for w in self._weights:
            value = tf.convert_to_tensor(w.variable.value)
            update_variable(w.variable, _assign, apply_mask(value, w.mask.value))

    def _after_update_jax(self, ctx):
        """The same hook in keras.ops, run by the JAX engine inside a StatelessScope:
        every `.value` below is this step's post-update value, every `assign` becomes
        part of the step's new state."""
        step = ctx.model.optimizer.iterations.value  # updates made, this one included
        should, sparsity_fn = self._should_prune(step)
        weights = self._weights

        def recompute():
            sparsity = sparsity_fn()
            return [ops.cast(self._new_mask(w, sparsity), "bool") for w in weights]

        def keep():
            return [w.mask.value for w in weights]

        # Assign outside the branches: values computed inside a cond must leave it
        # as its outputs, not as assignments.
        masks = ops.cond(should, recompute, keep) if weights else []
        for w, mask in zip(weights, masks):
            w.mask.assign(mask)
            w.variable.assign(apply_mask(w.variable.value, mask))

    # ------------------------------------------------------------ resume
    def _pruning_started(self, step: int) -> bool:
        """Whether the schedule recomputed masks at some step in [1, step].

        Walks the steps from 1 and stops at the first that pruned. Our own
        schedules prune only on their turns, `begin_step + j * frequency` up to
        `end_step`, and if any turn prunes with a positive sparsity, the first or
        the second does (ConstantSparsity: all alike; PolynomialDecay: zero at
        the first turn only when initial_sparsity is 0, and then positive at
        every later turn unless final_sparsity is 0 too). So there at most two
        steps are evaluated, however late a run resumes.
        """
        if step < 1:
            return False
        first, stride = 1, 1
        if type(self.schedule) in _OWN_SCHEDULES:
            stride = self.schedule.frequency
            first = self.schedule.begin_step or stride  # the first turn >= 1
            step = min(step, first + stride)
            if self.schedule.end_step >= 0:
                step = min(step, self.schedule.end_step)
        structured = self.m_by_n is not None
        if _on_jax():
            # On the host, step by step (our schedules: at most two steps). Our
            # schedules as one jitted function: one compile, where each of their
            # ~20 ops run eagerly compiles on its own (a second on a first resume).
            schedule_fn = self._schedule
            if type(self.schedule) in _OWN_SCHEDULES:
                if self._host_schedule_fn is None:
                    import jax

                    self._host_schedule_fn = jax.jit(self._schedule)
                schedule_fn = self._host_schedule_fn
            for s in range(first, step + 1, stride):
                should, sparsity = schedule_fn(np.int32(s))
                if bool(should) and (structured or float(sparsity) > 0):
                    return True
            return False
        tf = _tensorflow()
        if self._started_fn is None:

            @tf.function(autograph=False)
            def started(limit):
                def cond(s, found):
                    return tf.logical_and(s <= limit, tf.logical_not(found))

                def body(s, found):
                    should, sparsity = self._schedule(s)
                    prunes = should if structured else tf.logical_and(should, sparsity > 0)
                    return s + stride, prunes

                _, found = tf.while_loop(cond, body, (tf.constant(first, tf.int64),
                                                      tf.constant(False)))
                return found

            self._started_fn = started
        return bool(self._started_fn(tf.constant(step, tf.int64)))

    def _sync_masks(self):
        step = int(np.asarray(self.model.optimizer.iterations.value))
        started = self._pruning_started(step)
        if _on_jax():
            from keras_tpu_mem._compat import jax as jax_compat

            for w in self._weights:
                mask = (np.asarray(w.variable.value) != 0) if started else True
                jax_compat.set_variable_value(w.mask, _like(w.variable, mask))
            return
        tf = _tensorflow()
        for w in self._weights:
            value = tf.convert_to_tensor(w.variable.value)
            mask = tf.not_equal(value, 0) if started else tf.ones(value.shape, tf.bool)
            w.mask.assign(tf.cast(mask, w.mask.dtype))

    # ------------------------------------------------------------ logging
    def _write_summaries(self):
        if _on_jax():
            return self._write_summaries_jax()
        tf = _tensorflow()
        step = int(self.model.optimizer.iterations.numpy())
        _, sparsity = self._schedule(tf.constant(step, tf.int64))
        with self._writer.as_default(step=step):
            tf.summary.scalar("pruning/schedule_sparsity", sparsity)
            for w in self._weights:
                mask = tf.cast(w.mask.value, tf.bool)
                tf.summary.scalar(f"pruning/{w.path}/sparsity",
                                  1.0 - tf.reduce_mean(tf.cast(mask, tf.float32)))
                if not self.m_by_n:
                    tf.summary.scalar(f"pruning/{w.path}/threshold", smallest_kept(
                        w.variable.value, mask, self.block_size, self.block_pooling_type))
        self._writer.flush()

    def _write_summaries_jax(self):
        """The same scalars, on the host, with TensorBoard's pure-Python event writer."""
        from tensorboard.compat.proto import event_pb2, summary_pb2

        model = self.model  # the property: syncs Keras' JAX state into the variables
        step = int(np.asarray(model.optimizer.iterations.value))
        _, sparsity = self._schedule(np.int32(step))
        values = {"pruning/schedule_sparsity": float(sparsity)}
        for w in self._weights:
            mask = np.asarray(w.mask.value).astype(bool)
            values[f"pruning/{w.path}/sparsity"] = 1.0 - float(mask.mean())
            if not self.m_by_n:
                values[f"pruning/{w.path}/threshold"] = float(smallest_kept(
                    w.variable.value, w.mask.value, self.block_size, self.block_pooling_type))
        summary = summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=tag, simple_value=value)
            for tag, value in values.items() if math.isfinite(value)])
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step,
                                               summary=summary))
        self._writer.flush()


def _like(variable, value):
    """`value` (a bool or a bool array of the variable's shape) as a bool array placed
    exactly like the variable's value (its sharding under a keras.distribution)."""
    import jax

    current = variable.value
    array = np.ascontiguousarray(
        np.broadcast_to(np.asarray(value, dtype=bool), tuple(current.shape)))
    if keras.distribution.distribution() is None:
        # Uncommitted, like Keras' own state without a distribution: a committed
        # mask would commit every output of the step, and the next fit's step
        # (same shapes, now committed arguments) would compile a second time.
        return jax.numpy.asarray(array)
    return jax.device_put(array, current.sharding)


def _event_writer_class():
    """TensorBoard's pure-Python `EventFileWriter`, or None without `tensorboard`."""
    from keras_tpu_mem.monitoring._writer import _event_writer_class as find

    return find()


def _assign(variable, value):
    return variable.assign(value)


def _mask_dtype(model, variable) -> str:
    """The dtype a weight's mask is stored in: bool under XLA, else the weight's.

    Both give exact zeros, also where the weight is inf or NaN (`where` and
    `multiply_no_nan`). Under XLA (`jit_compile=True`; TPUStrategy always
    compiles) the masking fuses into the optimizer's update, so the 1-byte
    mask is free. Without XLA, TensorFlow's `SelectV2` kernel is about 3x
    slower than `MulNoNan` (70 vs 22 us on a 256x256 float32 kernel, 2-core
    CPU): there the mask takes the weight's dtype and masking is a multiply.
    """
    if _on_jax():
        return "bool"  # XLA always compiles the JAX step
    tf = _tensorflow()
    xla = bool(model.jit_compile) or isinstance(model.distribute_strategy,
                                                tf.distribute.TPUStrategy)
    return "bool" if xla else variable.dtype


# Kept under their old private names (tests and benchmarks import them).
_apply_mask = apply_mask
_smallest_kept = smallest_kept


# -------------------------------------------------------------- stripping


def strip_pruning(model):
    """Returns a copy of `model` for export: ordinary layers, the sparse weights.

    `ktm.Pruning` never wraps layers nor adds variables to the model, so the
    copy is a plain `keras.models.clone_model` of the trained model with its
    weights (the pruned entries exactly zero) and without the optimizer or the
    compiled training step (compile it again to evaluate or fine-tune, as after
    tfmot's `strip_pruning`). It saves to `.keras` and loads with
    `keras.saving.load_model(path)` in safe mode with no custom objects (as
    long as the original model's own layers need none).

    Args:
        model: A (pruned) `keras.Model`: Sequential, functional, or a subclassed
            model that implements `get_config`/`from_config`.

    Returns:
        A new, uncompiled `keras.Model` with the same weights.

    Example:

    ```python
    stripped = ktm.strip_pruning(model)
    stripped.save("model.keras")
    restored = keras.saving.load_model("model.keras")   # safe_mode=True
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"strip_pruning expects a keras.Model, got {type(model).__name__}.")
    if not model.built:
        raise ValueError(f"Model {model.name!r} is not built: it has no weights to strip.")
    try:
        clone = keras.models.clone_model(model)
    except Exception as err:  # subclassed models without get_config
        raise TypeError(
            f"strip_pruning could not clone {type(model).__name__} ({type(err).__name__}: "
            f"{err}). Implement get_config/from_config on the model, or save it directly: "
            "keras_tpu_mem adds no state to the model, its weights are already sparse."
        ) from err
    if not clone.built:
        shapes = getattr(model, "_build_shapes_dict", None)
        if shapes:
            clone.build(**shapes)
    clone.set_weights(model.get_weights())
    return clone


# ----------------------------------------------------------------- report


@dataclass
class WeightSparsity:
    """Sparsity of one prunable weight and what sparse formats would store.

    Attributes:
        path: The variable path (`layer/kernel`).
        layer: The layer name.
        shape: The weight's shape.
        size: Number of entries.
        zeros: Number of entries equal to 0.
        dense_bytes: Bytes stored densely.
        csr_bytes: Bytes as CSR over the `[prod(shape[:-1]), shape[-1]]` view:
            values + int32 column indices + int32 row pointers.
        bitmask_bytes: Bytes as the non-zero values + a 1-bit-per-entry mask.
        compressed_bytes: zlib (level 6) size of the dense bytes, when asked.
    """

    path: str
    layer: str
    shape: tuple
    size: int
    zeros: int
    dense_bytes: int
    csr_bytes: int
    bitmask_bytes: int
    compressed_bytes: int | None = None

    @property
    def sparsity(self) -> float:
        return self.zeros / self.size if self.size else 0.0

    @property
    def best_bytes(self) -> int:
        """The smallest of dense, CSR and bitmask storage."""
        return min(self.dense_bytes, self.csr_bytes, self.bitmask_bytes)


@dataclass
class SparsityReport:
    """Per-weight and total sparsity of a model's prunable weights.

    Attributes:
        weights: One `WeightSparsity` per prunable weight.
        model_bytes: Bytes of all the model's weights stored densely.
    """

    weights: list[WeightSparsity] = field(default_factory=list)
    model_bytes: int = 0

    @property
    def size(self) -> int:
        return sum(w.size for w in self.weights)

    @property
    def zeros(self) -> int:
        return sum(w.zeros for w in self.weights)

    @property
    def sparsity(self) -> float:
        """Fraction of zeros over all prunable weights."""
        return self.zeros / self.size if self.size else 0.0

    @property
    def dense_bytes(self) -> int:
        return sum(w.dense_bytes for w in self.weights)

    @property
    def sparse_bytes(self) -> int:
        """Prunable weights stored each in its smallest format (dense, CSR, bitmask)."""
        return sum(w.best_bytes for w in self.weights)

    @property
    def saved_bytes(self) -> int:
        """Bytes a sparse format saves over dense storage."""
        return self.dense_bytes - self.sparse_bytes

    @property
    def compressed_bytes(self) -> int | None:
        if any(w.compressed_bytes is None for w in self.weights):
            return None
        return sum(w.compressed_bytes for w in self.weights)

    def to_dict(self) -> dict:
        return {
            "weights": [dict(vars(w), sparsity=w.sparsity, best_bytes=w.best_bytes,
                             shape=list(w.shape)) for w in self.weights],
            "size": self.size, "zeros": self.zeros, "sparsity": self.sparsity,
            "dense_bytes": self.dense_bytes, "sparse_bytes": self.sparse_bytes,
            "saved_bytes": self.saved_bytes, "compressed_bytes": self.compressed_bytes,
            "model_bytes": self.model_bytes,
        }

    def __str__(self) -> str:
        compressed = self.compressed_bytes is not None
        head = f"{'weight':<40} {'shape':>16} {'sparsity':>9} {'dense':>10} {'sparse':>10}"
        if compressed:
            head += f" {'zlib':>10}"
        lines = [head, "-" * len(head)]
        for w in self.weights:
            line = (f"{w.path[:40]:<40} {str(tuple(w.shape)):>16} {w.sparsity:>9.2%} "
                    f"{_human(w.dense_bytes):>10} {_human(w.best_bytes):>10}")
            if compressed:
                line += f" {_human(w.compressed_bytes):>10}"
            lines.append(line)
        lines.append("-" * len(head))
        total = (f"{'total':<40} {self.size:>16,} {self.sparsity:>9.2%} "
                 f"{_human(self.dense_bytes):>10} {_human(self.sparse_bytes):>10}")
        if compressed:
            total += f" {_human(self.compressed_bytes):>10}"
        lines.append(total)
        saved = self.saved_bytes
        lines.append(
            f"A sparse format saves {_human(saved)} of {_human(self.model_bytes)} of weights "
            f"({saved / self.model_bytes:.1%})." if self.model_bytes else ""
        )
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def sparsity_report(model, *, layers=None, compressed: bool = False) -> SparsityReport:
    """Per-weight and total sparsity of the weights `Pruning` prunes, and the bytes saved.

    Works on any model (pruned, stripped or loaded from disk): it reads the
    zeros in the weights.

    Args:
        model: A built `keras.Model`.
        layers: Restrict to these layers (as `Pruning(layers=...)`).
        compressed: Also measure the zlib-compressed size of each weight (reads
            and compresses every prunable weight on the host: slow for big models).

    Returns:
        A `SparsityReport`; `print()` it for a table.

    Example:

    ```python
    report = ktm.sparsity_report(model)
    print(report)                       # table per kernel, total, bytes saved
    assert report.sparsity > 0.79
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"sparsity_report expects a keras.Model, got {type(model).__name__}.")
    report = SparsityReport()
    report.model_bytes = int(sum(
        np.prod(v.shape) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in model.weights))
    for w in find_prunable_weights(model, layers):
        value = keras.ops.convert_to_numpy(w.variable.value)
        size = int(value.size)
        itemsize = value.dtype.itemsize
        nnz = int(np.count_nonzero(value))
        rows = int(np.prod(value.shape[:-1])) if value.ndim > 1 else 1
        report.weights.append(WeightSparsity(
            path=w.path, layer=w.layer.name, shape=tuple(value.shape), size=size,
            zeros=size - nnz, dense_bytes=size * itemsize,
            csr_bytes=nnz * (itemsize + 4) + (rows + 1) * 4,
            bitmask_bytes=nnz * itemsize + math.ceil(size / 8),
            compressed_bytes=len(zlib.compress(value.tobytes(), 6)) if compressed else None,
        ))
    return report


__all__ = [
    "ConstantSparsity",
    "PolynomialDecay",
    "Pruning",
    "PruningSchedule",
    "SparsityReport",
    "WeightSparsity",
    "block_mask",
    "find_prunable_weights",
    "kth_largest",
    "m_by_n_mask",
    "magnitude_mask",
    "sparsity_report",
    "strip_pruning",
]
