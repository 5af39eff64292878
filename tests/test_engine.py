"""The engine: installation, composition in any order, lifetime, multi-step loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import batched, max_abs_diff, mlp, sparse_ce, toy_data

from keras_tpu_mem import GradientAccumulation
from keras_tpu_mem.engine import (
    Engine,
    EngineCallback,
    register_error_explainer,
    scale_for_replicas,
    update_variable,
)


class HalfLoss(EngineCallback):
    """A loss-term feature: total = 0.5 * loss + 0.1 * mean(y_pred**2), replica-scaled."""

    name = "test_loss_term"
    order = 50

    def transform_loss(self, loss, ctx):
        extra = tf.reduce_mean(tf.square(tf.cast(ctx.y_pred, "float32")))
        return 0.5 * loss + scale_for_replicas(0.1 * extra)


class ClipWeights(EngineCallback):
    """An after-update feature: clip the first kernel to [-0.05, 0.05] after each update."""

    name = "test_after_update"
    order = 90

    def after_update(self, ctx):
        update_variable(ctx.model.layers[0].kernel,
                        lambda v: v.assign(tf.clip_by_value(v, -0.05, 0.05)))


def _fit(strategy, callbacks, spe=1, jit=False, epochs=1, data=None):
    x, y = data if data is not None else toy_data(128)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=sparse_ce(),
                      metrics=["accuracy"], steps_per_execution=spe, jit_compile=jit)
    history = model.fit(batched(x, y, 32), epochs=epochs, verbose=0, callbacks=callbacks)
    return model, history


def _reference_half_loss_clip():
    """The same training written out by hand as a plain TF loop (independent reference)."""
    x, y = toy_data(128)
    model = mlp()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    loss_fn = sparse_ce()
    for start in range(0, 128, 32):
        xb, yb = x[start:start + 32], y[start:start + 32]
        with tf.GradientTape() as tape:
            pred = model(xb, training=True)
            loss = 0.5 * loss_fn(yb, pred) + 0.1 * tf.reduce_mean(tf.square(pred))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        kernel = model.layers[0].kernel
        kernel.assign(tf.clip_by_value(kernel, -0.05, 0.05))
    return model


def test_features_compose_in_any_order(strategy_case):
    reference = _reference_half_loss_clip()
    orders = [[HalfLoss(), ClipWeights(), GradientAccumulation(2)],
              [GradientAccumulation(2), ClipWeights(), HalfLoss()]]
    for callbacks in orders:
        model, _ = _fit(strategy_case.strategy, callbacks, jit=strategy_case.jit_compile)
        assert max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-6
        assert np.max(np.abs(model.layers[0].kernel.numpy())) <= 0.05 + 1e-7


def test_features_compose_with_steps_per_execution_under_mirrored(mirrored):
    reference = _reference_half_loss_clip()
    model, _ = _fit(mirrored.strategy, [ClipWeights(), GradientAccumulation(2), HalfLoss()],
                    spe=3)  # 4 steps per epoch: executions of 3 and 1
    assert max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-6


def test_installing_twice_gives_one_step():
    reference, _ = _fit(tf.distribute.get_strategy(), [GradientAccumulation(2)])
    # Two accumulation callbacks of the same kind: the later one replaces the earlier.
    model, _ = _fit(tf.distribute.get_strategy(),
                    [GradientAccumulation(8), GradientAccumulation(2)])
    assert max_abs_diff(model.get_weights(), reference.get_weights()) == 0.0
    assert Engine.attach(model).num_builds == 1


def test_same_callbacks_in_a_later_fit_reuse_the_traced_step():
    x, y = toy_data(128)
    model = mlp()
    model.compile(optimizer="sgd", loss=sparse_ce())
    callback = GradientAccumulation(2)
    model.fit(batched(x, y, 32), verbose=0, callbacks=[callback])
    first = model.train_function
    model.fit(batched(x, y, 32), verbose=0, callbacks=[callback])
    assert model.train_function is first and Engine.attach(model).num_builds == 1
    model.compile(optimizer="adam", loss=sparse_ce())  # a new compile: a new step
    model.fit(batched(x, y, 32), verbose=0, callbacks=[callback])
    assert model.train_function is not first and Engine.attach(model).num_builds == 2


def test_next_fit_without_features_gets_keras_step_back():
    x, y = toy_data(128)
    model = mlp()
    model.compile(optimizer="sgd", loss=sparse_ce())
    model.fit(batched(x, y, 32), verbose=0, callbacks=[GradientAccumulation(2)])
    ours = model.train_function
    assert "make_train_function" in model.__dict__
    model.fit(batched(x, y, 32), verbose=0)
    assert "make_train_function" not in model.__dict__
    assert model.train_function is not ours
    assert Engine.attach(model).features == []


def test_interrupted_fit_leaves_no_stale_feature():
    x, y = toy_data(128)
    model = mlp()
    model.compile(optimizer="sgd", loss=sparse_ce())

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(batched(x, y, 32), verbose=0, callbacks=[HalfLoss(), Boom()])
    assert [type(f) for f in Engine.attach(model).features] == [HalfLoss]
    model.fit(batched(x, y, 32), verbose=0, callbacks=[GradientAccumulation(2)])
    assert [type(f) for f in Engine.attach(model).features] == []  # released at train end
    assert Engine.attach(model).num_builds == 2


def test_callback_given_to_evaluate_does_not_join_the_next_fit():
    x, y = toy_data(128)
    model = mlp()
    model.compile(optimizer="sgd", loss=sparse_ce())
    model.evaluate(batched(x, y, 32), verbose=0, callbacks=[HalfLoss()])
    model.predict(x[:32], verbose=0, callbacks=[HalfLoss()])
    model.fit(batched(x, y, 32), verbose=0)
    assert "make_train_function" not in model.__dict__  # Keras' own step
    assert Engine.attach(model).features == []


def test_functional_and_subclassed_models():
    x, y = toy_data(128)
    inputs = keras.Input((16,))
    outputs = keras.layers.Dense(5)(keras.layers.Dense(8, activation="relu")(inputs))
    functional = keras.Model(inputs, outputs)

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(5)

        def call(self, x):
            return self.out(self.hidden(x))

    for model in (functional, Sub()):
        model.compile(optimizer="sgd", loss=sparse_ce())
        history = model.fit(batched(x, y, 32), verbose=0, callbacks=[GradientAccumulation(4)])
        assert np.isfinite(history.history["loss"][0])
        assert int(model.optimizer.iterations.numpy()) == 4


def test_model_with_own_train_step_is_refused_by_name():
    class CustomStep(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(5)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            return super().train_step(data)

    x, y = toy_data(64)
    model = CustomStep()
    model.compile(optimizer="sgd", loss=sparse_ce())
    with pytest.raises(TypeError, match="CustomStep overrides `train_step`"):
        model.fit(batched(x, y, 32), verbose=0, callbacks=[GradientAccumulation(2)])


def test_plain_keras_fails_where_the_engine_works(mirrored):
    """keras-team/keras#19246: Mirrored + steps_per_execution > 1 fails without the engine."""
    with pytest.raises(tf.errors.InvalidArgumentError):
        _fit(mirrored.strategy, [], spe=2)
    model, _ = _fit(mirrored.strategy, [HalfLoss()], spe=2)
    assert int(model.optimizer.iterations.numpy()) == 4


