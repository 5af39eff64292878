"""The `Pruning` callback: fits across the matrix, resume, arguments, logs; one body
per behaviour on both backends (conftest's BOTH_BACKENDS; "mirrored" is
MirroredStrategy on TensorFlow, DataParallel over 8 devices on JAX).

Schedules (against tfmot) are in `test_pruning_schedules.py`, masks in
`test_pruning_masks.py`, layer selection in `test_pruning_selection.py`,
`strip_pruning` and `sparsity_report` in `test_pruning_export.py` and
`test_pruning_report.py`.
"""

import json
import os
import warnings

import keras
import numpy as np
import pytest
from conftest import BACKEND, default_strategy
from helpers import RaiseAtEpoch, max_abs_diff, sparse_ce, toy_data

from keras_tpu_mem import GradientAccumulation
from keras_tpu_mem.pruning import (
    ConstantSparsity,
    PolynomialDecay,
    Pruning,
    strip_pruning,
)

# ------------------------------------------------------------------ helpers

def _strategy(case: str):
    """The strategy of a matrix cell (the session's one MirroredStrategy, see conftest)."""
    if case != "mirrored":
        return default_strategy()
    from conftest import MIRRORED

    return MIRRORED


def _digits_mlp(strategy, jit=False, spe=1, hidden=128):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=sparse_ce(),
                      jit_compile=jit or BACKEND == "jax", steps_per_execution=spe)
    return model


def _small_mlp(strategy=None, spe=1, jit=False, seed=1):
    strategy = strategy or default_strategy()
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(5),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=sparse_ce(),
                      jit_compile=jit or BACKEND == "jax", steps_per_execution=spe)
    return model


def _numpy(tensor):
    return keras.ops.convert_to_numpy(tensor)


def _kernels(model):
    return [layer.kernel for layer in model.layers if hasattr(layer, "kernel")]


def _replicas(variable):
    """The value of every replica's copy of a (possibly mirrored) Keras variable."""
    value = variable.value
    components = getattr(value, "values", None)
    if components is None:
        return [np.asarray(value)]
    return [np.asarray(c) for c in components]


def _expected_zeros(size, sparsity):
    """Entries tfmot's rule zeroes: size - max(round(size * (1 - s)), 1)."""
    return size - max(int(np.round(size * (1.0 - sparsity))), 1)


def _poly(step, initial, final, begin, end, power=3):
    """PolynomialDecay's sparsity in float64 (the independent reference)."""
    p = min(1.0, max(0.0, (step - begin) / (end - begin)))
    return final + (initial - final) * (1.0 - p) ** power


class ZerosAfterBatch(keras.callbacks.Callback):
    """Fraction of exact zeros in the first kernel after every batch."""

    def __init__(self, variable):
        super().__init__()
        self.variable = variable
        self.fractions = []

    def on_train_batch_end(self, batch, logs=None):
        if BACKEND == "jax":
            # Keras' JAX fit keeps the state outside the variables between
            # batches; this writes it back so the variable can be read.
            self.model.jax_state_sync()
        self.fractions.append(float(np.mean(_replicas(self.variable)[0] == 0)))


# ------------------------------------------------------------- the floor


FLOOR_EPOCHS, FLOOR_BATCH, FLOOR_END, FLOOR_FREQ = 6, 32, 180, 10


def _numpy_accuracy(model, x, y):
    """Validation accuracy from the weights, in float64 numpy (no compiled predict)."""
    h = x.astype("float64")
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    for i, layer in enumerate(dense):
        kernel, bias = (np.asarray(_replicas(v)[0], "float64") for v in layer.weights)
        h = h @ kernel + bias
        if i < len(dense) - 1:
            h = np.maximum(h, 0.0)
    return float(np.mean(np.argmax(h, axis=1) == y))


def _floor_data(digits):
    (x, y), (xv, yv) = digits
    # 43 whole batches: one XLA shape, and with steps_per_execution=4 every epoch
    # ends on a 3-step remainder execution (4 * 10 + 3).
    n = 43 * FLOOR_BATCH
    return (x[:n], y[:n]), (xv, yv)


