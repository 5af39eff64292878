"""The planning issue's models, one definition for both backends' planning tests.

Imports only Keras (no TensorFlow), so `test_planning.py` (TensorFlow) and
`test_planning_jax.py` plan and compile the same models, and the two backends'
figures in docs/planning.md are of one model.
"""

from __future__ import annotations

import keras


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
