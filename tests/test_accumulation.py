"""GradientAccumulation against a plain full-batch fit (the independent reference)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import RaiseAtEpoch, batched, max_abs_diff, mlp, sparse_ce, toy_data

from keras_tpu_mem import GradientAccumulation, TPUStrategyWrapper
from keras_tpu_mem.engine import Engine

GLOBAL_BATCH = 32
UPDATES = 5


def _optimizer(name):
    if name == "adam":
        schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=1,
                                                               decay_rate=0.5)
        return keras.optimizers.Adam(schedule)
    return keras.optimizers.SGD(0.1, momentum=0.9)


def _fit(strategy, optimizer, callbacks=(), jit=False, spe=1, sample_weight=None, epochs=1):
    x, y = toy_data(GLOBAL_BATCH * UPDATES)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=_optimizer(optimizer), loss=sparse_ce(), metrics=["accuracy"],
                      jit_compile=jit, steps_per_execution=spe)
    history = model.fit(batched(x, y, GLOBAL_BATCH, sample_weight), epochs=epochs, verbose=0,
                        callbacks=list(callbacks))
    return model, history


@pytest.fixture(scope="module")
def references():
    """Plain Keras fit on the full batch of 32, default strategy."""
    return {name: _fit(tf.distribute.get_strategy(), name) for name in ("adam", "sgd")}


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
@pytest.mark.parametrize("case, spe", [("default", 1), ("jit", 1), ("mirrored", 1),
                                       ("mirrored", 4), ("default", 4)])
def test_k4_equals_full_batch(references, optimizer, case, spe, request):
    from conftest import StrategyCase

    cell = StrategyCase(case)
    model, history = _fit(cell.strategy, optimizer, [GradientAccumulation(steps=4)],
                          jit=cell.jit_compile, spe=spe)
    ref_model, ref_history = references[optimizer]
    assert max_abs_diff(model.get_weights(), ref_model.get_weights()) <= 1e-6
    assert int(model.optimizer.iterations.numpy()) == UPDATES
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"], ref_history.history["accuracy"])
    if optimizer == "adam":
        # The schedule decays once per *update*: 0.01 * 0.5**5, not 0.5**20.
        lr = float(model.optimizer.learning_rate.numpy())
        assert lr == pytest.approx(0.01 * 0.5**UPDATES, rel=1e-6)


def test_micro_batch_size_equals_steps(references):
    model, _ = _fit(tf.distribute.get_strategy(), "sgd",
                    [GradientAccumulation(micro_batch_size=8)])
    assert max_abs_diff(model.get_weights(), references["sgd"][0].get_weights()) <= 1e-6


def test_sample_weight_weighted_as_full_batch(mirrored):
    weights = np.random.default_rng(3).uniform(0.0, 2.0, GLOBAL_BATCH * UPDATES).astype("float32")
    ref, ref_history = _fit(tf.distribute.get_strategy(), "sgd", sample_weight=weights)
    model, history = _fit(mirrored.strategy, "sgd", [GradientAccumulation(4)],
                          sample_weight=weights)
    assert max_abs_diff(model.get_weights(), ref.get_weights()) <= 1e-6
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    # And the weights matter: an unweighted run ends elsewhere.
    unweighted, _ = _fit(tf.distribute.get_strategy(), "sgd")
    assert max_abs_diff(unweighted.get_weights(), ref.get_weights()) > 1e-4


def test_remainder_execution_under_mirrored():
    """9 steps per epoch with steps_per_execution=4 run as 4 + 4 + 1 under Mirrored."""
    from conftest import MIRRORED as strategy
    x, y = toy_data(9 * 16)
    results = []
    for strat, spe, callbacks in ((tf.distribute.get_strategy(), 1, []),
                                  (strategy, 4, [GradientAccumulation(2)])):
        with strat.scope():
            model = mlp()
            model.compile(optimizer="adam", loss=sparse_ce(), steps_per_execution=spe)
        model.fit(batched(x, y, 16), epochs=2, verbose=0, callbacks=callbacks)
        results.append(model)
    assert int(results[1].optimizer.iterations.numpy()) == 18
    assert max_abs_diff(results[0].get_weights(), results[1].get_weights()) <= 1e-6


def test_resume_after_interruption_matches_uninterrupted(tmp_path):
    x, y = toy_data(GLOBAL_BATCH * UPDATES)

    def run(callbacks):
        model = mlp()
        model.compile(optimizer=_optimizer("adam"), loss=sparse_ce(), steps_per_execution=2)
        model.fit(batched(x, y, GLOBAL_BATCH), epochs=4, verbose=0, callbacks=callbacks)
        return model

    straight = run([GradientAccumulation(4)])
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted at epoch 2"):
        run([GradientAccumulation(4), keras.callbacks.BackupAndRestore(backup),
             RaiseAtEpoch(2)])
    resumed = run([keras.callbacks.BackupAndRestore(backup), GradientAccumulation(4)])
    assert int(resumed.optimizer.iterations.numpy()) == 4 * UPDATES
    assert max_abs_diff(resumed.get_weights(), straight.get_weights()) <= 1e-6


def test_activation_memory_follows_the_micro_batch():
    """On an activation-heavy model, k=8 peaks well below plain fit at the same batch."""
    from keras_tpu_mem.devices import read_memory, reset_peak

    x = np.random.default_rng(0).normal(size=(2048, 256)).astype("float32")
    y = np.zeros(2048, "int32")

    def peak(callbacks):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((256,))] +
                                 [keras.layers.Dense(256, activation="relu") for _ in range(6)] +
                                 [keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=sparse_ce())
        data = batched(x, y, 2048)
        model.fit(data, epochs=1, verbose=0, callbacks=callbacks)  # compile and warm up
        reset_peak("CPU:0")
        base = read_memory("CPU:0")[0]
        model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
        return read_memory("CPU:0")[1] - base

    plain, accumulated = peak([]), peak([GradientAccumulation(8)])
    assert accumulated < 0.6 * plain, (accumulated, plain)


class TestBadInput:
    @pytest.mark.parametrize("steps", [0, -2])
    def test_steps_below_one(self, steps):
        with pytest.raises(ValueError, match="`steps` must be an int >= 1"):
            GradientAccumulation(steps)

    @pytest.mark.parametrize("steps", [2.5, True, "2", 4.0])
    def test_steps_not_int(self, steps):
        with pytest.raises(TypeError, match="`steps` must be an int >= 1"):
            GradientAccumulation(steps)

    def test_exactly_one_of_steps_and_micro_batch_size(self):
        with pytest.raises(ValueError, match="exactly one of `steps`"):
            GradientAccumulation()
        with pytest.raises(ValueError, match="exactly one of `steps`"):
            GradientAccumulation(2, micro_batch_size=8)
        with pytest.raises(ValueError, match="`micro_batch_size` must be an int >= 1"):
            GradientAccumulation(micro_batch_size=0)

    def test_optimizer_with_keras_accumulation_is_refused(self):
        x, y = toy_data(64)
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
                      loss=sparse_ce())
        with pytest.raises(ValueError, match="gradient_accumulation_steps=2.*compound"):
            model.fit(batched(x, y, 32), verbose=0, callbacks=[GradientAccumulation(2)])

    def test_indivisible_static_batch_names_batch_replicas_and_steps(self):
        wrapper = TPUStrategyWrapper(logical_cpus=2)
        x, y = toy_data(120)
        with wrapper.scope():
            model = mlp()
            model.compile(optimizer="sgd", loss=sparse_ce())
        data = wrapper.distribute((x, y), 12)  # 6 per replica, not divisible by 4
        with pytest.raises(ValueError) as err:
            model.fit(data, verbose=0, callbacks=[GradientAccumulation(4)])
        message = str(err.value)
        for part in ("steps=4", "per-replica batch of 6", "global batch 12", "2 replica",
                     "multiple of 8", "TPUStrategyWrapper.distribute"):
            assert part in message

    @pytest.mark.parametrize("jit", [False, True], ids=["default", "xla"])
    def test_indivisible_last_batch_of_arrays_is_caught_at_run_time(self, jit):
        # Under XLA the run-time assertion is dropped and XLA's compilation of the
        # split fails instead; the error is then explained in the same words.
        x, y = toy_data(102)  # batches of 32, 32, 32 and a last one of 6
        model = mlp()
        model.compile(optimizer="sgd", loss=sparse_ce(), jit_compile=jit)
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match="GradientAccumulation.steps=4.*does not split evenly"):
            model.fit(x, y, batch_size=32, verbose=0, callbacks=[GradientAccumulation(4)])

    def test_other_step_errors_are_not_relabelled(self):
        # The micro-batches split evenly (16 and 3 per batch of 32 and 6); the
        # model's own fixed-size reshape fails on the last one.
        x, y = toy_data(38)
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Lambda(lambda t: tf.reshape(t, [16, 16])),
            keras.layers.Dense(5),
        ])
        model.compile(optimizer="sgd", loss=sparse_ce(), jit_compile=True)
        with pytest.raises(tf.errors.InvalidArgumentError) as err:
            model.fit(x, y, batch_size=32, verbose=0, callbacks=[GradientAccumulation(2)])
        assert "reshape" in str(err.value).lower()
        assert "GradientAccumulation" not in str(err.value)

    def test_sum_reduction_is_refused(self):
        x, y = toy_data(64)
        model = mlp()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum"))
        with pytest.raises(ValueError, match="mean-reduced losses.*sum"):
            model.fit(batched(x, y, 32), verbose=0, callbacks=[GradientAccumulation(2)])


def test_batchnorm_warns_once(ktm_records):
    x, y = toy_data(64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dense(5)])
    model.compile(optimizer="sgd", loss=sparse_ce())
    callback = GradientAccumulation(2)
    model.fit(batched(x, y, 32), epochs=2, verbose=0, callbacks=[callback])
    model.fit(batched(x, y, 32), epochs=1, verbose=0, callbacks=[callback])
    warnings = [r for r in ktm_records if "BatchNormalization" in r.getMessage()]
    assert len(warnings) == 1
    assert "micro-batch statistics" in warnings[0].getMessage()


def test_get_config_round_trip():
    callback = GradientAccumulation(micro_batch_size=16)
    clone = GradientAccumulation.from_config(callback.get_config())
    assert (clone.steps, clone.micro_batch_size) == (None, 16)
    assert Engine  # the engine is importable for subclassing features


def test_mixed_bfloat16_policy():
    """Under a bf16 policy the accumulated update stays close to the full-batch one."""
    x, y = toy_data(GLOBAL_BATCH * UPDATES)
    models = []
    for callbacks in ([], [GradientAccumulation(4)]):
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(32, activation="relu",
                                                     dtype="mixed_bfloat16"),
                                  keras.layers.Dense(5, dtype="float32")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=sparse_ce())
        model.fit(batched(x, y, GLOBAL_BATCH), verbose=0, callbacks=callbacks)
        models.append(model)
    assert all(w.dtype == "float32" for w in models[1].weights)
    # bf16 rounds each micro-batch's matmuls differently: close, not bit-equal
    # (measured 8e-5; a wrong 1/k weighting would be off by the learning rate).
    assert max_abs_diff(models[0].get_weights(), models[1].get_weights()) <= 1e-3