@pytest.fixture(scope="module")
def dense_digits_accuracy(digits):
    """The dense model, plain Keras fit, trained the same number of epochs."""
    (x, y), (xv, yv) = _floor_data(digits)
    model = _digits_mlp(default_strategy())
    model.fit(x, y, batch_size=FLOOR_BATCH, epochs=FLOOR_EPOCHS, verbose=0, shuffle=False)
    return _numpy_accuracy(model, xv, yv)


def test_floor_polynomial_decay_on_digits(strategy_case, digits, dense_digits_accuracy):
    """80% sparsity, exact zeros at every epoch end with spe=4, accuracy within 2 points."""
    assert len(digits[0][0]) >= 43 * FLOOR_BATCH
    (x, y), (xv, yv) = _floor_data(digits)
    steps_per_epoch = len(x) // FLOOR_BATCH
    model = _digits_mlp(_strategy(strategy_case.name), strategy_case.jit_compile, spe=4)
    kernels = _kernels(model)
    seen = []

    class AtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            copies = [_replicas(k) for k in kernels]
            for c in copies:  # every replica holds the same (pruned) weights
                for other in c[1:]:
                    np.testing.assert_array_equal(c[0], other)
            seen.append([int(np.sum(c[0] == 0)) for c in copies])

    schedule = PolynomialDecay(0.0, 0.8, begin_step=0, end_step=FLOOR_END,
                               frequency=FLOOR_FREQ)
    model.fit(x, y, batch_size=FLOOR_BATCH, epochs=FLOOR_EPOCHS, verbose=0, shuffle=False,
              callbacks=[Pruning(schedule), AtEpochEnd()])

    assert len(seen) == FLOOR_EPOCHS
    for epoch, zeros in enumerate(seen):
        updates = (epoch + 1) * steps_per_epoch
        last = min(updates // FLOOR_FREQ * FLOOR_FREQ, FLOOR_END)
        sparsity = _poly(last, 0.0, 0.8, 0, FLOOR_END)
        for kernel, count in zip(kernels, zeros):
            size = int(np.prod(kernel.shape))
            assert abs(count - _expected_zeros(size, sparsity)) <= 1, (epoch, kernel.path)
    for kernel in kernels:
        assert np.mean(_replicas(kernel)[0] == 0) == pytest.approx(0.80, abs=0.01)
    assert int(model.optimizer.iterations.numpy()) == FLOOR_EPOCHS * steps_per_epoch
    accuracy = _numpy_accuracy(model, xv, yv)
    assert dense_digits_accuracy > 0.95
    assert accuracy >= dense_digits_accuracy - 0.02, (accuracy, dense_digits_accuracy)


@pytest.mark.parametrize("case, accumulate", [("default", False), ("jit", False),
                                             ("mirrored", False), ("default", True)])
def test_prunes_exactly_at_the_scheduled_update(case, accumulate):
    """Steps count optimizer updates (1 after the first), with or without accumulation."""
    x, y = toy_data(32 * 6, inputs=16)
    model = _small_mlp(_strategy(case), jit=case == "jit")
    recorder = ZerosAfterBatch(model.layers[0].kernel)
    callbacks = [Pruning(ConstantSparsity(0.5, begin_step=3, end_step=3, frequency=1)),
                 recorder]
    if accumulate:
        callbacks.append(GradientAccumulation(steps=2))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
    assert recorder.fractions == [0.0, 0.0, 0.5, 0.5, 0.5, 0.5]


# --------------------------------------------------------------- resume


def _resume_fit(strategy, backup_dir, interrupt=None, seed=0):
    x, y = toy_data(128, inputs=16)
    model = _small_mlp(strategy, spe=2, seed=seed)
    callbacks = [Pruning(PolynomialDecay(0.0, 0.7, begin_step=0, end_step=12, frequency=2)),
                 keras.callbacks.BackupAndRestore(str(backup_dir))]
    if interrupt is not None:
        callbacks.append(RaiseAtEpoch(interrupt))
    model.fit(x, y, batch_size=32, epochs=4, verbose=0, shuffle=False, callbacks=callbacks)
    return model


@pytest.mark.parametrize("case", ["default", "mirrored"])
def test_resume_after_interruption_equals_uninterrupted(case, tmp_path):
    strategy = _strategy(case)
    reference = _resume_fit(strategy, tmp_path / "a")
    with pytest.raises(RuntimeError, match="interrupted at epoch 2"):
        _resume_fit(strategy, tmp_path / "b", interrupt=2)
    # A fresh process: a new model (other initial weights), new callbacks.
    resumed = _resume_fit(strategy, tmp_path / "b", seed=7)
    assert int(resumed.optimizer.iterations.numpy()) == 16
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got == 0, want == 0)
    assert max_abs_diff(resumed.get_weights(), reference.get_weights()) <= 1e-6
    for kernel in _kernels(resumed):
        assert np.mean(np.asarray(kernel.value) == 0) == pytest.approx(0.7, abs=0.01)


