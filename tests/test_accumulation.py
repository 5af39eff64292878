"""GradientAccumulation against a plain full-batch fit (the independent reference).

One body per behaviour, on both backends (conftest's BOTH_BACKENDS); the tests
marked `tensorflow_only` say why. `test_accumulation_jax.py` holds what is JAX's
own (the traced micro-batch size, ModelParallel, the compiled step's collectives).
"""

import keras
import numpy as np
import pytest
from conftest import BACKEND, default_strategy
from helpers import RaiseAtEpoch, batched, max_abs_diff, mlp, sparse_ce, toy_data

from keras_tpu_mem import GradientAccumulation, TPUStrategyWrapper
from keras_tpu_mem.engine import Engine

GLOBAL_BATCH = 32
UPDATES = 5


def _step_error():
    """What a failing train step raises: TensorFlow's run-time op error; on JAX the
    shapes are static, so the step fails while it is traced."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.errors.InvalidArgumentError
    return Exception


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
                      jit_compile=jit or BACKEND == "jax", steps_per_execution=spe)
    history = model.fit(batched(x, y, GLOBAL_BATCH, sample_weight), epochs=epochs,
                        shuffle=False, verbose=0,
                        callbacks=list(callbacks))
    return model, history


@pytest.fixture(scope="module")
def references():
    """Plain Keras fit on the full batch of 32, default strategy."""
    return {name: _fit(default_strategy(), name) for name in ("adam", "sgd")}


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
        lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
        assert lr == pytest.approx(0.01 * 0.5**UPDATES, rel=1e-6)


def test_micro_batch_size_equals_steps(references):
    model, _ = _fit(default_strategy(), "sgd",
                    [GradientAccumulation(micro_batch_size=8)])
    assert max_abs_diff(model.get_weights(), references["sgd"][0].get_weights()) <= 1e-6


def test_sample_weight_weighted_as_full_batch(mirrored):
    weights = np.random.default_rng(3).uniform(0.0, 2.0, GLOBAL_BATCH * UPDATES).astype("float32")
    ref, ref_history = _fit(default_strategy(), "sgd", sample_weight=weights)
    model, history = _fit(mirrored.strategy, "sgd", [GradientAccumulation(4)],
                          sample_weight=weights)
    assert max_abs_diff(model.get_weights(), ref.get_weights()) <= 1e-6
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    # And the weights matter: an unweighted run ends elsewhere.
    unweighted, _ = _fit(default_strategy(), "sgd")
    assert max_abs_diff(unweighted.get_weights(), ref.get_weights()) > 1e-4


def test_remainder_execution_under_mirrored():
    """9 steps per epoch with steps_per_execution=4 run as 4 + 4 + 1 under Mirrored."""
    from conftest import MIRRORED as strategy
    x, y = toy_data(9 * 16)
    results = []
    for strat, spe, callbacks in ((default_strategy(), 1, []),
                                  (strategy, 4, [GradientAccumulation(2)])):
        with strat.scope():
            model = mlp()
            model.compile(optimizer="adam", loss=sparse_ce(), steps_per_execution=spe)
        model.fit(batched(x, y, 16), epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        results.append(model)
    assert int(results[1].optimizer.iterations.numpy()) == 18
    assert max_abs_diff(results[0].get_weights(), results[1].get_weights()) <= 1e-6


def test_resume_after_interruption_matches_uninterrupted(tmp_path):
    x, y = toy_data(GLOBAL_BATCH * UPDATES)

    def run(callbacks):
        model = mlp()
        model.compile(optimizer=_optimizer("adam"), loss=sparse_ce(), steps_per_execution=2)
        model.fit(batched(x, y, GLOBAL_BATCH), epochs=4,
                  shuffle=False, verbose=0, callbacks=callbacks)
        return model

    straight = run([GradientAccumulation(4)])
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted at epoch 2"):
        run([GradientAccumulation(4), keras.callbacks.BackupAndRestore(backup),
             RaiseAtEpoch(2)])
    resumed = run([keras.callbacks.BackupAndRestore(backup), GradientAccumulation(4)])
    assert int(resumed.optimizer.iterations.numpy()) == 4 * UPDATES
    assert max_abs_diff(resumed.get_weights(), straight.get_weights()) <= 1e-6


@pytest.mark.tensorflow_only("reads TensorFlow's CPU allocator peak (devices.read_memory)")
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
            model.fit(batched(x, y, 32),
                      shuffle=False, verbose=0, callbacks=[GradientAccumulation(2)])

    @pytest.mark.tensorflow_only("TPUStrategyWrapper is a tf.distribute strategy; JAX: "
                                 "test_accumulation_jax's per-replica refusal")
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
        with pytest.raises(_step_error(),
                           match="GradientAccumulation.steps=4.*does not split evenly"):
            model.fit(x, y, batch_size=32, verbose=0, callbacks=[GradientAccumulation(4)])

    def test_other_step_errors_are_not_relabelled(self):
        # The micro-batches split evenly (16 and 3 per batch of 32 and 6); the
        # model's own fixed-size reshape fails on the last one.
        x, y = toy_data(38)
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Lambda(lambda t: keras.ops.reshape(t, [16, 16])),
            keras.layers.Dense(5),
        ])
        model.compile(optimizer="sgd", loss=sparse_ce(), jit_compile=True)
        with pytest.raises(_step_error()) as err:
            model.fit(x, y, batch_size=32, verbose=0, callbacks=[GradientAccumulation(2)])
        assert "reshape" in str(err.value).lower()
        assert "GradientAccumulation" not in str(err.value)

    def test_sum_reduction_is_refused(self):
        x, y = toy_data(64)
        model = mlp()
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="sum"))
        with pytest.raises(ValueError, match="mean-reduced losses.*sum"):
            model.fit(batched(x, y, 32),
                      shuffle=False, verbose=0, callbacks=[GradientAccumulation(2)])


def test_batchnorm_warns_once(ktm_records):
    x, y = toy_data(64)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dense(5)])
    model.compile(optimizer="sgd", loss=sparse_ce())
    callback = GradientAccumulation(2)
    model.fit(batched(x, y, 32), epochs=2, shuffle=False, verbose=0, callbacks=[callback])
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
        model.fit(batched(x, y, GLOBAL_BATCH), shuffle=False, verbose=0, callbacks=callbacks)
        models.append(model)
    assert all(w.dtype == "float32" for w in models[1].weights)
    # bf16 rounds each micro-batch's matmuls differently: close, not bit-equal. The
    # bound is bfloat16's epsilon (2**-8, one rounding of a unit-sized activation):
    # measured 8e-5 on TensorFlow, 1.9e-3 on JAX (XLA rounds the bf16 activations
    # of each micro-batch); a wrong 1/k weighting is off by the learning rate (0.1).
    assert max_abs_diff(models[0].get_weights(), models[1].get_weights()) <= 2.0**-8


# ------------------------------------------- dataset_yields="micro_batches"
MICRO = 8  # micro-batch size; 4 of them make the global batch of 32


def _fit_micro(strategy, *, jit=False, spe=1, steps=4, epochs=1, callbacks=(), x=None, y=None,
               optimizer="adam"):
    if x is None:
        x, y = toy_data(GLOBAL_BATCH * UPDATES)
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=_optimizer(optimizer), loss=sparse_ce(), metrics=["accuracy"],
                      jit_compile=jit or BACKEND == "jax", steps_per_execution=spe)
    history = model.fit(batched(x, y, MICRO), epochs=epochs, shuffle=False, verbose=0, callbacks=[
        GradientAccumulation(steps, dataset_yields="micro_batches"), *callbacks])
    return model, history


@pytest.mark.parametrize("case, spe", [("default", 1), ("jit", 1), ("mirrored", 2),
                                        ("default", 8)])
def test_micro_batches_equal_full_batch(references, case, spe, request):
    """Issue 17's floor: 160 examples as micro-batches of 8, steps=4 == plain fit at 32."""
    from conftest import StrategyCase

    strategy_case = StrategyCase(case)
    model, history = _fit_micro(strategy_case.strategy, jit=strategy_case.jit_compile, spe=spe)
    reference, ref_history = references["adam"]
    assert max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-6
    assert int(model.optimizer.iterations.numpy()) == UPDATES
    # The schedule decayed once per update (decay_steps=1, rate 0.5), not per micro-batch.
    lr = float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    np.testing.assert_allclose(lr, 0.01 * 0.5**UPDATES, rtol=1e-6)
    # Mean of equal micro-batch losses == the full-batch loss (over the epoch).
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)


