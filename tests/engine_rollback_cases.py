"""A `fit` whose set-up fails, written once and run on each backend
(test_engine_rollback*.py): the engine takes off what it installed (issue 29, defect 4)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.distillation import Distillation
from keras_tpu_mem.engine import EngineCallback
from keras_tpu_mem.precision import MixedBFloat16


def _model_and_data():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(5)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16)).astype("float32")
    y = rng.integers(0, 5, 64).astype("int32")
    return model, x, y


def _state(model):
    """What a failed set-up must leave as it was: policies, train function, loss."""
    return ([(layer.name, layer.dtype_policy.name)
             for layer in keras_compat.flatten_layers(model)],
            model.train_function, model.loss, keras_compat.compiled_loss_object(model))


def _check_rolled_back(model, before):
    policies, train_function, loss, compiled_loss = _state(model)
    assert policies == before[0]
    assert train_function is before[1]
    assert loss is before[2]
    assert compiled_loss is before[3]


class _MicroBatches(EngineCallback):
    """A second micro-batching feature: the engine's own check refuses two."""

    name = "second_micro_batching"

    def micro_batches(self, per_replica_batch):
        return 2


def check_a_later_features_check_failing_rolls_back_mixed_bfloat16():
    model, x, y = _model_and_data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # a train function of its own
    before = _state(model)
    # Distillation (installed after MixedBFloat16: order 50 > 10) refuses a teacher
    # that outputs probabilities.
    teacher = keras.Sequential([keras.Input((16,)), keras.layers.Dense(5, activation="softmax")])
    with pytest.raises(ValueError, match="Distillation needs logits"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                  callbacks=[MixedBFloat16(), Distillation(teacher)])
    _check_rolled_back(model, before)
    # The next fit trains in the model's own float32.
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert all(layer.compute_dtype == "float32" for layer in model.layers)


def check_the_engines_check_failing_rolls_back_every_feature():
    from keras_tpu_mem.accumulation import GradientAccumulation

    model, x, y = _model_and_data()
    before = _state(model)
    with pytest.raises(ValueError, match="Only one micro-batching feature"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                  callbacks=[MixedBFloat16(), GradientAccumulation(2), _MicroBatches()])
    _check_rolled_back(model, before)