def test_second_fit_keeps_masks_and_frees_zeros_before_pruning_starts():
    """Masks are derived from the weights only once the schedule has pruned."""
    x, y = toy_data(128, inputs=16)
    model = _small_mlp()
    late = Pruning(ConstantSparsity(0.5, begin_step=1000))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[late])
    # Exact zeros that are no pruning's doing (e.g. a zero-initialised kernel):
    kernel = model.layers[0].kernel
    kernel.assign(np.zeros(kernel.shape, "float32"))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[late])
    assert np.count_nonzero(np.asarray(kernel.value)) > 0.9 * np.prod(kernel.shape)

    # After pruning began, a later fit (same or new callback) keeps the masks, even
    # when its schedule no longer recomputes them.
    assert int(model.optimizer.iterations.numpy()) == 8
    once = ConstantSparsity(0.5, begin_step=10, end_step=10, frequency=1)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[Pruning(once)])
    zeros = np.asarray(kernel.value) == 0
    assert zeros.sum() == _expected_zeros(zeros.size, 0.5)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[Pruning(once)])
    np.testing.assert_array_equal(np.asarray(kernel.value) == 0, zeros)


def _mask_dtypes(model, pruning):
    """The dtypes of the masks the engine carries for `pruning` (its `PruningState`)."""
    from keras_tpu_mem.engine import Engine

    return [keras.backend.standardize_dtype(mask.dtype)
            for mask in Engine.of(model).feature_state(pruning).masks]


@pytest.mark.tensorflow_only("only TensorFlow compiles a step without XLA (float32 masks); "
                             "JAX's step is always XLA (bool masks)")
def test_recompiling_for_xla_keeps_the_masks_in_bool():
    """Masks are bool under XLA (1 byte) and in the weight's dtype without (a multiply
    is faster there); a recompile that switches XLA on mid-run keeps what was pruned."""
    x, y = toy_data(128, inputs=16)
    model = _small_mlp()
    once = ConstantSparsity(0.5, begin_step=2, end_step=2, frequency=1)
    pruning = Pruning(once)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[pruning])
    assert _mask_dtypes(model, pruning) == ["float32", "float32"]
    zeros = [np.asarray(k.value) == 0 for k in _kernels(model)]
    assert [z.sum() for z in zeros] == [_expected_zeros(z.size, 0.5) for z in zeros]

    model.compile(optimizer=model.optimizer, loss=sparse_ce(), jit_compile=True)
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[pruning])
    assert _mask_dtypes(model, pruning) == ["bool", "bool"]
    assert int(model.optimizer.iterations.numpy()) == 12
    for kernel, before in zip(_kernels(model), zeros):
        np.testing.assert_array_equal(np.asarray(kernel.value) == 0, before)


# ------------------------------------------------------------ composition