def test_micro_batches_count_updates_not_micro_batches():
    """1 update for a warm-up fit of 8 micro-batches (k=8), then 4 for a fit of 32."""
    x, y = toy_data(MICRO * 40)
    with default_strategy().scope():
        model = mlp()
        model.compile(optimizer="sgd", loss=sparse_ce())
    seen = []

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    accumulate = GradientAccumulation(8, dataset_yields="micro_batches")
    model.fit(batched(x[:64], y[:64], MICRO), shuffle=False, verbose=0, callbacks=[accumulate])
    assert int(model.optimizer.iterations.numpy()) == 1
    seen.clear()
    history = model.fit(batched(x[64:], y[64:], MICRO), shuffle=False, verbose=0,
                        callbacks=[accumulate, Batches()])
    assert int(model.optimizer.iterations.numpy()) == 1 + 4
    assert seen == list(range(32))   # Keras' batch indices count micro-batches
    assert len(history.history["loss"]) == 1


def test_micro_batches_partial_window_is_an_error():
    x, y = toy_data(MICRO * 10)   # 10 micro-batches, k=4
    with pytest.raises(ValueError, match=r"10 micro-batches, not a multiple of 4"):
        _fit_micro(default_strategy(), x=x, y=y)


def test_micro_batches_partial_window_of_unknown_length_fails_at_epoch_end():
    x, y = toy_data(MICRO * 6)

    def batches():   # a generator: Keras does not know the epoch's length
        for i in range(6):
            yield x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]

    with default_strategy().scope():
        model = mlp()
        model.compile(optimizer="sgd", loss=sparse_ce())
    with pytest.raises(ValueError, match=r"2 micro-batch\(es\) into a window"):
        model.fit(batches(), verbose=0,
                  callbacks=[GradientAccumulation(4, dataset_yields="micro_batches")])
    assert int(model.optimizer.iterations.numpy()) == 1   # the whole window was applied


