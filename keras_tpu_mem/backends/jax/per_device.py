"""Keras' state in and out of a `shard_map` body over the batch axis.

Every reducer that runs the gradient inside `shard_map` (`reducers.py`) starts
its body the same way (each device's dropout seeds moved by its index) and ends
it the same way (each per-device value made one replicated value again by its
variable's declared aggregation, as tf.distribute combines per-replica values).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem._compat import keras as keras_compat

# Odd 32-bit constant (the golden ratio's): device i's dropout seeds are
# offset by i times it, so no two devices of a shard_map draw the same masks.
SEED_STRIDE = 0x9E3779B9


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


class PerDeviceState:
    """Keras' state in and out of a `shard_map` body over the batch axis.

    Inside the body each device runs its own share of the step: its dropout
    seeds are offset by its index (`localize`), so no two devices draw the
    same masks, and afterwards the per-device values are made one replicated
    value again by each variable's declared aggregation (`combine`).

    Args:
        model: The model whose step the body runs.
        distribution: The active `keras.distribution` (with a batch axis).
        shards: Devices along its batch axis.
    """

    def __init__(self, model, distribution, shards):
        self.distribution = distribution
        self.axis = distribution.batch_dim_name
        self.mesh = jax_compat.backend_mesh(distribution.device_mesh)
        self.shards = shards
        seed_ids = {id(generator.state)
                    for layer in keras_compat.flatten_layers(model, include_self=True)
                    for generator in jax_compat.seed_generators(layer)}
        self.seeds = [id(v) in seed_ids for v in model.non_trainable_variables]
        self.non_trainable_agg = [v.aggregation for v in model.non_trainable_variables]
        self.metrics_agg = [v.aggregation for v in model.metrics_variables]

    def layouts(self):
        """Layer-output layouts without the manual batch axis, while the body traces."""
        return jax_compat.tensor_layouts_for_manual_axes(self.distribution, {self.axis})

    def localize(self, non_trainable):
        """`(non_trainable with this device's seeds, offset)`, inside the body."""
        offset = jax.lax.axis_index(self.axis).astype(jnp.uint32) * jnp.uint32(SEED_STRIDE)
        return [offset_seed(v, offset) if s else v
                for v, s in zip(non_trainable, self.seeds)], offset

    def run(self, non_trainable, step):
        """`(offset, step(non_trainable with this device's seeds))`, traced under
        `layouts()`: how every body over the batch axis starts."""
        start, offset = self.localize(non_trainable)
        with self.layouts():
            return offset, step(start)

    def combine(self, non_trainable, local_non_trainable, updated, metrics_vars,
                local_metrics, offset):
        """`(non_trainable, metrics_vars)` made replicated again after the local step."""
        local_non_trainable = [offset_seed(v, -offset) if s else v
                               for v, s in zip(local_non_trainable, self.seeds)]
        # A variable the step never writes (a frozen layer's weights) is
        # handed back as it came in: averaging equal values over the devices
        # could move it by a rounding error every step.
        non_trainable = [combine(self.axis, self.shards, before, after, agg) if changed
                         else before
                         for before, after, agg, changed in zip(
                             non_trainable, local_non_trainable, self.non_trainable_agg,
                             updated)]
        metrics_vars = [combine(self.axis, self.shards, before, after, agg)
                        for before, after, agg in zip(metrics_vars, local_metrics,
                                                      self.metrics_agg)]
        return non_trainable, metrics_vars
