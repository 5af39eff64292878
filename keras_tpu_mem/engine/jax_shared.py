"""Pieces both JAX step builders use (`engine/jax.py`, `engine/jax_pulled.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Odd 32-bit constant (the golden ratio's): device i's dropout seeds are
# offset by i times it, so no two devices of a shard_map draw the same masks.
SEED_STRIDE = 0x9E3779B9


def leading_dim(structure) -> int | None:
    for leaf in jax.tree_util.tree_leaves(structure):
        shape = getattr(leaf, "shape", None)
        if shape:
            return int(shape[0])
    return None


def restore_variables(model, state) -> bool:
    """Writes a train-function state `(trainable, non_trainable, optimizer, metrics)`
    back into the model's variables; False (and a warning) where the step's donation
    already freed it (an error while the step ran on the device)."""
    groups = (model.trainable_variables, model.non_trainable_variables,
              model.optimizer.variables, model.metrics_variables)
    try:
        pairs = [(v, value) for variables, values in zip(groups, state)
                 for v, value in zip(variables, values)]
        if any(getattr(value, "is_deleted", lambda: False)() for _, value in pairs):
            from keras_tpu_mem._utils import logger

            logger.warning("The failed step had already consumed the training state on the "
                           "device (its buffers are donated), and Keras' fit keeps no other "
                           "copy: the model's variables hold no values now. Load the last "
                           "checkpoint (BackupAndRestore resumes from it) before using it.")
            return False
        for variable, value in pairs:
            variable.assign(value)
    except Exception as err:  # the step's own error is the one to raise
        from keras_tpu_mem._utils import logger

        logger.debug("could not restore the variables after a failed step: %s", err)
        return False
    return True


def is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def offset_seed(state, offset):
    """A SeedGenerator state `[seed, counter]` with its seed moved by `offset` (mod 2^32)."""
    return state.at[0].add(offset.astype(state.dtype))


def combine(axis, shards, before, after, aggregation):
    """One variable's per-device values after the loop, made one replicated value.

    By the variable's declared `aggregation`, as tf.distribute combines
    per-replica values: "sum" (metric totals and counts) adds every device's
    change; "mean" averages; "only_first_replica" takes device 0's. "none"
    (BatchNormalization's moving statistics, seed states): floats are averaged,
    integers (counters, equal on every device) taken as they are.
    """
    dtype = after.dtype
    if aggregation == "sum":
        return before + jax.lax.psum(after - before, axis)
    if aggregation == "only_first_replica":
        first = jax.lax.axis_index(axis) == 0
        return jax.lax.psum(jnp.where(first, after, jnp.zeros_like(after)), axis)
    if is_float(dtype):
        return jax.lax.psum(after, axis) / shards
    if dtype == jnp.bool_:
        return jax.lax.pmax(after.astype(jnp.int32), axis).astype(dtype)
    return jax.lax.pmax(after, axis)