@pytest.mark.parametrize("case", ["default", "mirrored"])
def test_composition_with_gradient_accumulation(case):
    """GradientAccumulation + Pruning equals Pruning on the full batch, in either order."""
    x, y = toy_data(32 * 8, inputs=16)
    strategy = _strategy(case)

    def run(callbacks):
        model = _small_mlp(strategy, spe=2)
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False,
                  callbacks=callbacks)
        return model

    def schedule():
        return PolynomialDecay(0.0, 0.6, begin_step=0, end_step=12, frequency=3)

    accumulated = run([GradientAccumulation(steps=2), Pruning(schedule())])
    full_batch = run([Pruning(schedule())])
    for a, b in zip(accumulated.get_weights(), full_batch.get_weights()):
        np.testing.assert_array_equal(a == 0, b == 0)
    assert max_abs_diff(accumulated.get_weights(), full_batch.get_weights()) <= 1e-5
    kernel = np.asarray(accumulated.layers[0].kernel.value)
    assert np.mean(kernel == 0) == pytest.approx(0.6, abs=0.01)
    if case == "default":
        swapped = run([Pruning(schedule()), GradientAccumulation(steps=2)])
        assert max_abs_diff(accumulated.get_weights(), swapped.get_weights()) == 0.0


# ---------------------------------------------------------- structures


def test_m_by_n_fit_every_group_of_four_has_two_zeros():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 6, 8))
    h = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(12, activation="relu")(h)
    outputs = keras.layers.Dense(4)(h)
    model = keras.Model(inputs, outputs)
    model.compile("adam", sparse_ce(), steps_per_execution=3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6, 6, 8)).astype("float32")
    y = rng.integers(0, 4, 96)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
        Pruning(ConstantSparsity(0.5, begin_step=2, frequency=4), m_by_n=(2, 4))])
    for layer in model.layers:
        if not hasattr(layer, "kernel"):
            continue
        kernel = np.asarray(layer.kernel.value)
        groups = np.moveaxis(kernel, -2, -1)  # input axis last: [..., out, in]
        groups = groups.reshape(*groups.shape[:-1], -1, 4)
        assert np.all(np.sum(groups == 0, axis=-1) >= 2), layer.name
        assert np.mean(kernel == 0) == pytest.approx(0.5, abs=0.01)


