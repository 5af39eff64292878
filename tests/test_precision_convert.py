"""to_mixed_bfloat16 and enable_mixed_bfloat16 (precision.convert)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from precision_models import Subclassed, digits_mlp, forward_float64

from keras_tpu_mem.precision import enable_mixed_bfloat16, to_mixed_bfloat16


def test_to_mixed_bfloat16_same_weights_float32_output_and_saves(tmp_path):
    model = digits_mlp()
    converted = to_mixed_bfloat16(model)
    assert converted is not model
    assert [lay.compute_dtype for lay in model.layers] == ["float32"] * 3  # untouched
    assert [lay.compute_dtype for lay in converted.layers] == ["bfloat16", "bfloat16", "float32"]
    for got, want in zip(converted.get_weights(), model.get_weights(), strict=True):
        assert got.dtype == want.dtype == np.float32
        np.testing.assert_array_equal(got, want)
    x = np.random.default_rng(0).random((16, 64), dtype=np.float32)
    out = converted.predict(x, verbose=0)
    assert out.dtype == np.float32
    reference = forward_float64(model, x)
    error = np.abs(out - reference).max() / np.abs(reference).max()
    assert 1e-4 < error < 5e-2  # bfloat16 hidden layers: close, not float32-exact
    path = tmp_path / "bf16.keras"
    converted.save(path)
    loaded = keras.saving.load_model(path)
    assert [lay.dtype_policy.name for lay in loaded.layers] == [
        "mixed_bfloat16", "mixed_bfloat16", "float32"]
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), out)


def test_to_mixed_bfloat16_nested_functional_and_subclassed():
    inputs = keras.Input((8,))
    body = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="inner")],
                            name="body")
    outputs = keras.layers.Dense(3, name="head")(body(inputs))
    model = keras.Model(inputs, outputs)
    converted = to_mixed_bfloat16(model)
    assert converted.get_layer("body").get_layer("inner").compute_dtype == "bfloat16"
    assert converted.get_layer("head").compute_dtype == "float32"
    for got, want in zip(converted.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)

    sub = Subclassed()
    sub(np.ones((2, 64), "float32"))
    with pytest.raises(ValueError, match="keep_float32"):
        to_mixed_bfloat16(sub)  # its output layer cannot be found: bfloat16 output
    converted = to_mixed_bfloat16(sub, keep_float32="head")
    assert converted.hidden.compute_dtype == "bfloat16"
    assert converted.head.compute_dtype == "float32"
    for got, want in zip(converted.get_weights(), sub.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert converted(np.ones((2, 64), "float32")).dtype == "float32"


def test_to_mixed_bfloat16_needs_a_built_model():
    model = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="not built"):
        to_mixed_bfloat16(model)


def test_enable_mixed_bfloat16_returns_the_previous_policy():
    previous = enable_mixed_bfloat16()
    assert previous.name == "float32"
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert keras.layers.Dense(2).compute_dtype == "bfloat16"
