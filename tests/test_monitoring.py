"""HBMMonitor, ThroughputMonitor and measure_input_rate (issues #7, #12).

Memory on CPU is the host allocator's current/peak bytes, which TensorFlow
reports while oneDNN is on (conftest forces it on); it counts only allocations
of 256 KiB and more, so the models here have layers of >= 1024 units at batch
>= 128. The host-RSS fallback (oneDNN off, as on AMD/AVX2 CPUs) is tested in
subprocesses with TF_ENABLE_ONEDNN_OPTS=0.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import host_rss_workload
import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_tpu_mem import devices
from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.monitoring import _allocators as allocators
from keras_tpu_mem.report import load_timeline

BATCH = 128


# ------------------------------------------------------------------ helpers
@pytest.fixture
def log_records(ktm_records):
    """Records of the package logger (it does not propagate, so caplog misses them)."""
    return ktm_records


def _messages(records, needle):
    return [r.getMessage() for r in records if needle in r.getMessage()]


def _assert_no_crash_notice(records):
    assert not _messages(records, "switched off"), _messages(records, "switched off")


def _mlp(units=1024, inputs=64, depth=1):
    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(units, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(10)]
    return keras.Sequential(layers)


def _compile(model, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


def _ds(x, y, batch=BATCH, drop_remainder=True):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=drop_remainder)


def _timeline(log_dir, subdir):
    with open(os.path.join(log_dir, subdir, "timeline.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _scalar_tags(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _text(accumulator, tag) -> str:
    """The text of a TensorBoard text summary (Text tab) as TensorBoard decodes it."""
    (event,) = accumulator.Tensors(tag)
    return b"".join(event.tensor_proto.string_val).decode("utf-8")


class _BatchLogs(keras.callbacks.Callback):
    """Placed after the monitors: records what later callbacks see in the logs."""

    def __init__(self):
        super().__init__()
        self.batch_keys = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_keys.append(set(logs or {}))


# ------------------------------------------------------------- arguments
@pytest.mark.parametrize("kwargs, error, text", [
    ({"every_n_steps": 0}, ValueError, "every_n_steps"),
    ({"every_n_steps": 1.5}, TypeError, "every_n_steps"),
    ({"every_n_steps": True}, TypeError, "every_n_steps"),
    ({"warn_headroom": 1.0}, ValueError, "[0, 1)"),
    ({"warn_headroom": -0.1}, ValueError, "warn_headroom"),
    ({"warn_headroom": "10%"}, TypeError, "warn_headroom"),
    ({"capacity_bytes": 0}, ValueError, "capacity_bytes"),
    ({"capacity_bytes": -5}, ValueError, "capacity_bytes"),
    ({"capacity_bytes": "16GB"}, TypeError, "capacity_bytes"),
    ({"capacity_bytes": 1.5e9}, TypeError, "capacity_bytes"),
    ({"log_dir": 3}, TypeError, "log_dir"),
])
def test_hbm_monitor_rejects_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=text.replace("[", r"\[").replace(")", r"\)")):
        mon.HBMMonitor(**kwargs)


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


# ------------------------------------------------------------ the matrix
def test_monitors_across_strategies(strategy_case, digits, tmp_path, log_records):
    """Default, jit and MirroredStrategy(2 CPUs): logs, History, TensorBoard, timelines."""
    (x, y), (xv, yv) = digits
    with strategy_case.strategy.scope():
        model = _compile(_mlp(), **strategy_case.compile_kwargs())
    train = _ds(x, y)
    steps_per_epoch = len(x) // BATCH
    later = _BatchLogs()
    hbm = mon.HBMMonitor(tmp_path)
    speed = mon.ThroughputMonitor(tmp_path, warmup_steps=1)
    history = model.fit(
        train, validation_data=_ds(xv, yv, drop_remainder=False), epochs=2, verbose=0,
        callbacks=[hbm, speed, later, keras.callbacks.TensorBoard(str(tmp_path))],
    )
    logs = history.history
    _assert_no_crash_notice(log_records)

    # History: every epoch has a positive memory peak, the validation peak and the rates.
    assert len(logs["hbm_peak_gib"]) == 2 and min(logs["hbm_peak_gib"]) > 0
    assert min(logs["hbm_current_gib"]) > 0
    assert min(logs["val_hbm_peak_gib"]) > 0
    assert "hbm_utilization" not in logs  # CPU: capacity unknown unless given
    assert all(v > 0 and math.isfinite(v) for v in logs["samples_per_sec"])
    assert logs["first_step_s"][0] == logs["first_step_s"][1] > 0
    # Batch logs reach the callbacks after the monitors (progress bar, History).
    assert all({"hbm_peak_gib", "samples_per_sec", "step_time_ms"} <= k for k in later.batch_keys)

    # The global batch was read from the data fit iterates (summed over replicas).
    assert speed.summary["batch_size"] == BATCH
    assert model.train_function is not None
    assert not hasattr(mon, "_BatchSizeProbe")

    # Timelines: one record per execution (steps_per_execution=1), steps 1..2*S.
    memory = _timeline(tmp_path, "ktm_memory")
    steps = [r["step"] for r in memory if r["phase"] != "eval"]
    assert steps == list(range(1, 2 * steps_per_epoch + 1))
    assert [r["phase"] for r in memory[:2]] == ["compile", "train"]
    assert len([r for r in memory if r["phase"] == "eval"]) == 2
    (device,) = memory[0]["devices"]
    assert device == "CPU (shared)"
    assert memory[0]["devices"][device]["shared"] is True
    # The source of every figure: the allocator (oneDNN on), not process-wide.
    assert {r["memory_source"] for r in memory} == {"allocator"}
    assert memory[0]["devices"][device]["source"] == "allocator"
    assert memory[0]["devices"][device]["process_wide"] is False
    assert hbm.memory_sources == {"CPU (shared)": "allocator"}
    assert len(memory[0]["devices"][device]["replicas"]) == strategy_case.num_replicas
    throughput = _timeline(tmp_path, "ktm_throughput")
    assert [r["step"] for r in throughput] == steps
    assert sum(r["samples"] for r in throughput) == 2 * steps_per_epoch * BATCH

    # TensorBoard: our tags in our runs, Keras' own runs untouched beside them.
    memory_events = _scalar_tags(tmp_path / "ktm_memory")
    memory_tags = memory_events.Tags()["scalars"]
    assert {"hbm/CPU_shared/current_gib", "hbm/CPU_shared/peak_gib",
            "hbm_eval/CPU_shared/peak_gib"} <= set(memory_tags)
    assert not [t for t in memory_tags if t.startswith("host_rss")]
    assert "allocator" in _text(memory_events, "memory_source")
    throughput_events = _scalar_tags(tmp_path / "ktm_throughput")
    assert {"throughput/samples_per_sec", "throughput/steps_per_sec", "throughput/step_time_ms",
            "throughput/first_step_s"} <= set(throughput_events.Tags()["scalars"])
    assert len(throughput_events.Scalars("throughput/samples_per_sec")) == len(steps) - 1
    keras_train = _scalar_tags(tmp_path / "train").Tags()
    assert "epoch_loss" in keras_train["tensors"] + keras_train["scalars"]
    assert os.path.isdir(tmp_path / "validation")

    # The end-of-training table names the device, its peak and the step of the peak.
    (table,) = _messages(log_records, "peak memory per device")
    assert "CPU (shared)" in table and "peak at step" in table
    assert "source" in table and "allocator" in table and "host RSS" not in table
    assert len(_messages(log_records, "memory source: CPU (shared) <- allocator")) == 1
    assert devices.format_bytes(hbm.summary["devices"][device]["train_peak_bytes"]) in table


def test_peak_grows_with_the_global_batch(tmp_path):
    """An activation-heavy model: the peak at global batch 1024 exceeds the one at 64."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 64)).astype("float32")
    y = rng.integers(0, 10, 2048).astype("int32")
    peaks = {}
    for batch in (64, 1024):
        model = _compile(_mlp(units=2048, depth=2))
        history = model.fit(_ds(x, y, batch).repeat(), steps_per_epoch=2, epochs=1, verbose=0,
                            callbacks=[mon.HBMMonitor()])
        peaks[batch] = history.history["hbm_peak_gib"][0]
    assert peaks[64] > 0
    # 1024 x 2048 float32 activations are 8 MiB each; at 64 rows they are 0.5 MiB.
    assert peaks[1024] > peaks[64] + 8 / 1024


