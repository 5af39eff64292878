"""Models, data and a reference fit shared by the sharded-state JAX tests."""

from __future__ import annotations

import keras
import numpy as np


def small_model(seed=0):
    """16 -> 64 -> 32 -> 10: every kernel splits over 8 devices; the head's bias
    (10,) does not."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="dense_in"),
        keras.layers.Dense(32, activation="relu", name="dense_mid"),
        keras.layers.Dense(10, name="dense_out"),
    ])


def issue_mlp(seed=0):
    """The issue's MLP: 512 inputs, 4 x Dense(1024), a 16-way head."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((512,))]
        + [keras.layers.Dense(1024, activation="relu") for _ in range(4)]
        + [keras.layers.Dense(16)])


def compile_adam(model, learning_rate=1e-2, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


def data(n=160, inputs=16, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, inputs)).astype("float32"),
            rng.integers(0, classes, n).astype("int32"))


def fit(distribution, *, init=None, callbacks=(), epochs=1, model_fn=small_model,
        **compile_kwargs):
    """Builds, compiles and fits in `distribution`'s scope: 160 examples at global
    batch 32 (5 updates an epoch), in order."""
    x, y = data()
    with distribution.scope():
        model = model_fn()
        if init is not None:
            model.set_weights(init)
        compile_adam(model, **compile_kwargs)
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=list(callbacks))
    return model


def max_diff(model_a, model_b) -> float:
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(model_a.get_weights(), model_b.get_weights()))


def state_bytes(compiled) -> int:
    """Per-device bytes of the step's arguments less the batch: the model state."""
    return compiled.argument_bytes - compiled.data_bytes
