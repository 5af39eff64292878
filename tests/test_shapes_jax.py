"""`keras_tpu_mem.shapes` on JAX (8 host devices): shapes-only models, their guard, and
`materialize` straight into each variable's layout under a `keras.distribution`.

TensorFlow: tests/test_shapes.py.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import psutil
import pytest
from helpers import make_distribution, max_abs_diff, scope

from keras_tpu_mem import backends, shapes
from keras_tpu_mem._compat import keras as keras_compat

MiB = 2**20


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


def _rss() -> int:
    return psutil.Process().memory_info().rss


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


def test_every_variable_of_a_compiled_model_is_deferred():
    with shapes.shapes_only():
        model = _compiled(build_optimizer=True)
    variables = shapes._state_variables(model)
    assert len(model.optimizer.variables) == 2 + 2 * len(model.trainable_variables)
    assert not any(keras_compat.has_value(v) for v in variables)
    assert shapes.is_shapes_only(model)


def test_optimizer_built_after_the_scope_makes_deferred_slots():
    with shapes.shapes_only():
        model = _compiled()
    model.optimizer.build(model.trainable_variables)
    slots = model.optimizer.variables[2:]
    assert len(slots) == 2 * len(model.trainable_variables)
    assert not any(keras_compat.has_value(v) for v in slots)


@pytest.mark.parametrize("method", ["fit", "predict", "evaluate"])
def test_running_a_shapes_only_model_raises_naming_materialize_and_allocates_nothing(method):
    with shapes.shapes_only():
        model = _compiled(inputs=4096, hidden=8192, outputs=4096)  # 537 MB of weights
    x, y = _data(8, 4096, 4096)
    run = {"fit": lambda: model.fit(x, y, verbose=0),
           "predict": lambda: model.predict(x, verbose=0),
           "evaluate": lambda: model.evaluate(x, y, verbose=0)}[method]
    before = _rss()
    with pytest.raises(ValueError, match=r"ktm\.materialize\(model\)"):
        run()
    assert _rss() - before < 128 * MiB
    assert not any(keras_compat.has_value(v) for v in model.trainable_variables)


def test_materialize_gives_the_values_of_a_normal_build_and_trains_the_same():
    normal = _compiled()
    with shapes.shapes_only():
        deferred = _compiled(build_optimizer=True)
    shapes.materialize(deferred)
    assert max_abs_diff(normal.get_weights(), deferred.get_weights()) == 0.0
    x, y = _data()
    for model in (normal, deferred):
        keras.utils.set_random_seed(11)  # the same dropout masks in both fits
        model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    assert max_abs_diff(normal.get_weights(), deferred.get_weights()) <= 1e-6


def test_reading_shapes_lets_jax_lower_the_model():
    with shapes.shapes_only():
        model = _compiled()
    spec = jax.ShapeDtypeStruct((4, 16), "float32")
    with pytest.raises(ValueError, match=r"ktm\.materialize"):
        jax.jit(model).lower(spec)
    with shapes.reading_shapes():
        lowered = jax.jit(model).lower(spec)
    assert lowered.out_info.shape == (4, 8)
    assert shapes.is_shapes_only(model)


def test_variables_stay_deferred_when_another_stateless_scope_exits():
    with shapes.shapes_only():
        model = _compiled()
    with keras.StatelessScope():
        pass
    assert not any(keras_compat.has_value(v) for v in model.variables)


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


def test_a_1_5b_parameter_mlp_builds_in_little_host_memory():
    with shapes.shapes_only():  # warm-up: starting JAX's runtime is not the model's cost
        _compiled()
    width, depth = 8192, 22
    before = _rss()
    with shapes.shapes_only():
        model = keras.Sequential([keras.Input((width,))]
                                 + [keras.layers.Dense(width) for _ in range(depth)]
                                 + [keras.layers.Dense(16)])
        model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
        model.optimizer.build(model.trainable_variables)
    grown = _rss() - before
    assert model.count_params() > 1.47e9
    assert grown < 300 * MiB, f"RSS grew {grown / MiB:.0f} MiB"


def test_metric_objects_given_to_compile_are_materialized():
    """A metric object passed to `compile` inside `shapes_only()` (keras-hub's tasks do
    it) made its variables there, before any fit lists them: `materialize` makes them too,
    and the first fit trains."""
    with shapes.shapes_only():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()])
    assert shapes.is_shapes_only(model)
    shapes.materialize(model)
    assert not shapes.is_shapes_only(model)
    history = model.fit(np.zeros((16, 8)), np.zeros((16,)), verbose=0)
    assert "sparse_categorical_accuracy" in history.history
