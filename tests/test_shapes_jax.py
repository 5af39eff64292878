"""`keras_tpu_mem.shapes` under a `keras.distribution` on JAX (8 host devices):
`materialize` straight into each variable's layout. What both backends share (the
guard, the values, the host memory a build takes): tests/test_shapes.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import make_distribution, max_abs_diff, scope

from keras_tpu_mem import backends, shapes
from keras_tpu_mem._compat import keras as keras_compat


def _compiled(seed=3, build_optimizer=False, inputs=16, hidden=32, outputs=8):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(hidden, activation="relu", name="dense_in"),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(hidden, activation="relu", name="dense_mid"),
        keras.layers.Dense(outputs, name="dense_out"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    if build_optimizer:
        model.optimizer.build(model.trainable_variables)
    return model


def _data(n=64, inputs=16, outputs=8):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, inputs)).astype("float32"),
            rng.normal(size=(n, outputs)).astype("float32"))


def _layout_sharding(variable):
    layout = keras_compat.variable_layout(variable)
    return getattr(layout, "backend_layout", layout)


@pytest.fixture
def placements(monkeypatch):
    """Every value `materialize` makes in a layout: (path-less shape, asked sharding,
    the value as made)."""
    made = []
    concern = backends.current().materialize
    place = concern.place

    def recording_place(initializer, shape, dtype, sharding):
        value = place(initializer, shape, dtype, sharding)
        made.append((tuple(shape), sharding, value))
        return value

    monkeypatch.setattr(concern, "place", recording_place)
    return made


def test_variables_get_the_layouts_of_a_normal_build_in_a_distribution_scope():
    axes = []
    for shapes_only in (False, True):
        with make_distribution("fsdp8").scope():
            if shapes_only:
                with shapes.shapes_only():
                    model = _compiled(build_optimizer=True)
            else:
                model = _compiled(build_optimizer=True)
        axes.append([tuple(keras_compat.variable_layout(v).axes)
                     for v in shapes._state_variables(model)])
    assert axes[0] == axes[1]
    assert (None, "batch") in axes[1] and ("batch",) in axes[1]  # kernels, biases split
    assert not any(keras_compat.has_value(v) for v in shapes._state_variables(model))


def test_sharded_data_parallel_makes_each_value_in_its_layout(placements):
    distribution = make_distribution("fsdp8")
    with distribution.scope(), shapes.shapes_only():
        model = _compiled(build_optimizer=True)
    variables = shapes._state_variables(model)
    with distribution.scope():
        shapes.materialize(model)
    assert len(placements) == len(variables)  # every value made by a placement
    for shape, asked, value in placements:
        assert value.sharding == asked
        assert all(s.data.shape == asked.shard_shape(shape) for s in value.addressable_shards)
    for variable in variables:
        sharding = _layout_sharding(variable)
        assert variable.value.sharding.is_equivalent_to(sharding, len(variable.shape))
    kernel = model.get_layer("dense_in").kernel.value  # (16, 32): split on 32
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 4)}  # 1/8 each


@pytest.mark.parametrize("case", ["fsdp8", "mp2x4"])
def test_a_materialized_model_fits_as_a_normal_build_under_a_distribution(case):
    x, y = _data()
    weights = []
    for shapes_only in (False, True):
        distribution = make_distribution(case)
        with scope(distribution):
            if shapes_only:
                with shapes.shapes_only():
                    model = _compiled()
                shapes.materialize(model)
            else:
                model = _compiled()
            keras.utils.set_random_seed(11)
            model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    assert max_abs_diff(*weights) <= 1e-6


def test_materialize_under_a_distribution_lays_out_a_model_built_without_one(placements):
    with shapes.shapes_only():
        model = _compiled()
    distribution = make_distribution("fsdp8")
    with distribution.scope():
        shapes.materialize(model)
    kernel = model.get_layer("dense_in").kernel
    assert tuple(kernel.value.sharding.spec) == (None, "batch")
    assert placements
