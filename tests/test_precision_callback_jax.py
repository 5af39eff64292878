"""MixedBFloat16 on the JAX backend: what only JAX's step shows.

The behaviours both backends share (the digits accuracy floor under DataParallel(8), with
accumulation, keep_after_fit, resume) are test_precision_callback.py's, collected on JAX too."""

from __future__ import annotations

import keras
from helpers import RecordingDense, max_abs_diff

from keras_tpu_mem.precision import MixedBFloat16


def _digits_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((64,)),
        RecordingDense(128, activation="relu", name="dense_hidden"),
        keras.layers.Dense(128, activation="relu", name="dense_hidden_2"),
        keras.layers.Dense(10, name="dense_head"),
    ])


def test_output_layer_forward_is_exactly_float32(digits):
    # The head's float32 forward pass with a bfloat16 backward: its value is
    # that of a plain float32 head on the same (bfloat16) input.
    (x, _), _ = digits
    model = _digits_model()
    callback = MixedBFloat16()
    callback.install(model)
    try:
        hidden = keras.Sequential(model.layers[:-1])(x[:64])
        head = model.layers[-1]
        got = head(hidden)
        expected = hidden.astype("float32") @ head.kernel.value + head.bias.value
    finally:
        callback.uninstall(model)
    assert keras.backend.standardize_dtype(got.dtype) == "float32"
    assert max_abs_diff([got], [expected]) <= 1e-5
