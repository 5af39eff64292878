"""The planning issue's models, one definition for both backends' planning tests.

Imports only Keras and NumPy (no TensorFlow), so the TensorFlow planning tests
(`test_planning_*.py`) and the JAX ones (`test_planning_*_jax.py`) plan and
compile the same models, and the two backends' figures in docs/planning.md are
of one model.
"""

from __future__ import annotations

import keras
import numpy as np


def _compiled(model):
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def wide_mlp(width=512, depth=8, inputs=512, classes=10):
    """The issue's 8 x Dense(512) MLP (named layers, for layout maps on JAX)."""
    keras.utils.set_random_seed(0)
    return _compiled(keras.Sequential(
        [keras.Input((inputs,))]
        + [keras.layers.Dense(width, activation="relu", name=f"dense_{i}") for i in range(depth)]
        + [keras.layers.Dense(classes, name="dense_out")]))


def encoder(seq=64, dim=128, heads=4, ffn=512, vocab=1000):
    """The issue's small transformer encoder (embedding 1000 x 128, 4 heads, FFN 512)."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim)(tokens)
    attn = keras.layers.MultiHeadAttention(heads, dim // heads)(x, x)
    x = keras.layers.LayerNormalization()(x + attn)
    ff = keras.layers.Dense(ffn, activation="gelu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(dim)(ff))
    out = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling1D()(x))
    return _compiled(keras.Model(tokens, out))


def digits_mlp(**compile_kwargs):
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **compile_kwargs)
    return model


def small_convnet():
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def small_transformer(seq=16, dim=32, heads=2, vocab=64):
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim)(tokens)
    attn = keras.layers.MultiHeadAttention(heads, dim // heads, dropout=0.1)(x, x)
    x = keras.layers.LayerNormalization()(x + attn)
    ff = keras.layers.Dense(2 * dim, activation="gelu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(dim)(ff))
    out = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(tokens, out)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def nbytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(str(v.dtype)).itemsize for v in variables)


def sequence_model(vocab=100, classes=5):
    """Unknown sequence length: Input((None,), int32) -> Embedding -> pooling -> Dense."""
    tokens = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Embedding(vocab, 16)(tokens)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(tokens, keras.layers.Dense(classes)(hidden))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
