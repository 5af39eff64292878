"""Pruning on JAX: masks carried in the jitted state, values in and values out.

Contract: as `backends/tensorflow/pruning.py`. Here `after_update` runs inside
a `keras.StatelessScope` (the JAX engine's): `.value` reads this step's
post-update values and `assign` makes them part of the step's new state.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
from keras import ops

from keras_tpu_mem._compat import jax as jax_compat

# No x64: JAX has no int64 unless enabled, so optimizer.iterations is int32.
STEP_DTYPE = "int32"
RUNS_TENSORFLOW_OPS = False
# Keras' JAX fit builds the model before the step is made; a model still
# unbuilt then has no kernels to carry masks for.
BUILDS_IN_STEP = False


def eagerly(fn):
    return fn()


def mask_dtype(model, variable) -> str:
    return "bool"  # XLA always compiles the JAX step


def _like(variable, value):
    """`value` (a bool or a bool array of the variable's shape) as a bool array placed
    exactly like the variable's value (its sharding under a keras.distribution)."""
    current = variable.value
    array = np.ascontiguousarray(
        np.broadcast_to(np.asarray(value, dtype=bool), tuple(current.shape)))
    if keras.distribution.distribution() is None:
        # Uncommitted, like Keras' own state without a distribution: a committed
        # mask would commit every output of the step, and the next fit's step
        # (same shapes, now committed arguments) would compile a second time.
        return jax.numpy.asarray(array)
    return jax.device_put(array, current.sharding)


def new_mask(model, variable):
    """Owned by the callback, not the model; the engine carries its value beside
    Keras' state. Bool, laid out exactly like its kernel (under ModelParallel:
    the same shards)."""
    mask = keras.Variable(initializer="ones", shape=tuple(variable.shape),
                          dtype="bool", trainable=False, name="pruning_mask")
    jax_compat.set_variable_value(mask, _like(variable, True))
    return mask


def derive_mask(mask, variable, from_zeros: bool) -> None:
    if not from_zeros:
        jax_compat.set_variable_value(mask, _like(variable, True))
        return
    # On the device array, never gathered to the host: under sharded state in a
    # multi-process run (a resume under ShardedDataParallel) a process holds only
    # its own shards, and reading the whole value there fails. The comparison is
    # elementwise: the mask comes out laid out as the kernel (its sharding, or
    # uncommitted like Keras' own state without a distribution).
    current = variable.value
    if keras.distribution.distribution() is None:
        bits = jax.numpy.not_equal(current, 0)
    else:
        bits = jax.jit(_nonzero, out_shardings=current.sharding)(current)
    jax_compat.set_variable_value(mask, bits)


def _nonzero(value):
    return jax.numpy.not_equal(value, 0)


def step_count(optimizer):
    return optimizer.iterations.value  # updates made, this one included


def check_sparsity(should, valid, sparsity, step):
    """XLA has no assertions: an out-of-range sparsity from a foreign schedule
    keeps the previous masks (as under XLA on TensorFlow)."""
    return ops.logical_and(should, valid)


def update_masks(should, new_masks, masks) -> None:
    """Assigns outside the branches: values computed inside a cond must leave it
    as its outputs, not as assignments."""
    if not masks:
        return
    values = ops.cond(should,
                      lambda: [ops.cast(value, mask.dtype)
                               for mask, value in zip(masks, new_masks())],
                      lambda: [mask.value for mask in masks])
    for mask, value in zip(masks, values):
        mask.assign(value)


def assign_in_step(variable, value) -> None:
    variable.assign(value)


def apply_float_mask(value, mask):
    return ops.where(ops.not_equal(mask, 0), value, ops.zeros((), value.dtype))


def step_search(prunes, first: int, stride: int, traceable: bool = True):
    """On the host, step by step (our schedules: at most two steps). A traceable
    `prunes` as one jitted function: one compile, where each of its ~20 ops run
    eagerly compiles on its own (a second on a first resume)."""
    fn = jax.jit(prunes) if traceable else prunes

    def found(limit):
        return any(bool(fn(np.int32(s))) for s in range(first, limit + 1, stride))

    return found
