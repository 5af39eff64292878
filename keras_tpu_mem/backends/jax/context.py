"""The step's verbs on JAX: what `StepContext` does for a feature.

Contract: `keras_tpu_mem.backends.contracts.Context` (the same functions in
`backends/tensorflow/context.py`, whose docstrings say what each does). Here a
feature's state is carried in the jitted state, values in and values out:
the engine runs `after_update` inside a `keras.StatelessScope`, where `.value`
reads this step's post-update values and `assign` makes them part of the
step's new state.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
from keras import ops

from keras_tpu_mem._compat import jax as jax_compat


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


def state_variable(model, like, dtype, name: str):
    """Owned by a feature, not the model; the engine carries its value beside
    Keras' state, laid out exactly like `like` (under ModelParallel: the same
    shards)."""
    variable = keras.Variable(initializer="ones", shape=tuple(like.shape), dtype=dtype,
                              trainable=False, name=name)
    ones = np.ones(tuple(like.shape), dtype=keras.backend.standardize_dtype(dtype))
    if keras.distribution.distribution() is None:
        # Uncommitted, like Keras' own state without a distribution: a committed
        # state would commit every output of the step, and the next fit's step
        # (same shapes, now committed arguments) would compile a second time.
        value = jax.numpy.asarray(ones)
    else:
        value = jax.device_put(ones, like.value.sharding)
    jax_compat.set_variable_value(variable, value)
    return variable


def set_state(variable, like, fn) -> None:
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
    dtype = keras.backend.standardize_dtype(variable.dtype)
    if keras.backend.standardize_dtype(value.dtype) != dtype:
        value = value.astype(dtype)
    jax_compat.set_variable_value(variable, value)


def update_count(optimizer):
    return optimizer.iterations.value  # updates made, this one included


def assign(variable, value) -> None:
    variable.assign(value)


def assign_where(condition, variables, new_values) -> None:
    """Assigns outside the branches: values computed inside a cond must leave it
    as its outputs, not as assignments."""
    if not variables:
        return
    values = ops.cond(condition,
                      lambda: [ops.cast(value, variable.dtype)
                               for variable, value in zip(variables, new_values())],
                      lambda: [variable.value for variable in variables])
    for variable, value in zip(variables, values):
        variable.assign(value)


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