def test_micro_batches_refuse_steps_per_execution_that_does_not_tile():
    with pytest.raises(ValueError, match="steps_per_execution=3: one must divide the other"):
        _fit_micro(default_strategy(), spe=3)


def test_micro_batches_arguments():
    with pytest.raises(ValueError, match="`dataset_yields` must be one of"):
        GradientAccumulation(4, dataset_yields="micro")
    with pytest.raises(ValueError, match="micro_batch_size"):
        GradientAccumulation(micro_batch_size=8, dataset_yields="micro_batches")
    config = GradientAccumulation(4, dataset_yields="micro_batches").get_config()
    assert GradientAccumulation.from_config(config).dataset_yields == "micro_batches"


def test_pulled_micro_batches_plan_keras_steps_arguments_and_the_accumulators():
    """`compiled_memory` and `plan` with `GradientAccumulation(k,
    dataset_yields="micro_batches")` compile the step that applies the update, at one
    micro-batch (the batch `fit` is given): its arguments are Keras' own step's at that
    batch plus one accumulator per trainable weight (carried from step to step, so XLA
    counts them among the arguments, not the temporaries). `plan` says the batch is one of
    the k micro-batches of an update and refuses to search a split the dataset makes."""
    from keras_tpu_mem.planning import compiled_memory, plan

    model = mlp()
    model.compile(optimizer="adam", loss=sparse_ce())
    pulled = GradientAccumulation(4, dataset_yields="micro_batches")
    planned = compiled_memory(model, 8, callbacks=[pulled], hlo_text=False)
    keras_step = compiled_memory(model, 8, hlo_text=False)
    trainable = sum(4 * int(np.prod(w.shape)) for w in model.trainable_weights)
    assert planned.pulled and planned.micro_batches == 4
    assert planned.accumulator_bytes == trainable
    assert planned.argument_bytes == keras_step.argument_bytes + trainable
    assert "accumulators" in str(planned).splitlines()[1]  # the arguments' row
    memory = plan(model, 8, device="16GiB", callbacks=[pulled], by_layer=False)
    assert memory.pulled and memory.micro_batch == 8 and memory.accumulation_steps == 4
    assert "one of 4 micro-batches the dataset yields per update (32 examples)" in str(memory)
    assert memory.activation_bytes == planned.temp_bytes  # no accumulator among them
    with pytest.raises(ValueError, match="search=True.*dataset_yields='micro_batches'"):
        plan(model, 8, device="16GiB", callbacks=[pulled], search=True)


def test_micro_batches_resume_after_interruption(tmp_path):
    """Windows never span epochs, so a resume at an epoch boundary is exact."""
    x, y = toy_data(GLOBAL_BATCH * UPDATES)
    reference, _ = _fit_micro(default_strategy(), epochs=3, x=x, y=y)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit_micro(default_strategy(), epochs=3, x=x, y=y,
                   callbacks=[backup, RaiseAtEpoch(2)])
    resumed, _ = _fit_micro(default_strategy(), epochs=3, x=x, y=y,
                            callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert max_abs_diff(resumed.get_weights(), reference.get_weights()) <= 1e-6
    assert int(resumed.optimizer.iterations.numpy()) == 3 * UPDATES


def test_micro_batches_compose_with_pruning_and_bf16_like_global_batches():
    """Both accumulation modes give the same training with the other features on."""
    from keras_tpu_mem import ConstantSparsity, MixedBFloat16, Pruning

    x, y = toy_data(GLOBAL_BATCH * UPDATES)

    def run(mode, batch):
        with default_strategy().scope():
            model = mlp()
            model.compile(optimizer=_optimizer("adam"), loss=sparse_ce())
        model.fit(batched(x, y, batch), shuffle=False, verbose=0, callbacks=[
            GradientAccumulation(4, dataset_yields=mode), MixedBFloat16(),
            Pruning(ConstantSparsity(0.5, begin_step=2, frequency=1))])
        return model

    micro, full = run("micro_batches", MICRO), run("global_batches", GLOBAL_BATCH)
    assert int(micro.optimizer.iterations.numpy()) == UPDATES
    # bf16 compute: the two loops sum the same micro-batch gradients in another order.
    assert max_abs_diff(micro.get_weights(), full.get_weights()) <= 1e-5
    kernel = keras.ops.convert_to_numpy(micro.layers[0].kernel)
    np.testing.assert_allclose(np.mean(kernel == 0), 0.5, atol=0.01)
