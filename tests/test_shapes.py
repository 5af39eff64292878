"""`keras_tpu_mem.shapes`: models built with shapes only, and given values later; one body
per behaviour on both backends (conftest's BOTH_BACKENDS).

JAX's distributions and layouts (`materialize` into each variable's layout):
tests/test_shapes_jax.py.
"""

from __future__ import annotations

import gc

import keras
import numpy as np
import psutil
import pytest
from conftest import BACKEND
from helpers import max_abs_diff

from keras_tpu_mem import shapes
from keras_tpu_mem._compat import keras as keras_compat

MiB = 2**20


def _mlp(seed=3, inputs=16, hidden=32, outputs=8, dropout=True):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((inputs,)), keras.layers.Dense(hidden, activation="relu")]
    if dropout:
        layers += [keras.layers.Dropout(0.2), keras.layers.BatchNormalization()]
    return keras.Sequential(layers + [keras.layers.Dense(outputs)])


def _compiled(seed=3, build_optimizer=False, **kwargs):
    model = _mlp(seed, **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    if build_optimizer:
        model.optimizer.build(model.trainable_variables)
    return model


def _all_variables(model):
    return shapes._state_variables(model)


def _data(n=64, inputs=16, outputs=8):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, inputs)).astype("float32"),
            rng.normal(size=(n, outputs)).astype("float32"))


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_every_variable_of_a_compiled_model_is_deferred():
    with shapes.shapes_only():
        model = _compiled(build_optimizer=True)
    variables = _all_variables(model)
    assert len(model.optimizer.variables) == 2 + 2 * len(model.trainable_variables)
    assert variables and not any(keras_compat.has_value(v) for v in variables)
    assert shapes.is_shapes_only(model)
    assert model.count_params() == 16 * 32 + 32 + 4 * 32 + 32 * 8 + 8


def test_optimizer_constants_become_initializers_keras_values_and_dtypes():
    normal = _compiled()
    with shapes.shapes_only():
        deferred = _compiled()
    shapes.materialize(deferred)
    for made, reference in ((deferred.optimizer.iterations, normal.optimizer.iterations),
                            (deferred.optimizer.learning_rate, normal.optimizer.learning_rate)):
        assert made.dtype == reference.dtype
        np.testing.assert_array_equal(made.numpy(), reference.numpy())


def test_functional_and_subclassed_models_build_deferred():
    class Scaled(keras.Model):
        def build(self, input_shape):
            self.dense = keras.layers.Dense(4)
            self.dense.build(input_shape)
            self.scale = self.add_weight(shape=(4,), initializer="ones", name="scale")

        def call(self, inputs):
            return self.dense(inputs) * self.scale

    with shapes.shapes_only():
        inputs = keras.Input((8,))
        functional = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(6)(inputs)))
        subclassed = Scaled()
        subclassed.build((None, 8))
    for model in (functional, subclassed):
        assert model.variables and shapes.is_shapes_only(model)
        assert not any(keras_compat.has_value(v) for v in model.variables)


def test_lora_layers_build_deferred():
    with shapes.shapes_only():
        model = _mlp(dropout=False)
        for layer in model.layers:
            layer.enable_lora(4)
        model.compile(optimizer="adam", loss="mse")
    paths = [v.path for v in model.trainable_variables]
    assert any("lora_kernel_a" in p for p in paths)
    assert not any(keras_compat.has_value(v) for v in model.variables)


def test_quantize_int8_gives_int8_shapes_without_values():
    with shapes.shapes_only():
        model = _mlp(dropout=False)
        # Keras' Layer.__delattr__ runs gc.collect() for every variable quantize replaces:
        # with the suite's earlier objects still tracked that took 20 s. Frozen, the
        # collections scan only what this test made (unfrozen after: nothing is lost).
        gc.freeze()
        try:
            model.quantize("int8")
        finally:
            gc.unfreeze()
    kernels = [v for v in model.variables if v.path.endswith("kernel")]
    assert kernels and all(v.dtype == "int8" for v in kernels)
    assert shapes.is_shapes_only(model)


def test_optimizer_built_after_the_scope_makes_deferred_slots():
    with shapes.shapes_only():
        model = _compiled()
    model.optimizer.build(model.trainable_variables)
    slots = model.optimizer.variables[2:]
    assert slots and not any(keras_compat.has_value(v) for v in slots)


@pytest.mark.parametrize("method", ["fit", "predict", "evaluate"])
def test_running_a_shapes_only_model_raises_naming_materialize_and_allocates_nothing(method):
    with shapes.shapes_only():
        model = _compiled(inputs=4096, hidden=8192, outputs=4096, dropout=False)  # 268 MB
    x, y = _data(8, 4096, 4096)
    run = {"fit": lambda: model.fit(x, y, verbose=0),
           "predict": lambda: model.predict(x, verbose=0),
           "evaluate": lambda: model.evaluate(x, y, verbose=0)}[method]
    before = _rss()
    refusal = (rf"^Sequential '{model.name}' was built in ktm\.shapes_only\(\).* no values "
               rf"to {method} with.*ktm\.materialize\(model\)")
    with pytest.raises(ValueError, match=refusal):
        run()
    assert _rss() - before < 128 * MiB
    assert not any(keras_compat.has_value(v) for v in model.trainable_variables)


