"""Pieces both JAX step builders use (`trainer.py`, `trainer_pulled.py`)."""

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


def multi_step_train_function(model, engine, step, default_count, on_error=None):
    """Keras' JAX train function `(state, iterator) -> (logs, state)` around `step`.

    Runs `engine.steps_for_this_call()` steps (`default_count` when that is
    unknown), stopping early where the data ends inside the call. A callback's
    `model` property syncs Keras' training state into the variables
    (`jax_state_sync`); if a feature reads it while the step is traced (every
    call with run_eagerly, or a retrace for a new shape), Keras would take the
    variables as current and reload the state from them next step, dropping
    this call's updates: the flag is put back as it was. On an error of the
    step, `on_error()` runs, the variables get back this call's input state
    (Keras' fit took the values out of them for its loop and puts them back
    only after a clean epoch), and the engine explains the error and ends the
    fit (`Engine.explain`).
    """
    from keras_tpu_mem._compat import jax as jax_compat

    def train_function(state, iterator):
        count = engine.steps_for_this_call() or default_count
        synced = jax_compat.state_synced(model)
        given = state
        try:
            data = next(iterator)
            # Keras >= 3.16 hands one call's steps over at once (a super batch). It
            # stacks steps_per_execution batches even for an epoch's last call; that
            # call runs only the steps left in the epoch (9 steps, N=4: 4, 4, 1).
            steps = jax_compat.super_batch_steps(model, data)
            if steps is not None:
                for data in steps[:count]:
                    logs, state = step(state, data)
                return logs, state
            logs, state = step(state, data)
            for _ in range(count - 1):
                try:
                    data = next(iterator)
                except StopIteration:  # the data ended inside this call
                    break
                logs, state = step(state, data)
        except StopIteration:
            raise
        except Exception as error:
            if on_error is not None:
                on_error()
            restore_variables(model, given)
            clearer = engine.explain(error)
            if clearer is not None:
                raise clearer from error
            raise
        finally:
            # Only when changed: Keras tracks every attribute a model is given.
            if jax_compat.state_synced(model) != synced:
                jax_compat.set_state_synced(model, synced)
        return logs, state

    return train_function


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
        from keras_tpu_mem._compat import jax as jax_compat
        from keras_tpu_mem._compat import keras as keras_compat

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
        from keras_tpu_mem._compat import jax as jax_compat

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
