"""Test-local sharded distributions for the engine's sharded step (JAX tests only).

`Sharded` is a `keras.distribution.ModelParallel` that splits each variable's
largest dimension divisible by the batch axis over that axis: weights and
optimizer slots (`mode="all"`), or the slots only (`mode="optimizer"`; Keras
creates slots with their weight's layout, so they are laid out again after
`optimizer.build`, by `lay_out_optimizer`). The engine reads the sharding from
the values, so the package's own distribution gets the same step.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
from keras.distribution import DeviceMesh, LayoutMap, ModelParallel, TensorLayout


def _split_spec(shape, size, axis="batch"):
    spec = [None] * len(shape)
    dims = [i for i, d in enumerate(shape) if d % size == 0 and d >= size]
    if dims:
        spec[max(dims, key=lambda i: shape[i])] = axis
    return spec


class Sharded(ModelParallel):
    """Splits every variable's largest dimension divisible by the axis size over "batch"."""

    def __init__(self, mode="all", devices=None):
        devices = jax.devices() if devices is None else devices
        self.size = len(devices)
        mesh = DeviceMesh((self.size,), ("batch",), devices)
        super().__init__(layout_map=LayoutMap(mesh), batch_dim_name="batch")
        self.mode = mode

    def get_variable_layout(self, variable):
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        spec = [None] * len(variable.shape)
        if self.mode == "all":
            spec = _split_spec(variable.shape, self.size)
        return TensorLayout(spec, self.device_mesh)


def lay_out_optimizer(model, distribution):
    """Builds the optimizer and splits its slots over the batch axis (ZeRO-1)."""
    model.optimizer.build(model.trainable_variables)
    for variable in model.optimizer.variables:
        layout = TensorLayout(_split_spec(variable.shape, distribution.size),
                              distribution.device_mesh)
        # Keras re-lays a variable out on every assign by its `_layout`.
        variable._layout = layout
        variable._value = jax.device_put(variable.value, layout.backend_layout)


def big_mlp():
    """The issue's MLP: 512 inputs, 4 x Dense(1024, relu), a 16-way head, Adam."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((512,))]
                             + [keras.layers.Dense(1024, activation="relu") for _ in range(4)]
                             + [keras.layers.Dense(16)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def small_mlp(seed=1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(8)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data(n=160, inputs=16, classes=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, inputs)).astype("float32"),
            rng.integers(0, classes, n).astype("int32"))


class ShardedOverLayoutMap(ModelParallel):
    """A (2, 4) mesh: kernels split over "model" by a `LayoutMap`, and each variable's
    largest dimension the map leaves free (divisible by 2) split over "batch"."""

    def __init__(self, devices=None):
        devices = jax.devices() if devices is None else devices
        mesh = DeviceMesh((2, len(devices) // 2), ("batch", "model"), devices)
        layout_map = LayoutMap(mesh)
        layout_map[".*kernel"] = (None, "model")
        super().__init__(layout_map=layout_map, batch_dim_name="batch")

    def get_variable_layout(self, variable):
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        layout = super().get_variable_layout(variable)
        axes = list(layout.axes) if layout is not None else [None] * len(variable.shape)
        free = [i for i, a in enumerate(axes) if a is None and variable.shape[i] % 2 == 0]
        if free:
            axes[max(free, key=lambda i: variable.shape[i])] = "batch"
        return TensorLayout(axes, self.device_mesh)