def test_writing_a_deferred_variable_raises_naming_materialize():
    with shapes.shapes_only():
        model = _compiled()
    with pytest.raises(ValueError, match=r"no value to write.*ktm\.materialize\(model\)"):
        model.optimizer.iterations.assign(3)


def test_a_refused_fit_then_materialize_trains():
    with shapes.shapes_only():
        model = _compiled()
    x, y = _data()
    with pytest.raises(ValueError):
        model.fit(x, y, verbose=0)
    shapes.materialize(model)
    history = model.fit(x, y, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def test_materialize_gives_the_values_of_a_normal_build_with_the_same_seed():
    normal = _compiled(build_optimizer=True)
    with shapes.shapes_only():
        deferred = _compiled(build_optimizer=True)
    assert shapes.materialize(deferred) is deferred
    assert not shapes.is_shapes_only(deferred)
    for made, reference in zip(_all_variables(deferred), _all_variables(normal), strict=True):
        np.testing.assert_array_equal(made.numpy(), reference.numpy(), err_msg=made.path)


def test_a_materialized_model_trains_as_a_normal_build():
    normal = _compiled()
    with shapes.shapes_only():
        deferred = _compiled(build_optimizer=True)
    shapes.materialize(deferred)
    x, y = _data()
    for model in (normal, deferred):
        keras.utils.set_random_seed(11)  # the same dropout masks in both fits
        model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    assert max_abs_diff(normal.get_weights(), deferred.get_weights()) <= 1e-6
    assert int(deferred.optimizer.iterations.numpy()) == 8


def test_materialize_leaves_a_model_without_deferred_variables_unchanged():
    model = _compiled(build_optimizer=True)
    before = [v.value for v in _all_variables(model)]
    assert not shapes.is_shapes_only(model)
    assert shapes.materialize(model) is model
    assert all(v.value is value for v, value in zip(_all_variables(model), before))


@pytest.mark.parametrize("function", [shapes.materialize, shapes.is_shapes_only])
def test_model_functions_reject_what_is_not_a_model(function):
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        function("model.keras")


def test_materialize_inside_shapes_only_raises():
    with shapes.shapes_only():
        model = _compiled()
        with pytest.raises(ValueError, match="after the `with ktm.shapes_only"):
            shapes.materialize(model)


def test_deferring_defers_state_made_after_the_scope():
    with shapes.shapes_only():
        model = _compiled()
    with shapes.deferring():
        extra = keras.Variable(np.ones((3, 3), "float32"), name="extra")
        model.optimizer.build(model.trainable_variables)
    assert not keras_compat.has_value(extra)
    assert not any(keras_compat.has_value(v) for v in model.optimizer.variables)


def _trace(model, shape) -> tuple:
    """The output shape of `model` traced by the backend's compiler front end
    (`tf.function`'s concrete function; `jax.jit(...).lower`) on float32 inputs."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        traced = tf.function(model).get_concrete_function(tf.TensorSpec(shape, tf.float32))
        return tuple(traced.structured_outputs.shape)
    import jax

    return tuple(jax.jit(model).lower(jax.ShapeDtypeStruct(shape, "float32")).out_info.shape)


def test_reading_shapes_lets_the_backend_trace_the_model():
    with shapes.shapes_only():
        model = _mlp(dropout=False)
    with pytest.raises(ValueError, match=r"ktm\.materialize"):
        _trace(model, (2, 16))
    with shapes.reading_shapes():
        assert _trace(model, (2, 16)) == (2, 8)
    assert shapes.is_shapes_only(model)


def test_variables_stay_deferred_when_another_stateless_scope_exits():
    # Keras initialises every variable on its list when an outermost
    # StatelessScope(initialize_variables=True) exits: shapes_only takes its own off.
    with shapes.shapes_only():
        model = _compiled()
    with keras.StatelessScope():
        pass
    assert not any(keras_compat.has_value(v) for v in model.variables)


@pytest.mark.tensorflow_only("tf.distribute's mirrored values; JAX's layouts: "
                             "test_shapes_jax.py")
def test_mirrored_strategy_materializes_mirrored_variables(mirrored):
    import tensorflow as tf

    with mirrored.strategy.scope(), shapes.shapes_only():
        model = _compiled(build_optimizer=True)
    shapes.materialize(model)
    assert isinstance(model.layers[0].kernel.value, tf.distribute.DistributedValues)
    assert isinstance(model.optimizer.variables[-1].value, tf.distribute.DistributedValues)
    x, y = _data()
    assert np.isfinite(model.fit(x, y, verbose=0).history["loss"]).all()


def test_a_1_5b_parameter_mlp_builds_in_little_host_memory():
    # Warm-up: what the first Keras build costs on its own (and starting JAX's runtime).
    with shapes.shapes_only():
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
    assert model.count_params() > 1.47e9  # 5.9 GB of float32 weights, 18 GB with Adam's slots
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
