"""The digits MLP and small models the precision tests share."""

from __future__ import annotations

import keras
import numpy as np

BATCH = 128
TRAIN = 11 * BATCH  # digits has 1437 training examples: 11 full batches


class DtypeProbe(keras.layers.Layer):
    """Identity that records the dtype it receives (at trace time); never casts."""

    def __init__(self, **kwargs):
        super().__init__(autocast=False, **kwargs)
        self.seen = []

    def call(self, inputs):
        self.seen.append(keras.backend.standardize_dtype(inputs.dtype))
        return inputs


def digits_mlp(probes=False, seed=0):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((64,)), keras.layers.Dense(64, activation="relu", name="hidden_1")]
    if probes:
        layers.append(DtypeProbe(name="probe_1"))
    layers.append(keras.layers.Dense(64, activation="relu", name="hidden_2"))
    if probes:
        layers.append(DtypeProbe(name="probe_2"))
    layers.append(keras.layers.Dense(10, name="logits"))
    return keras.Sequential(layers, name="digits_mlp")


def compiled(model, jit=False, spe=1, lr=3e-3):
    model.compile(optimizer=keras.optimizers.Adam(lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=spe,
                  # JAX: always jitted (unjitted is op by op, run_eagerly's path).
                  jit_compile=jit or keras.backend.backend() == "jax")
    return model


def forward_float64(model, x):
    """The trained MLP's logits in numpy float64 (Dense layers only)."""
    h = x.astype("float64")
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    for layer in dense:
        kernel, bias = (np.asarray(w, "float64") for w in layer.get_weights())
        h = h @ kernel + bias
        if layer is not dense[-1]:
            h = np.maximum(h, 0.0)
    return h


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(32, activation="relu", name="hidden")
        self.head = keras.layers.Dense(10, name="head")

    def call(self, inputs):
        return self.head(self.hidden(inputs))