class _WallClock(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self._start = time.perf_counter()

    def on_train_end(self, logs=None):
        self.seconds = time.perf_counter() - self._start


def test_steps_per_execution_is_counted_per_execution(tmp_path, log_records):
    """steps_per_execution=8 over 20 batches: executions of 8, 8 and 4 steps."""
    rng = np.random.default_rng(1)
    batches = 20
    x = rng.normal(size=(BATCH * batches, 64)).astype("float32")
    y = rng.integers(0, 10, BATCH * batches).astype("int32")
    train = _ds(x, y)
    model = _compile(_mlp(units=2048, depth=2), steps_per_execution=8)
    model.fit(train, epochs=1, verbose=0)  # trace and compile outside the timed runs
    # One monitored run first, so that imports and writer start-up are not in the timing.
    model.fit(train, epochs=1, verbose=0, callbacks=[mon.ThroughputMonitor(tmp_path / "warm")])

    errors = []
    for attempt in range(3):  # the machine is shared: retry a run that a neighbour slowed
        log_dir = tmp_path / f"run{attempt}"
        base = int(model.optimizer.iterations.numpy())
        # Independent clock: the training's own wall time, from train begin to end
        # (fit's set-up before it, data adapter and callback list, is not training).
        clock = _WallClock()
        callbacks = [clock, mon.HBMMonitor(log_dir), mon.ThroughputMonitor(log_dir, warmup_steps=0)]
        history = model.fit(train, epochs=1, verbose=0, callbacks=callbacks)
        wall = clock.seconds

        # Logged once per execution, with the real number of steps in each.
        memory = _timeline(log_dir, "ktm_memory")
        throughput = _timeline(log_dir, "ktm_throughput")
        assert [r["step"] - base for r in memory] == [8, 16, 20]
        assert [r["step"] - base for r in throughput] == [8, 16, 20]
        assert [r["steps"] for r in throughput] == [8, 8, 4]
        assert sum(r["samples"] for r in throughput) == BATCH * batches

        # samples/s equals samples seen / wall time around fit, within 5%.
        reference = BATCH * batches / wall
        errors.append(abs(history.history["samples_per_sec"][0] / reference - 1))
        if errors[-1] < 0.05:
            break
    assert min(errors) < 0.05, errors
    _assert_no_crash_notice(log_records)


def test_small_capacity_warns_exactly_once(digits, log_records):
    (x, y), _ = digits
    model = _compile(_mlp())
    history = model.fit(_ds(x, y), epochs=2, verbose=0,
                        callbacks=[mon.HBMMonitor(capacity_bytes=512 * 1024)])
    warnings = _messages(log_records, "headroom on")
    assert len(warnings) == 1
    (message,) = warnings
    assert "CPU (shared)" in message and "512.00 KiB" in message and "MiB" in message
    assert "GradientAccumulation(steps=" in message and "MixedBFloat16" in message
    assert "step 1" in message
    assert min(history.history["hbm_utilization"]) > 1.0  # peak above the given capacity

    log_records.clear()
    roomy = model.fit(_ds(x, y), epochs=1, verbose=0,
                      callbacks=[mon.HBMMonitor(capacity_bytes=64 * 1024**3)])
    assert not _messages(log_records, "headroom on")
    assert 0 < roomy.history["hbm_utilization"][0] < 0.01


def _fit_with_onednn_off(tmp_path, batch):
    """Runs tests/host_rss_workload.py in a fresh process with TF_ENABLE_ONEDNN_OPTS=0."""
    log_dir = tmp_path / f"logs{batch}"
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, str(host_rss_workload.__file__), "tensorflow",
                           str(batch), str(log_dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), done.stderr, log_dir


def test_host_rss_fallback_when_the_allocator_keeps_no_statistics(tmp_path):
    """TF_ENABLE_ONEDNN_OPTS=0 (AMD/AVX2's default): memory from the process's RSS, named so.

    The peak grows with the batch (tests/host_rss_workload.py says by how
    much and why each batch size runs in a fresh process).
    """
    small, stderr, log_dir = _fit_with_onednn_off(tmp_path, 64)
    big, _, _ = _fit_with_onednn_off(tmp_path, 4096)

    history = small["history"]
    # The History keys stay as they are, with host-RSS figures in them.
    assert len(history["hbm_peak_gib"]) == 2 and min(history["hbm_peak_gib"]) > 0
    assert min(history["val_hbm_peak_gib"]) > 0 and "samples_per_sec" in history
    # Reference: the process's own RSS before fit; training only adds to it.
    assert min(history["hbm_peak_gib"]) * devices.GIB >= 0.9 * small["rss_before"]
    peak_small = max(history["hbm_peak_gib"]) * devices.GIB
    peak_big = max(big["history"]["hbm_peak_gib"]) * devices.GIB
    assert peak_big - peak_small > host_rss_workload.activation_bytes(4096), (peak_small, peak_big)

    # Said once, and named in the data: summary, timeline, TensorBoard, table.
    notices = [ln for ln in stderr.splitlines() if "memory source: host RSS" in ln]
    assert len(notices) == 1, stderr[-3000:]
    assert "TF_ENABLE_ONEDNN_OPTS=0" in notices[0] and "not HBM" in notices[0]
    assert "cannot read memory" not in stderr and "switched off" not in stderr
    table = stderr[stderr.index("peak memory per device"):]
    assert "CPU (process RSS)" in table and "host RSS (process)" in table
    summary = small["summary"]
    assert summary["memory_sources"] == {"CPU (process RSS)": "host_rss"}
    info = summary["devices"]["CPU (process RSS)"]
    assert info["process_wide"] is True and info["source"] == "host_rss"
    assert "VmHWM" in summary["host_rss_peak"] or "between steps" in summary["host_rss_peak"]
    memory = _timeline(log_dir, "ktm_memory")
    assert {r["memory_source"] for r in memory} == {"host_rss"}
    for record in memory:
        (reading,) = record["devices"].values()
        assert reading["source"] == "host_rss" and reading["process_wide"] is True
        assert reading["peak_bytes"] >= reading["current_bytes"] > 0
    events = _scalar_tags(log_dir / "ktm_memory")
    tags = set(events.Tags()["scalars"])
    assert {"host_rss/process/current_gib", "host_rss/process/peak_gib",
            "host_rss_eval/process/peak_gib"} <= tags
    assert not [t for t in tags if t.startswith("hbm")]  # host RSS is never called HBM
    assert "host_rss" in _text(events, "memory_source")


class _InterruptAt(keras.callbacks.Callback):
    """Simulates a preemption at a given global training batch."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.epoch, self.batch, self._epoch = epoch, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == (self.epoch, self.batch):
            raise RuntimeError("preempted")


def test_resume_with_backup_and_restore_continues_the_timeline(digits, tmp_path, log_records):
    (x, y), _ = digits
    train = _ds(x, y)
    steps_per_epoch = len(x) // BATCH
    log_dir, backup = tmp_path / "logs", tmp_path / "backup"

    def run(extra):
        model = _compile(_mlp())
        callbacks = [keras.callbacks.BackupAndRestore(str(backup)), mon.HBMMonitor(log_dir),
                     mon.ThroughputMonitor(log_dir)] + extra
        return model.fit(train, epochs=3, verbose=0, callbacks=callbacks)

    with pytest.raises(RuntimeError, match="preempted"):
        run([_InterruptAt(epoch=1, batch=3)])  # backed up after epoch 0, lost at step S+4
    # No on_train_end after the crash: the writer thread still puts the records
    # on disk within about a second.
    path = log_dir / "ktm_memory" / "timeline.jsonl"
    expected = list(range(1, steps_per_epoch + 5))
    deadline = time.monotonic() + 20
    while True:
        before = path.read_text()
        first_attempt = [json.loads(line) for line in before.splitlines()]
        if [r["step"] for r in first_attempt] == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [r["step"] for r in first_attempt] == expected

    run([])  # resumes at epoch 1, from the backed-up step S
    after = path.read_text()
    assert after.startswith(before)  # appended, not clobbered
    for subdir in ("ktm_memory", "ktm_throughput"):
        raw = _timeline(log_dir, subdir)
        second = [r for r in raw if r["attempt"] == 2]
        # The optimizer's restored step counter continues the step axis.
        assert [r["step"] for r in second] == list(range(steps_per_epoch + 1,
                                                         3 * steps_per_epoch + 1))
        # Read as TensorBoard would: the re-trained steps replace the lost ones.
        kept = load_timeline(str(log_dir / subdir / "timeline.jsonl"))
        assert [r["step"] for r in kept] == list(range(1, 3 * steps_per_epoch + 1))
        assert {r["attempt"] for r in kept if r["step"] > steps_per_epoch} == {2}
        events = [f for f in os.listdir(log_dir / subdir) if "tfevents" in f]
        assert len(events) == 2
    _assert_no_crash_notice(log_records)


def test_every_n_steps_logs_on_multiples_and_the_epoch_tail(digits, tmp_path, capsys):
    (x, y), _ = digits
    model = _compile(_mlp())
    steps_per_epoch = len(x) // BATCH  # 11
    model.fit(_ds(x, y), epochs=1, verbose=1, callbacks=[
        mon.HBMMonitor(tmp_path, every_n_steps=3), mon.ThroughputMonitor(tmp_path, every_n_steps=3)
    ])
    expected = [1, 3, 6, 9, steps_per_epoch]
    assert [r["step"] for r in _timeline(tmp_path, "ktm_memory")] == expected
    throughput = _timeline(tmp_path, "ktm_throughput")
    assert [r["step"] for r in throughput] == expected
    assert sum(r["steps"] for r in throughput) == steps_per_epoch
    out = capsys.readouterr().out
    assert "hbm_peak_gib" in out and "samples_per_sec" in out  # in the progress bar


def test_an_unexpected_error_switches_the_monitor_off_and_training_goes_on(
        digits, monkeypatch, log_records):
    (x, y), _ = digits
    calls = {"n": 0}
    real = devices.read_memory

    def flaky(device):
        calls["n"] += 1
        if calls["n"] > 4:
            raise OSError("driver went away")
        return real(device)

    monkeypatch.setattr(devices, "read_memory", flaky)
    model = _compile(_mlp())
    history = model.fit(_ds(x, y), epochs=2, verbose=0, callbacks=[mon.HBMMonitor()])
    assert len(history.history["loss"]) == 2
    notices = _messages(log_records, "switched off")
    assert len(notices) == 1 and "driver went away" in notices[0]


def test_standalone_evaluate_logs_an_eval_record(digits, tmp_path, log_records):
    (x, y), (xv, yv) = digits
    model = _compile(_mlp())
    model.fit(_ds(x, y).take(2), epochs=1, verbose=0)
    model.evaluate(_ds(xv, yv), verbose=0, callbacks=[mon.HBMMonitor(tmp_path)])
    (record,) = _timeline(tmp_path, "ktm_memory")
    assert record["phase"] == "eval" and record["step"] == 2
    assert record["devices"]["CPU (shared)"]["peak_bytes"] > 0
    assert _messages(log_records, "HBMMonitor (evaluate)")
    _assert_no_crash_notice(log_records)


def test_remote_log_dir_through_tf_io_gfile(digits):
    """gs:// and other object stores cannot append: the timeline is rewritten whole."""
    (x, y), _ = digits
    model = _compile(_mlp())
    log_dir = "ram://ktm_test_remote/logs"
    for _ in range(2):
        model.fit(_ds(x, y).take(3), epochs=1, verbose=0,
                  callbacks=[mon.HBMMonitor(log_dir), mon.ThroughputMonitor(log_dir)])
    for subdir in ("ktm_memory", "ktm_throughput"):
        with tf.io.gfile.GFile(f"{log_dir}/{subdir}/timeline.jsonl") as f:
            records = [json.loads(line) for line in f.read().splitlines()]
        assert [(r["step"], r["attempt"]) for r in records] == [
            (1, 1), (2, 1), (3, 1), (4, 2), (5, 2), (6, 2)]
        with tf.io.gfile.GFile(f"{log_dir}/{subdir}/summary.json") as f:
            assert isinstance(json.loads(f.read()), dict)
        assert any("tfevents" in name for name in tf.io.gfile.listdir(f"{log_dir}/{subdir}"))


# ------------------------------------------------------------ batch sizes
def test_batch_size_from_arrays_or_argument(log_records):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(512, 64)).astype("float32")
    y = rng.integers(0, 10, 512).astype("int32")
    model = _compile(_mlp())
    speed = mon.ThroughputMonitor()
    model.fit(x, y, batch_size=128, epochs=1, verbose=0, callbacks=[speed])
    assert speed.summary["batch_size"] == 128  # 512 rows: every batch has a static 128

    unknown = mon.ThroughputMonitor()
    history = model.fit(x[:500], y[:500], batch_size=128, epochs=1, verbose=0,
                        callbacks=[unknown])  # the last batch holds 116 rows: not static
    assert unknown.summary["batch_size"] is None
    assert "samples_per_sec" not in history.history and "steps_per_sec" in history.history
    assert len(_messages(log_records, "pass batch_size=")) == 1

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
    x = rng.normal(size=(BATCH * 4, 64)).astype("float32")
    y = rng.integers(0, 10, BATCH * 4).astype("int32")
    model = _WatchedSequential([keras.Input((64,)), keras.layers.Dense(32),
                                keras.layers.Dense(10)], name="watched")
    _compile(model)
    speed = mon.ThroughputMonitor()
    callbacks = [speed] + ([ktm.GradientAccumulation(steps=2)] if with_engine_feature else [])
    model.fit(_ds(x, y), epochs=1, verbose=0, callbacks=callbacks)
    assert speed.summary["batch_size"] == BATCH  # from the engine's first-batch hook
    writers = model.__dict__.get("_train_function_writers", [])
    assert not [w for w in writers if w and w.startswith("keras_tpu_mem.monitoring")], writers
    assert all(w.startswith(("keras", "keras_tpu_mem.engine")) for w in writers if w), writers


