"""On TensorFlow every sharded-state entry point refuses with an error that names JAX."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_tpu_mem.backends.tensorflow import sharding as tf_sharding
from keras_tpu_mem.sharding import ShardedDataParallel, reshard, sharded_dim
from keras_tpu_mem.strategy import TPUStrategyWrapper

NAMES_JAX = r"needs the JAX backend \(KERAS_BACKEND=jax"


@pytest.mark.parametrize("shard", ["all", "optimizer", None])
def test_sharded_data_parallel_names_jax(shard):
    with pytest.raises(RuntimeError, match="ShardedDataParallel " + NAMES_JAX):
        ShardedDataParallel(shard=shard)


def test_reshard_names_jax():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
    # The refusal comes before the distribution is looked at; and with Keras 3.12 on
    # TensorFlow no keras.distribution can even be constructed (its distribution_lib
    # lacks `num_processes`), so any object stands in for one.
    with pytest.raises(RuntimeError, match="reshard " + NAMES_JAX):
        reshard(model, object())


@pytest.mark.parametrize("sharding", ["all", "optimizer"])
def test_strategy_wrapper_sharding_names_jax(sharding):
    with pytest.raises(RuntimeError, match=r"TPUStrategyWrapper\(sharding=.*" + NAMES_JAX):
        TPUStrategyWrapper(sharding=sharding)


def test_strategy_wrapper_checks_the_value_first():
    with pytest.raises(ValueError, match=r'`sharding` must be "all", "optimizer" or None'):
        TPUStrategyWrapper(sharding="zero3")


def test_reading_a_sharding_names_jax():
    variable = keras.Variable(np.zeros((8,), "float32"))
    with pytest.raises(RuntimeError, match=NAMES_JAX):
        sharded_dim(variable)
    for call in (lambda: tf_sharding.move(variable, None),
                 lambda: tf_sharding.device_bytes(variable)):
        with pytest.raises(RuntimeError, match=NAMES_JAX):
            call()


def test_without_sharding_the_wrapper_describes_whole_state():
    wrapper = TPUStrategyWrapper()
    assert wrapper.sharding is None
    assert "model state: whole on every replica" in wrapper.describe()
    with wrapper.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
    # 40 floats of weights, 80 of Adam slots, 2 scalars: all of it on the one replica.
    line = [ln for ln in wrapper.describe(model).splitlines() if "model state" in ln][0]
    assert "(1.00x; sharding=None)" in line
