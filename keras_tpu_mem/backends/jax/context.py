"""The step's verbs on JAX: what `StepContext` does for a feature.

Contract: `keras_tpu_mem.backends.contracts.Context` (the same functions in
`backends/tensorflow/context.py`, whose docstrings say what each does). Here a
feature's state is carried beside Keras' state into and out of the jitted step,
values in and values out (`feature_state.py`); the engine runs `after_update`
inside a `keras.StatelessScope`, where a model variable's `.value` reads this
step's post-update value and `assign` makes it part of the step's new state.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
from keras import ops


def update_count_dtype() -> str:
    # No x64: JAX has no int64 unless enabled, so optimizer.iterations is int32.
    return "int32"


def runs_tensorflow_ops() -> bool:
    return False


def builds_in_step() -> bool:
    # Keras' JAX fit builds the model before the step is made; a model still
    # unbuilt then has no weights to carry state for.
    return False


def compiles_with_xla(model) -> bool:
    return True  # every JAX step is an XLA program


def eagerly(fn):
    return fn()


def ones_like(like, dtype):
    """Laid out exactly like `like` (under ModelParallel: the same shards)."""
    ones = np.ones(tuple(like.shape), dtype=keras.backend.standardize_dtype(dtype))
    if keras.distribution.distribution() is None:
        # Uncommitted, like Keras' own state without a distribution: a committed
        # state would commit every output of the step, and the next fit's step
        # (same shapes, now committed arguments) would compile a second time.
        return jax.numpy.asarray(ones)
    return jax.device_put(ones, like.value.sharding)


def computed_like(like, fn, dtype):
    """`fn` should be a module-level function: it is compiled once per layout."""
    # On the device array, never gathered to the host: under sharded state in a
    # multi-process run (a resume under ShardedDataParallel) a process holds only
    # its own shards, and reading the whole value there fails. `fn` is
    # elementwise: the result comes out laid out as `like` (its sharding, or
    # uncommitted like Keras' own state without a distribution).
    current = like.value
    if keras.distribution.distribution() is None:
        value = fn(current)
    else:
        value = jax.jit(fn, out_shardings=current.sharding)(current)
    dtype = keras.backend.standardize_dtype(dtype)
    if keras.backend.standardize_dtype(value.dtype) != dtype:
        value = value.astype(dtype)
    return value


def update_count(optimizer):
    return optimizer.iterations.value  # updates made, this one included


def assign(variable, value) -> None:
    variable.assign(value)


def state_where(condition, ctx, new_state):
    """A `cond` whose branches return the state (values in, values out)."""
    current = ctx.state
    return ops.cond(condition,
                    lambda: keras.tree.map_structure(
                        lambda new, old: ops.cast(new, old.dtype), new_state(), current),
                    lambda: current)


def checked(condition, valid, message: str, *data):
    """XLA has no assertions: `condition and valid` (as under XLA on TensorFlow)."""
    return ops.logical_and(condition, valid)


def masked(value, mask):
    return ops.where(ops.not_equal(mask, 0), value, ops.zeros((), value.dtype))


def first_step_where(predicate, first: int, stride: int, traceable: bool = True):
    """On the host, step by step (our schedules: at most two steps). A traceable
    `predicate` as one jitted function: one compile, where each of its ~20 ops
    run eagerly compiles on its own (a second on a first resume)."""
    fn = jax.jit(predicate) if traceable else predicate

    def found(limit):
        return any(bool(fn(np.int32(s))) for s in range(first, limit + 1, stride))

    return found


def check_layer_remat() -> None:
    """Nothing to refuse: whole-layer recomputation works on JAX."""


def splits_batches_at_run_time() -> bool:
    # JAX's step never splits a batch whose size it does not know: every size is
    # a Python int when the step is traced, and a batch that does not split was
    # refused then (`GradientAccumulation.micro_batches`), before any step ran.
    # So no error of the step is a split's, and JAX has no `batch_split` concern.
    return False