# ----------------------------------------------------------- input pipeline
def _slow_batches(delay_s, batches, batch=4):
    def slow(i):
        time.sleep(delay_s)
        return np.full((batch, 64), 0.5, "float32"), np.zeros((batch,), "int32")

    def py(i):
        x, y = tf.numpy_function(slow, [i], (tf.float32, tf.int32))
        return tf.ensure_shape(x, (batch, 64)), tf.ensure_shape(y, (batch,))

    return tf.data.Dataset.range(batches).map(py)


def test_measure_input_rate_counts_batches_and_samples():
    rate = mon.measure_input_rate(_slow_batches(0.01, 8), batches=5, warmup_batches=1)
    assert rate.batches == 5 and rate.batch_size == 4
    assert rate.batches_per_sec < 100  # each batch sleeps 10 ms: it cannot be faster
    assert rate.samples_per_sec == pytest.approx(4 * rate.batches_per_sec)


def test_input_verdict_thresholds():
    assert mon.input_verdict(100.0, 105.0)[0] == "input"
    assert mon.input_verdict(100.0, 150.0)[0] == "balanced"
    assert mon.input_verdict(100.0, 900.0)[0] == "compute"
    assert "9.00x" in mon.input_verdict(100.0, 900.0)[1]


def test_throughput_monitor_names_the_bottleneck(tmp_path, log_records):
    # A pipeline that sleeps 25 ms per batch feeding a tiny model: input-bound.
    slow = _slow_batches(0.025, 12)
    model = _compile(_mlp(units=32))
    speed = mon.ThroughputMonitor(tmp_path / "slow", dataset=slow, warmup_steps=1)
    model.fit(slow, epochs=1, verbose=0, callbacks=[speed])
    assert speed.summary["bottleneck"] == "input", speed.summary
    assert speed.summary["batch_size"] == 4

    # An in-memory pipeline feeding a heavier step: compute-bound.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH * 12, 64)).astype("float32")
    fast = _ds(x, rng.integers(0, 10, BATCH * 12).astype("int32"))
    model = _compile(_mlp(units=2048))
    speed = mon.ThroughputMonitor(tmp_path / "fast", dataset=fast, warmup_steps=1)
    model.fit(fast, epochs=1, verbose=0, callbacks=[speed])
    assert speed.summary["bottleneck"] == "compute", speed.summary
    verdicts = _messages(log_records, "bottleneck:")
    assert any("input pipeline" in v for v in verdicts) and any("train step" in v
                                                               for v in verdicts)
    tags = _scalar_tags(tmp_path / "fast" / "ktm_throughput").Tags()["scalars"]
    assert "throughput/input_batches_per_sec" in tags


# ------------------------------------------------------------------ devices
def test_devices_and_capacity(mirrored, monkeypatch):
    (shared,) = allocators.resolve_devices(devices.replica_devices(mirrored.strategy))
    assert shared.label == "CPU (shared)" and shared.shared
    assert shared.replicas == ("CPU:0", "CPU:1")
    (default,) = allocators.resolve_devices(devices.replica_devices(tf.distribute.get_strategy()))
    assert default.replicas == ("CPU:0",)
    assert allocators.assign_capacity([shared], None).startswith("unknown")
    assert shared.capacity is None

    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v3-8")
    assert devices.capacity("TPU:0")[0] == 16 * devices.GIB
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    assert devices.capacity("TPU:0")[0] == 16 * devices.GB
    tpu = allocators._Device("TPU:0", ("TPU:0",), ("TPU:0",), shared=False)
    assert "HBM_TABLE" in allocators.assign_capacity([tpu], None)
    assert tpu.capacity == 16 * devices.GB