def test_block_sparsity_fit_prunes_aligned_blocks():
    x, y = toy_data(128, inputs=16)
    model = _small_mlp()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[
        Pruning(ConstantSparsity(0.5, begin_step=1, frequency=2), block_size=(2, 4),
                block_pooling_type="MAX")])
    for kernel in _kernels(model):
        value = np.asarray(kernel.value)
        rows, cols = value.shape
        blocks = (value[: rows // 2 * 2, : cols // 4 * 4]
                  .reshape(rows // 2, 2, cols // 4, 4).transpose(0, 2, 1, 3)
                  .reshape(rows // 2, cols // 4, 8))
        zero_blocks = np.all(blocks == 0, axis=-1)
        # Every block is all-zero or all-non-zero, and half of the blocks are zero.
        assert np.all(zero_blocks | np.all(blocks != 0, axis=-1))
        n_blocks = -(-rows // 2) * -(-cols // 4)
        assert int(np.all(np.pad(value, [[0, -rows % 2], [0, -cols % 4]], constant_values=0)
                          .reshape(-(-rows // 2), 2, -(-cols // 4), 4) == 0,
                          axis=(1, 3)).sum()) == _expected_zeros(n_blocks, 0.5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(m_by_n=(4, 2)), ValueError, "0 < m < n"),
    (dict(m_by_n=(0, 4)), ValueError, "0 < m < n"),
    (dict(m_by_n=(2, 2)), ValueError, "0 < m < n"),
    (dict(m_by_n=(-1, 4)), ValueError, "0 < m < n"),
    (dict(m_by_n=(2.0, 4)), TypeError, "m_by_n"),
    (dict(m_by_n=4), TypeError, "m_by_n"),
    (dict(m_by_n=(2, 4), block_size=(2, 2)), ValueError, "not both"),
    (dict(block_size=(0, 2)), ValueError, "block_size"),
    (dict(block_size=(2, 2, 2)), TypeError, "block_size"),
    (dict(block_pooling_type="MEAN"), ValueError, "'AVG' or 'MAX'"),
    (dict(log_dir=""), TypeError, "log_dir"),
])
def test_pruning_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Pruning(ConstantSparsity(0.5, 0), **kwargs)


def test_m_by_n_refuses_a_schedule_with_another_sparsity():
    with pytest.raises(ValueError, match="fixed at 2/4 = 0.5, but the schedule ends at 0.8"):
        Pruning(PolynomialDecay(0.0, 0.8, 0, 100), m_by_n=(2, 4))


def test_schedule_must_be_callable_with_a_pair():
    with pytest.raises(TypeError, match="pruning schedule"):
        Pruning(0.5)
    with pytest.raises(TypeError, match="should_prune, sparsity"):
        Pruning(lambda step: 0.5)


def test_block_size_needs_rank_2_at_fit():
    keras.utils.set_random_seed(0)
    image = keras.Input((6, 6, 1))
    h = keras.layers.Flatten()(keras.layers.Conv2D(2, 3, name="conv")(image))
    model = keras.Model(image, keras.layers.Dense(3, name="head")(h))
    model.compile("sgd", sparse_ce())
    with pytest.raises(ValueError, match="needs rank-2 weights"):
        Pruning(ConstantSparsity(0.5, 0), block_size=(2, 2)).install(model)
    Pruning(ConstantSparsity(0.5, 0), block_size=(2, 2), layers=["head"]).install(model)


@pytest.mark.tensorflow_only("the schedule returns tf ops and the out-of-range sparsity "
                             "is a run-time tf.debugging error")
def test_custom_callable_schedule_and_invalid_sparsity():
    import tensorflow as tf

    x, y = toy_data(64, inputs=16)
    model = _small_mlp()

    def schedule(step):
        return tf.equal(step, 2), tf.constant(0.25)

    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[Pruning(schedule)])
    kernel = np.asarray(model.layers[0].kernel.value)
    assert int(np.sum(kernel == 0)) == _expected_zeros(kernel.size, 0.25)

    def broken(step):
        return tf.equal(step, 2), tf.constant(1.5)

    with pytest.raises(tf.errors.InvalidArgumentError, match="outside \\[0, 1\\)"):
        _small_mlp().fit(x, y, batch_size=16, epochs=1, verbose=0,
                         callbacks=[Pruning(broken)])


def test_get_config_round_trip():
    pruning = Pruning(PolynomialDecay(0.0, 0.5, 0, 100, frequency=5),
                      layers=["head", keras.layers.Conv2D], m_by_n=(2, 4), log_dir="logs")
    config = pruning.get_config()
    json.dumps(config)
    restored = Pruning.from_config(config)
    assert restored.get_config() == config
    assert restored.layers == ["head", keras.layers.Conv2D]
    assert restored.schedule == pruning.schedule


class SubclassedNet(keras.Model):
    """A subclassed model: Keras builds it lazily, in the first trace of the step."""

    def __init__(self, hidden=32, **kwargs):
        super().__init__(**kwargs)
        self.hidden = hidden
        self.body = keras.layers.Dense(hidden, activation="relu")
        self.head = keras.layers.Dense(5)

    def call(self, x):
        return self.head(self.body(x))

    def get_config(self):
        return {"hidden": self.hidden, **super().get_config()}


@pytest.mark.parametrize("case", ["default", "jit"])
def test_subclassed_model_under_mixed_bfloat16(case, tmp_path):
    """tfmot fails on both (tensorflow/model-optimization#155, #409)."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    x, y = toy_data(128, inputs=16)
    model = SubclassedNet()
    model.compile("adam", sparse_ce(), steps_per_execution=2, jit_compile=case == "jit")
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[
        Pruning(ConstantSparsity(0.5, begin_step=1, frequency=2))])
    for layer in (model.body, model.head):
        kernel = np.asarray(layer.kernel.value)
        assert layer.kernel.dtype == "float32" and layer.compute_dtype == "bfloat16"
        assert int(np.sum(kernel == 0)) == _expected_zeros(kernel.size, 0.5)
    stripped = strip_pruning(model)
    np.testing.assert_array_equal(stripped.predict(x, verbose=0), model.predict(x, verbose=0))


# ------------------------------------------------------------ logs and steps


@pytest.mark.tensorflow_only("reads the event files with tf.compat.v1.train.summary_iterator")
def test_log_dir_writes_sparsity_and_threshold(tmp_path):
    import tensorflow as tf

    x, y = toy_data(128, inputs=16)
    model = _small_mlp()
    model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[
        Pruning(ConstantSparsity(0.4, begin_step=1, frequency=2), log_dir=str(tmp_path))])
    scalars = {}
    for name in os.listdir(tmp_path):
        for event in tf.compat.v1.train.summary_iterator(str(tmp_path / name)):
            for value in event.summary.value:
                # Written as TensorBoard's scalar `simple_value` (keras_tpu_mem.events).
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    tags = {f"pruning/{k.path}/{what}" for k in _kernels(model)
            for what in ("sparsity", "threshold")} | {"pruning/schedule_sparsity"}
    assert set(scalars) == tags
    for kernel in _kernels(model):
        steps, sparsities = zip(*scalars[f"pruning/{kernel.path}/sparsity"])
        assert steps == (4, 8)
        size = int(np.prod(kernel.shape))
        assert sparsities[-1] == pytest.approx(_expected_zeros(size, 0.4) / size, abs=1e-6)
        threshold = scalars[f"pruning/{kernel.path}/threshold"][-1][1]
        assert threshold > 0


@pytest.mark.parametrize("schedule", [
    ConstantSparsity(0.5, begin_step=0),
    ConstantSparsity(0.5, begin_step=0, frequency=1),
    ConstantSparsity(0.9, begin_step=37, end_step=1500, frequency=7),
    PolynomialDecay(0.0, 0.8, begin_step=0, end_step=1000),
    PolynomialDecay(0.2, 0.95, begin_step=150, end_step=1750, power=2, frequency=13),
    PolynomialDecay(0.5, 0.1, begin_step=3, end_step=997, frequency=1),
])
def test_in_step_predicate_equals_the_schedule(schedule):
    """The simplified predicate the step evaluates equals schedule(step)[0]."""
    steps = keras.ops.arange(0, 2001, dtype="int64")
    should, sparsity_fn = Pruning(schedule)._should_prune(steps)
    expected, _ = schedule(steps)
    expected = _numpy(expected)
    np.testing.assert_array_equal(np.broadcast_to(_numpy(should), expected.shape), expected)
    np.testing.assert_array_equal(_numpy(sparsity_fn()), _numpy(schedule(steps)[1]))


class _EveryThirdStepFromFive(ConstantSparsity):
    """A user's subclass whose `__call__` decides otherwise than its attributes say."""

    def __call__(self, step):
        ops = keras.ops
        should = ops.logical_and(step >= 5, ops.equal(ops.mod(step, 3), 0))
        return should, ops.convert_to_tensor(self.target_sparsity, "float32")


def test_a_subclass_schedule_is_asked_not_simplified():
    schedule = _EveryThirdStepFromFive(0.5, begin_step=0, frequency=100)
    pruning = Pruning(schedule)
    for step in range(40):
        should, _ = pruning._should_prune(keras.ops.convert_to_tensor(step, "int64"))
        assert bool(should) == (step >= 5 and step % 3 == 0), step
    assert not pruning._pruning_started(5)
    assert pruning._pruning_started(6)


@pytest.mark.parametrize("schedule, first", [
    (ConstantSparsity(0.5, begin_step=0, frequency=100), 100),
    (ConstantSparsity(0.5, begin_step=250_000, frequency=1000), 250_000),
    (PolynomialDecay(0.0, 0.8, begin_step=0, end_step=10_000, frequency=100), 100),
    # sparsity 0 at begin_step: pruning starts at the next turn
    (PolynomialDecay(0.0, 0.8, begin_step=70_000, end_step=90_000, frequency=500), 70_500),
    (PolynomialDecay(0.3, 0.8, begin_step=70_000, end_step=90_000, frequency=500), 70_000),
    (ConstantSparsity(0.5, begin_step=40, end_step=40, frequency=7), 40),
])
def test_pruning_started_walks_only_the_pruning_turns(schedule, first):
    """Exact at the boundary, and quick far out (only the schedule's turns are visited)."""
    pruning = Pruning(schedule)
    assert not pruning._pruning_started(first - 1)
    assert pruning._pruning_started(first)
    assert pruning._pruning_started(10_000_000)


@pytest.mark.parametrize("schedule", [
    ConstantSparsity(0.0, begin_step=0),
    PolynomialDecay(0.0, 0.0, begin_step=10, end_step=5000, frequency=3),
])
def test_pruning_never_started_when_sparsity_stays_zero(schedule):
    assert not Pruning(schedule)._pruning_started(10_000_000)


def test_pruning_started_agrees_with_walking_every_step():
    """The two-turn shortcut equals evaluating the schedule at every step."""
    schedules = [ConstantSparsity(t, begin_step=b, end_step=e, frequency=f)
                 for t in (0.0, 0.5) for b in (0, 1, 7) for e in (-1, 7, 30) for f in (1, 4)
                 if e < 0 or e >= b]
    schedules += [PolynomialDecay(i, fin, begin_step=b, end_step=e, frequency=f)
                  for i in (0.0, 0.3) for fin in (0.0, 0.6) for b in (0, 5) for e in (9, 40)
                  for f in (1, 3, 16)]
    steps = keras.ops.arange(1, 61, dtype="int64")
    for schedule in schedules:
        should, sparsity = schedule(steps)
        prunes = np.logical_and(_numpy(should), _numpy(sparsity) > 0)
        expected = np.logical_or.accumulate(prunes)
        pruning = Pruning(schedule)
        got = [pruning._pruning_started(int(s)) for s in _numpy(steps)]
        np.testing.assert_array_equal(got, expected, err_msg=repr(schedule))


def _fit_warnings(schedule):
    model = _small_mlp()
    x, y = toy_data(256, inputs=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                  callbacks=[Pruning(schedule)])
    never = [str(w.message) for w in caught if "nothing was pruned" in str(w.message)]
    kernel = np.asarray(model.layers[0].kernel)
    return never, int(np.asarray(model.optimizer.iterations)), float((kernel == 0).mean())


def test_a_schedule_that_never_pruned_warns_once():
    """tfmot's default frequency=100 on a short fine-tune: 64 updates, first pruning
    step 100 (begin_step=0 is turn 0, before the first update); then a schedule that
    prunes at step 10, which must not warn; then PolynomialDecay from 0, whose first
    turn prunes nothing (sparsity 0) and whose second is the one to name."""
    never, updates, zeros = _fit_warnings(ConstantSparsity(0.5, begin_step=0))
    assert updates == 64 and zeros == 0.0
    assert len(never) == 1, never
    assert "first pruning step is 100" in never[0] and "64 optimizer updates" in never[0]

    never, _, zeros = _fit_warnings(ConstantSparsity(0.5, begin_step=0, frequency=10))
    assert never == [] and abs(zeros - 0.5) < 0.01

    never, _, _ = _fit_warnings(PolynomialDecay(0.0, 0.5, begin_step=70, end_step=400,
                                                  frequency=50))
    assert len(never) == 1 and "first pruning step is 120" in never[0], never