def test_unknown_length_data():
    x, y = toy_data(9 * 16)

    def unknown():  # `filter` loses the dataset's cardinality
        return batched(x, y, 16).filter(lambda *_: True)

    # One replica: Keras' own loop stops exactly at the data's end.
    model = mlp()
    model.compile(optimizer="adam", loss=sparse_ce(), steps_per_execution=4)
    model.fit(unknown(), epochs=2, verbose=0, callbacks=[GradientAccumulation(2)])
    assert int(model.optimizer.iterations.numpy()) == 18
    # Several replicas: a clear error says how to give the length.
    from conftest import MIRRORED as strategy
    with strategy.scope():
        model = mlp()
        model.compile(optimizer="adam", loss=sparse_ce(), steps_per_execution=4)
    with pytest.raises(ValueError, match="assert_cardinality"):
        model.fit(unknown(), epochs=1, verbose=0, callbacks=[GradientAccumulation(2)])


def test_float16_with_several_replicas_is_refused(mirrored):
    x, y = toy_data(64)
    with mirrored.strategy.scope():
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(5, dtype="mixed_float16")])
        model.compile(optimizer="sgd", loss=sparse_ce())
    with pytest.raises(ValueError, match="checks only replica 0's gradients"):
        model.fit(batched(x, y, 32), verbose=0, callbacks=[HalfLoss()])


def test_register_rejects_non_features():
    model = mlp()
    with pytest.raises(TypeError, match="Feature"):
        Engine.attach(model).register(object())
    with pytest.raises(TypeError, match="keras.Model"):
        Engine.attach(object())


class FailsInStep(EngineCallback):
    """A loss term whose trace raises: a step that fails before it ever runs."""

    name = "fails_in_step"

    def transform_loss(self, loss, ctx):
        raise RuntimeError("injected step failure")


def test_a_failed_step_ends_the_fit_and_takes_its_features_off():
    """Keras never calls on_train_end after a step's error: the engine takes the fit's
    features off itself, so the model plans and fits again right away."""
    from keras_tpu_mem import compiled_memory

    x, y = toy_data(64)

    def compiled():
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=sparse_ce())
        return model

    model = compiled()
    with pytest.raises(RuntimeError, match="injected step failure"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                  callbacks=[GradientAccumulation(4), FailsInStep()])
    assert Engine.attach(model).features == []
    # Before: "The model is inside a fit with keras_tpu_mem features".
    planned = compiled_memory(model, 32, callbacks=[GradientAccumulation(2)], hlo_text=False)
    assert planned.micro_batches == 2
    # The next fit is Keras' own step: the weights of a twin that never failed.
    twin = compiled()
    for m in (model, twin):
        m.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    assert max_abs_diff(model.get_weights(), twin.get_weights()) <= 1e-6
    assert int(model.optimizer.iterations.numpy()) == 4


def test_registered_error_explainers_are_asked_after_the_features():
    """`register_error_explainer`: asked with the failed fit's features (already taken
    off) and its first global batch, after the features' own `explain_error`."""
    from keras_tpu_mem.engine import core

    seen = []

    class Explained(RuntimeError):
        pass

    def explain(model, features, global_batch_size, error):
        seen.append(([f.name for f in features], global_batch_size, str(error)))
        return Explained("clearer") if "injected" in str(error) else None

    register_error_explainer(explain)
    register_error_explainer(explain)  # twice: asked once
    try:
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=sparse_ce())
        # (Keras' traceback filter re-raises `from None`: the cause is not kept.)
        with pytest.raises(Explained, match="clearer"):
            model.fit(*toy_data(64), batch_size=32, epochs=1, verbose=0,
                      callbacks=[FailsInStep()])
        assert seen == [(["fails_in_step"], 32, "injected step failure")]
        assert Engine.attach(model).features == []
    finally:
        core._ERROR_EXPLAINERS.remove(explain)
    with pytest.raises(TypeError, match="callable"):
        register_error_explainer("not a function")
