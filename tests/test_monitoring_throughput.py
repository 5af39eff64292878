"""`ThroughputMonitor` and `measure_input_rate` on TensorFlow.

keras_tpu_mem/monitoring/throughput.py and input_rate.py.
"""

from __future__ import annotations

import sys
import time

import keras
import monitoring_cases as cases
import numpy as np
import pytest
import tensorflow as tf

from keras_tpu_mem import monitoring as mon


@pytest.mark.parametrize("kwargs, error, text", [
    ({"warmup_steps": -1}, ValueError, "warmup_steps"),
    ({"warmup_steps": 2.0}, TypeError, "warmup_steps"),
    ({"every_n_steps": 0}, ValueError, "every_n_steps"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"dataset": [1, 2, 3]}, TypeError, "dataset"),
    ({"input_batches": 0}, ValueError, "input_batches"),
])
def test_throughput_monitor_rejects_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=text):
        mon.ThroughputMonitor(**kwargs)


def test_measure_input_rate_rejects_bad_arguments():
    ds = tf.data.Dataset.range(4).batch(2)
    with pytest.raises(TypeError, match="dataset"):
        mon.measure_input_rate(np.zeros((4, 2)))
    with pytest.raises(ValueError, match="batches"):
        mon.measure_input_rate(ds, batches=0)
    with pytest.raises(ValueError, match="max_seconds"):
        mon.measure_input_rate(ds, max_seconds=0)
    with pytest.raises(ValueError, match="warm-up"):
        mon.measure_input_rate(ds, warmup_batches=5)


def test_batch_size_from_arrays_or_argument(ktm_records):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(512, 64)).astype("float32")
    y = rng.integers(0, 10, 512).astype("int32")
    model = cases.compile_model(cases.dense_mlp())
    speed = mon.ThroughputMonitor()
    model.fit(x, y, batch_size=128, epochs=1, verbose=0, callbacks=[speed])
    assert speed.summary["batch_size"] == 128  # 512 rows: every batch has a static 128

    unknown = mon.ThroughputMonitor()
    history = model.fit(x[:500], y[:500], batch_size=128, epochs=1, verbose=0,
                        callbacks=[unknown])  # the last batch holds 116 rows: not static
    assert unknown.summary["batch_size"] is None
    assert "samples_per_sec" not in history.history and "steps_per_sec" in history.history
    assert len(cases.log_messages(ktm_records, "pass batch_size=")) == 1

    given = mon.ThroughputMonitor(batch_size=128)
    history = model.fit(x[:500], y[:500], batch_size=128, epochs=1, verbose=0,
                        callbacks=[given])
    assert history.history["samples_per_sec"][0] > 0


class _WatchedSequential(keras.Sequential):
    """Records which module writes `train_function` (the engine should be the only one)."""

    def __setattr__(self, name, value):
        if name == "train_function":
            writers = self.__dict__.setdefault("_train_function_writers", [])
            writers.append(sys._getframe(1).f_globals.get("__name__"))
        super().__setattr__(name, value)


@pytest.mark.parametrize("with_engine_feature", [False, True])
def test_throughput_monitor_leaves_train_function_to_the_engine(with_engine_feature):
    import keras_tpu_mem as ktm

    rng = np.random.default_rng(4)
    x = rng.normal(size=(cases.BATCH * 4, 64)).astype("float32")
    y = rng.integers(0, 10, cases.BATCH * 4).astype("int32")
    model = _WatchedSequential([keras.Input((64,)), keras.layers.Dense(32),
                                keras.layers.Dense(10)], name="watched")
    cases.compile_model(model)
    speed = mon.ThroughputMonitor()
    callbacks = [speed] + ([ktm.GradientAccumulation(steps=2)] if with_engine_feature else [])
    model.fit(cases.tf_batches(x, y), epochs=1, verbose=0, callbacks=callbacks)
    assert speed.summary["batch_size"] == cases.BATCH  # from the engine's first-batch hook
    writers = model.__dict__.get("_train_function_writers", [])
    assert not [w for w in writers if w and w.startswith("keras_tpu_mem.monitoring")], writers
    assert all(w.startswith(("keras", "keras_tpu_mem.engine")) for w in writers if w), writers


def _slow_batches(delay_s, batches, batch=4):
    def slow(i):
        time.sleep(delay_s)
        return np.full((batch, 64), 0.5, "float32"), np.zeros((batch,), "int32")

    def py(i):
        x, y = tf.numpy_function(slow, [i], (tf.float32, tf.int32))
        return tf.ensure_shape(x, (batch, 64)), tf.ensure_shape(y, (batch,))

    return tf.data.Dataset.range(batches).map(py)


def test_measure_input_rate_counts_batches_and_samples():
    # tf.data injects a prefetch by default: a batch made during the warm-up would be
    # timed without its sleep (CI saw 106 batches/s). Without it every timed batch sleeps.
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    dataset = _slow_batches(0.01, 8).with_options(options)
    rate = mon.measure_input_rate(dataset, batches=5, warmup_batches=1)
    assert rate.batches == 5 and rate.batch_size == 4
    assert rate.batches_per_sec < 100  # each batch sleeps 10 ms: it cannot be faster
    assert rate.samples_per_sec == pytest.approx(4 * rate.batches_per_sec)


def test_input_verdict_thresholds():
    assert mon.input_verdict(100.0, 105.0)[0] == "input"
    assert mon.input_verdict(100.0, 150.0)[0] == "balanced"
    assert mon.input_verdict(100.0, 900.0)[0] == "compute"
    assert "9.00x" in mon.input_verdict(100.0, 900.0)[1]


def test_throughput_monitor_names_the_bottleneck(tmp_path, ktm_records):
    # A pipeline that sleeps 25 ms per batch feeding a tiny model: input-bound.
    slow = _slow_batches(0.025, 12)
    model = cases.compile_model(cases.dense_mlp(units=32))
    speed = mon.ThroughputMonitor(tmp_path / "slow", dataset=slow, warmup_steps=1)
    model.fit(slow, epochs=1, verbose=0, callbacks=[speed])
    assert speed.summary["bottleneck"] == "input", speed.summary
    assert speed.summary["batch_size"] == 4

    # An in-memory pipeline feeding a heavier step: compute-bound.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(cases.BATCH * 12, 64)).astype("float32")
    fast = cases.tf_batches(x, rng.integers(0, 10, cases.BATCH * 12).astype("int32"))
    model = cases.compile_model(cases.dense_mlp(units=2048))
    speed = mon.ThroughputMonitor(tmp_path / "fast", dataset=fast, warmup_steps=1)
    model.fit(fast, epochs=1, verbose=0, callbacks=[speed])
    assert speed.summary["bottleneck"] == "compute", speed.summary
    verdicts = cases.log_messages(ktm_records, "bottleneck:")
    assert any("input pipeline" in v for v in verdicts) and any("train step" in v
                                                               for v in verdicts)
    tags = cases.event_accumulator(tmp_path / "fast" / "ktm_throughput").Tags()["scalars"]
    assert "throughput/input_batches_per_sec" in tags
