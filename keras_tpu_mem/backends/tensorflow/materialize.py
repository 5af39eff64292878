"""Giving a shapes-only model its values on TensorFlow.

`keras_tpu_mem.shapes.materialize` calls `initialize(variable, initializer)` for
every variable that has no value, inside `scope(model)`: the
`tf.distribute.Strategy` the model was created under (if any), so that each
value becomes the `tf.Variable` (mirrored, or on the strategy's devices) a
normal build in that scope makes. Keras' own deferred initialisation makes it
(in `tf.init_scope()`, so it is not captured by a traced function).

Contract: `keras_tpu_mem.backends.contracts.Materialize`.
"""

from __future__ import annotations

import contextlib

from keras_tpu_mem._compat import keras as keras_compat


def scope(model):
    """The scope of the strategy `model` was created under, else none."""
    strategy = keras_compat.model_strategy(model)
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def place(initializer, shape: tuple, dtype: str, sharding):
    """TensorFlow variables have no layouts (`keras.distribution` runs on JAX)."""
    raise NotImplementedError(
        "Laying a value out as a sharding needs the Keras JAX backend; TensorFlow "
        "places variables through its tf.distribute strategy.")


def initialize(variable, initializer) -> None:
    """Gives `variable` (without a value) the value `initializer` makes, as Keras'
    own deferred initialisation does."""
    keras_compat.set_variable_initializer(variable, initializer)
    keras_compat.initialize_deferred(variable)


__all__ = ["initialize", "place", "scope"]
