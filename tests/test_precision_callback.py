"""MixedBFloat16: bfloat16 compute, float32 variables, for the fit it is attached to
(precision.callback). One body per behaviour on both backends (conftest's
BOTH_BACKENDS): "mirrored" is MirroredStrategy on TensorFlow, DataParallel over 8
devices on JAX."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from conftest import default_strategy
from helpers import RaiseAtEpoch
from precision_models import (
    BATCH,
    TRAIN,
    DtypeProbe,
    Subclassed,
    compiled,
    digits_mlp,
    forward_float64,
)

from keras_tpu_mem.accumulation import GradientAccumulation
from keras_tpu_mem.precision import MixedBFloat16, to_mixed_bfloat16


# ---------------------------------------------------------------- helpers
class PolicyProbe(keras.callbacks.Callback):
    """Records every layer's compute dtype and every variable's dtype during fit."""

    def on_train_batch_end(self, batch, logs=None):
        self.compute = {layer.name: layer.compute_dtype for layer in self.model.layers}
        self.variables = {v.dtype for v in self.model.variables}
        self.optimizer_variables = {v.dtype for v in self.model.optimizer.variables}


def strategy_for(name):
    if name == "mirrored":
        from conftest import MIRRORED  # one MirroredStrategy per process

        return MIRRORED
    return default_strategy()


class ClearProbes(keras.callbacks.Callback):
    """Forgets what the probes saw before training (model construction, fit's
    symbolic build): from here on they see the traced train step."""

    def on_train_begin(self, logs=None):
        for layer in self.model.layers:
            if isinstance(layer, DtypeProbe):
                layer.seen.clear()


# Four epochs at a learning rate of 0.01 reach what eight at 0.003 did (float32 about
# 0.97 on the held-out fifth, bfloat16 within 0.01 of it) in half the steps.
EPOCHS, LR = 4, 1e-2


def train_digits(digits, config, bf16, epochs=EPOCHS, probes=False, extra=()):
    """One digits fit under a matrix configuration; returns (model, final val accuracy)."""
    (x, y), (xv, yv) = digits
    strategy = strategy_for(config["strategy"])
    with strategy.scope():
        model = compiled(digits_mlp(probes), jit=config.get("jit", False),
                         spe=config.get("spe", 1), lr=LR)
    callbacks = [ClearProbes(), *extra]
    if config.get("accumulate"):
        callbacks.append(GradientAccumulation(steps=config["accumulate"]))
    if bf16:
        callbacks.append(MixedBFloat16())
    history = model.fit(x[:TRAIN], y[:TRAIN], batch_size=BATCH, epochs=epochs, verbose=0,
                        validation_data=(xv, yv), validation_freq=epochs,
                        callbacks=callbacks)
    return model, history.history["val_accuracy"][-1]


def sparse_ce_float64(logits, labels):
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(labels)), labels].mean())


# ------------------------------------------------------ the accuracy floor
MATRIX = {
    "default": {"strategy": "default"},
    "jit": {"strategy": "default", "jit": True},
    "mirrored": {"strategy": "mirrored"},
    "spe4-default": {"strategy": "default", "spe": 4},
    "spe4-mirrored": {"strategy": "mirrored", "spe": 4},
    "accumulate2-default": {"strategy": "default", "accumulate": 2},
    "accumulate2-mirrored": {"strategy": "mirrored", "accumulate": 2},
}
# Each cell is two digits fits; these repeat what the others cover (steps_per_execution
# and accumulation under two replicas include the one-replica case's code), so they run
# once per backend in CI, on the README's line (`slow`).
SLOW_CELLS = ("spe4-default", "accumulate2-default")


_FLOAT32_ACCURACY: dict = {}


def float32_accuracy_for(digits, config):
    """The float32 run each bfloat16 run is compared with, once per strategy/jit.

    steps_per_execution and GradientAccumulation do not change float32 training
    (both are exact; their own tests say so), so they share the reference.
    """
    key = (config["strategy"], config.get("jit", False))
    if key not in _FLOAT32_ACCURACY:
        plain = {"strategy": config["strategy"], "jit": config.get("jit", False)}
        _FLOAT32_ACCURACY[key] = train_digits(digits, plain, bf16=False)[1]
    return _FLOAT32_ACCURACY[key]


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CELLS else name
    for name in MATRIX])
def test_floor_digits_accuracy_and_dtypes(name, digits):
    config = MATRIX[name]
    float32_accuracy = float32_accuracy_for(digits, config)
    probe = PolicyProbe()
    model, bf16_accuracy = train_digits(digits, config, bf16=True, probes=True, extra=[probe])

    print(f"{name}: float32 {float32_accuracy:.4f}, bfloat16 {bf16_accuracy:.4f}")
    assert float32_accuracy > 0.9
    assert abs(bf16_accuracy - float32_accuracy) <= 0.02, (float32_accuracy, bf16_accuracy)
    # (The step count is int64, int32 on JAX without x64.)
    # During fit: hidden Dense layers computed in bfloat16 (what the traced step
    # really received), the output layer in float32, every variable float32.
    assert probe.compute["hidden_1"] == probe.compute["hidden_2"] == "bfloat16"
    assert probe.compute["logits"] == "float32"
    probes = [layer for layer in model.layers if isinstance(layer, DtypeProbe)]
    assert all(p.seen and set(p.seen) == {"bfloat16"} for p in probes), [p.seen for p in probes]
    assert probe.variables == {"float32"}
    assert probe.optimizer_variables <= {"float32", "int64", "int32"}
    # After fit: the model as built, float32 output, float32 variables.
    assert {layer.compute_dtype for layer in model.layers} == {"float32"}
    assert {v.dtype for v in model.variables} == {"float32"}
    (_, _), (xv, _) = digits
    assert model.predict(xv[:8], verbose=0).dtype == np.float32


def test_resume_after_interruption(digits, tmp_path):
    (x, y), (xv, yv) = digits

    def run(backup, interrupt=None, seed=0):
        model = compiled(digits_mlp(seed=seed), spe=2, lr=LR)
        callbacks = [MixedBFloat16(), keras.callbacks.BackupAndRestore(str(backup))]
        if interrupt is not None:
            callbacks.append(RaiseAtEpoch(interrupt))
        model.fit(x[:TRAIN], y[:TRAIN], batch_size=BATCH, epochs=EPOCHS, verbose=0,
                  shuffle=False, callbacks=callbacks)
        return model

    reference = run(tmp_path / "a")
    with pytest.raises(RuntimeError, match="interrupted at epoch 2"):
        run(tmp_path / "b", interrupt=2)
    resumed = run(tmp_path / "b", seed=5)  # a new process: other initial weights
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * 11
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    float32_model = compiled(digits_mlp(), spe=2, lr=LR)
    float32_model.fit(x[:TRAIN], y[:TRAIN], batch_size=BATCH, epochs=EPOCHS, verbose=0,
                      shuffle=False)
    accuracy = resumed.evaluate(xv, yv, verbose=0)[1]
    assert abs(accuracy - float32_model.evaluate(xv, yv, verbose=0)[1]) <= 0.02


def test_interrupted_fit_is_undone_by_the_next_fit(digits):
    (x, y), _ = digits
    model = compiled(digits_mlp())
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(x[:BATCH], y[:BATCH], epochs=2, verbose=0,
                  callbacks=[MixedBFloat16(), RaiseAtEpoch(1)])
    # No on_train_end after an exception: still bfloat16 (documented) ...
    assert model.get_layer("hidden_1").compute_dtype == "bfloat16"
    # ... until the next fit, with or without the callback.
    model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0)
    assert {layer.compute_dtype for layer in model.layers} == {"float32"}
    assert "call" not in model.get_layer("logits").__dict__


def test_same_callback_reused_after_interruption_restores_the_originals(digits):
    (x, y), _ = digits
    model = compiled(digits_mlp())
    model.get_layer("hidden_2").dtype_policy = "float32"
    callback = MixedBFloat16()
    with pytest.raises(RuntimeError):
        model.fit(x[:BATCH], y[:BATCH], epochs=2, verbose=0,
                  callbacks=[callback, RaiseAtEpoch(1)])
    model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0, callbacks=[callback])
    assert {layer.dtype_policy.name for layer in model.layers} == {"float32"}


@pytest.mark.parametrize("strategy_name", ["default", "mirrored"])
def test_order_of_callbacks_does_not_matter(strategy_name, digits):
    (x, y), _ = digits
    results = []
    for order in (0, 1):
        with strategy_for(strategy_name).scope():
            model = compiled(digits_mlp())
        callbacks = [GradientAccumulation(steps=4), MixedBFloat16()]
        model.fit(x[:4 * BATCH], y[:4 * BATCH], batch_size=BATCH, epochs=2, verbose=0,
                  shuffle=False, callbacks=callbacks[::-1] if order else callbacks)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------- policies, restore, traces
def test_install_keeps_weights_bit_for_bit_and_restore_undoes_everything():
    model = digits_mlp()
    before = [w.copy() for w in model.get_weights()]
    policies = [layer.dtype_policy for layer in model.layers]
    callback = MixedBFloat16()
    callback.install(model)
    assert [layer.compute_dtype for layer in model.layers] == ["bfloat16", "bfloat16", "float32"]
    assert {v.dtype for v in model.variables} == {"float32"}
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)
    assert "call" in model.get_layer("logits").__dict__
    callback.restore(model)
    assert [layer.dtype_policy for layer in model.layers] == policies
    assert "call" not in model.get_layer("logits").__dict__
    assert model.get_layer("logits")._convert_input_args is True
    callback.restore(model)  # idempotent


def test_predict_and_evaluate_are_retraced_in_float32_after_fit(digits):
    """Keras caches predict/test traces; traced in bfloat16 during fit, they must go."""
    (x, y), (xv, yv) = digits

    class PredictDuringFit(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.during = self.model.predict(xv[:64], verbose=0)

    model = compiled(digits_mlp())
    model.evaluate(xv, yv, verbose=0)  # a float32 trace before fit
    during = PredictDuringFit()
    model.fit(x[:TRAIN], y[:TRAIN], batch_size=BATCH, epochs=2, verbose=0,
              validation_data=(xv, yv), callbacks=[MixedBFloat16(), during])
    reference = forward_float64(model, xv[:64])
    scale = np.abs(reference).max()
    # During fit the prediction was bfloat16 compute (well above float32 error) ...
    assert np.abs(during.during - reference).max() / scale > 1e-3
    # ... after fit it is float32 compute again, not a stale bfloat16 trace.
    after = model.predict(xv[:64], verbose=0)
    assert after.dtype == np.float32
    assert np.abs(after - reference).max() / scale < 1e-5
    loss = model.evaluate(xv, yv, verbose=0)[0]
    assert loss == pytest.approx(sparse_ce_float64(forward_float64(model, xv), yv), rel=1e-5)


def test_batch_normalization_keeps_float32_statistics(digits):
    (x, y), _ = digits
    keras.utils.set_random_seed(0)
    model = compiled(keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(32, name="d"),
        keras.layers.BatchNormalization(name="bn"), keras.layers.ReLU(),
        keras.layers.Dense(10, name="logits")]))
    bn = model.get_layer("bn")
    probe = PolicyProbe()
    model.fit(x[:512], y[:512], batch_size=BATCH, epochs=1, verbose=0,
              callbacks=[MixedBFloat16(), probe])
    assert probe.compute["bn"] == "bfloat16"
    assert bn.moving_mean.dtype == bn.moving_variance.dtype == "float32"
    mean = bn.moving_mean.numpy()
    assert np.all(np.isfinite(mean)) and np.any(mean != 0)
    # One more batch of statistics in float64 from the bfloat16 Dense output:
    # the moving mean moves as Keras' float32 update says.
    dense = model.get_layer("d")
    kernel, bias = dense.get_weights()
    ops = keras.ops
    h = ops.convert_to_numpy(ops.cast(
        ops.cast(x[:BATCH], "bfloat16") @ ops.cast(kernel, "bfloat16")
        + ops.cast(bias, "bfloat16"), "float32")).astype("float64")
    expected = mean * bn.momentum + h.mean(axis=0) * (1 - bn.momentum)
    callback = MixedBFloat16()
    callback.install(model)
    try:
        bn(model.get_layer("d")(x[:BATCH]), training=True)
    finally:
        callback.restore(model)
    np.testing.assert_allclose(bn.moving_mean.numpy(), expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------- selection
def test_keep_float32_by_name_and_by_type(digits):
    (x, y), _ = digits
    keras.utils.set_random_seed(0)
    model = compiled(keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(32, name="a"),
        keras.layers.LayerNormalization(name="norm"), keras.layers.Dense(32, name="b"),
        keras.layers.Dense(32, name="c"), keras.layers.Dense(10, name="logits")]))
    probe = PolicyProbe()
    model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0, callbacks=[
        MixedBFloat16(keep_float32=["b", keras.layers.LayerNormalization]), probe])
    assert probe.compute == {"a": "bfloat16", "norm": "float32", "b": "float32",
                             "c": "bfloat16", "logits": "float32"}


def test_softmax_head_keeps_the_logits_layer_float32_too():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="h"),
                              keras.layers.Dense(4, name="logits"),
                              keras.layers.Activation("softmax", name="probs")])
    callback = MixedBFloat16()
    callback.install(model)
    try:
        assert [lay.compute_dtype for lay in model.layers] == ["bfloat16", "float32", "float32"]
        out = model(np.ones((2, 8), "float32"))
        assert out.dtype == "float32"
    finally:
        callback.restore(model)


def test_functional_outputs_through_ops_and_nested_models():
    inputs = keras.Input((8,))
    body = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="inner_hidden"),
                             keras.layers.Dense(8, name="inner_out")], name="body")
    h = keras.layers.Dense(8, name="trunk")(inputs)
    a = keras.layers.Dense(3, name="head_a")(h)
    b = keras.ops.softmax(body(h))  # an op, not a layer, after a nested model
    model = keras.Model(inputs, [a, b])
    callback = MixedBFloat16()
    callback.install(model)
    try:
        dtypes = {lay.name: lay.compute_dtype for lay in model._flatten_layers()
                  if not isinstance(lay, keras.layers.InputLayer)}
        assert dtypes["trunk"] == dtypes["inner_hidden"] == "bfloat16"
        assert dtypes["head_a"] == dtypes["inner_out"] == "float32"
        outs = model(np.ones((2, 8), "float32"))
        assert [o.dtype for o in outs] == ["float32", "float32"]
    finally:
        callback.restore(model)


def test_subclassed_model_needs_its_output_layer_named(digits):
    (x, y), _ = digits
    model = compiled(Subclassed())
    model(x[:2])
    with pytest.raises(ValueError, match="keep_float32"):
        model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0, callbacks=[MixedBFloat16()])
    probe = PolicyProbe()
    model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0,
              callbacks=[MixedBFloat16(keep_float32="head"), probe])
    assert probe.compute == {"hidden": "bfloat16", "head": "float32"}
    assert model.predict(x[:4], verbose=0).dtype == np.float32


def test_mixed_float16_layers_switch_and_float64_layers_stay():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(8, dtype="mixed_float16", name="f16"),
                              keras.layers.Dense(8, dtype="float64", name="f64"),
                              keras.layers.Dense(4, name="logits")])
    callback = MixedBFloat16()
    callback.install(model)
    try:
        assert model.get_layer("f16").dtype_policy.name == "mixed_bfloat16"
        assert model.get_layer("f64").dtype_policy.name == "float64"
        assert [lay.name for lay, _ in callback.plan.unchanged] == ["f64"]
    finally:
        callback.restore(model)
    assert model.get_layer("f16").dtype_policy.name == "mixed_float16"


# ------------------------------------------------------- float16 refusal
@pytest.mark.tensorflow_only("MirroredStrategy's per-replica gradients: Keras' "
                             "LossScaleOptimizer checks replica 0's only; JAX's step "
                             "checks the global gradients")
def test_float16_policy_under_two_replicas_is_refused(digits):
    (x, y), _ = digits
    with strategy_for("mirrored").scope():
        keras.config.set_dtype_policy("mixed_float16")
        model = compiled(digits_mlp())
        keras.config.set_dtype_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    with pytest.raises(ValueError, match="float16.*replicas"):
        model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0,
                  callbacks=[GradientAccumulation(steps=2)])


@pytest.mark.tensorflow_only("MirroredStrategy's per-replica gradients: Keras' "
                             "LossScaleOptimizer checks replica 0's only; JAX's step "
                             "checks the global gradients")
def test_loss_scale_optimizer_with_our_callback_under_two_replicas_is_refused(digits):
    (x, y), _ = digits
    with strategy_for("mirrored").scope():
        model = digits_mlp()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0, callbacks=[MixedBFloat16()])


# --------------------------------------------------------- bad arguments
@pytest.mark.parametrize("keep", [3, [3.0], [keras.Model.fit], [keras.optimizers.Adam]])
def test_keep_float32_bad_types(keep):
    with pytest.raises(TypeError, match="keep_float32"):
        MixedBFloat16(keep_float32=keep)


def test_exact_output_gradients_must_be_bool():
    with pytest.raises(TypeError, match="exact_output_gradients"):
        MixedBFloat16(exact_output_gradients="yes")


def test_unknown_layer_name_is_an_error_naming_the_layers(digits):
    (x, y), _ = digits
    model = compiled(digits_mlp())
    with pytest.raises(ValueError, match="not layers of model.*hidden_1"):
        model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0,
                  callbacks=[MixedBFloat16(keep_float32=["hiden_1"])])
    with pytest.raises(ValueError, match="not layers"):
        to_mixed_bfloat16(model, keep_float32="nope")


def test_get_config_round_trip():
    callback = MixedBFloat16(keep_float32=["head", keras.layers.LayerNormalization],
                             exact_output_gradients=True)
    clone = MixedBFloat16.from_config(callback.get_config())
    assert clone.keep_float32 == ["head", keras.layers.LayerNormalization]
    assert clone.exact_output_gradients is True
    assert MixedBFloat16.from_config(MixedBFloat16().get_config()).keep_float32 == []


def test_keep_after_fit_leaves_a_bf16_model_with_float32_output(digits):
    """The issue's literal floor: *after* fit, hidden Dense layers compute in bfloat16."""
    (x, y), (xv, yv) = digits
    reference = compiled(digits_mlp(), lr=LR)
    reference.fit(x[:TRAIN], y[:TRAIN], batch_size=BATCH, epochs=EPOCHS, verbose=0,
                  shuffle=False)
    model = compiled(digits_mlp(), lr=LR)
    callback = MixedBFloat16(keep_after_fit=True)
    model.fit(x[:TRAIN], y[:TRAIN], batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
              callbacks=[callback])
    assert model.get_layer("hidden_1").compute_dtype == "bfloat16"
    assert model.get_layer("hidden_2").compute_dtype == "bfloat16"
    assert model.get_layer("logits").compute_dtype == "float32"
    assert "call" not in model.get_layer("logits").__dict__  # plain float32 call again
    assert {v.dtype for v in model.variables} == {"float32"}
    assert model.predict(xv[:8], verbose=0).dtype == np.float32
    accuracy = model.evaluate(xv, yv, verbose=0)[1]
    assert abs(accuracy - reference.evaluate(xv, yv, verbose=0)[1]) <= 0.02
    callback.restore(model)
    assert {layer.compute_dtype for layer in model.layers} == {"float32"}
    with pytest.raises(TypeError, match="keep_after_fit"):
        MixedBFloat16(keep_after_fit="yes")
