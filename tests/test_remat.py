"""Rematerialize on TensorFlow: what works there (activations) and what is refused (layers).

References: a plain fit of a twin model (recomputation must not change the
numbers), and the step's own compile without the feature.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory
from keras_tpu_mem.remat import Rematerialize


def mlp():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="gelu"),
                              keras.layers.Dense(32, activation="gelu"),
                              keras.layers.Dense(4)])
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_layers_mode_is_refused_on_tensorflow_with_the_reason():
    model = mlp()
    x = np.zeros((8, 16), "float32")
    y = np.zeros((8,), "int32")
    with pytest.raises(ValueError, match="21207"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[Rematerialize()])


def test_activations_mode_trains_as_plain_fit_and_uninstalls():
    keras.utils.set_random_seed(1)
    model = mlp()
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    twin.compile(optimizer="sgd",
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = (np.arange(32) % 4).astype("int32")
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[Rematerialize(mode="activations")])
    twin.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(model.weights, twin.weights):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    assert all("activation" not in layer.__dict__ or not hasattr(
        layer.__dict__["activation"], "__wrapped__") for layer in model.layers)


def test_activations_mode_compiles_with_the_engine():
    model = mlp()
    result = compiled_memory(model, 64, callbacks=[Rematerialize(mode="activations")],
                             hlo_text=False)
    assert result.features == ("Rematerialize",)
    assert result.temp_bytes > 0


@pytest.mark.parametrize("kwargs, error", [
    ({"layers": "dense"}, TypeError), ({"mode": "full"}, ValueError)])
def test_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        Rematerialize(**kwargs)


def test_unknown_layer_is_named():
    model = mlp()
    with pytest.raises(ValueError, match="nope"):
        compiled_memory(model, 8, callbacks=[Rematerialize(["nope"], mode="activations")])


def test_exported_for_recommendations():
    rec = ktm.planning.Recommendation(2, 4, 0, rematerialize=True, compiled=True)
    assert [type(c).__name__ for c in rec.callbacks()] == ["GradientAccumulation",
                                                           "Rematerialize"]
