"""HBMMonitor, ThroughputMonitor and measure_input_rate on the JAX backend (issue 16, item 4).

The harness gives 8 host CPU devices. JAX's CPU devices keep no memory
statistics (`jax.Device.memory_stats()` is None), so on this machine the
monitor reads the host RSS, named as such; the TPU/GPU path (each device's own
`memory_stats()`, a peak that cannot be reset) is exercised with a stand-in
reader that reports per-device statistics on a known schedule. Nothing here
had a real accelerator.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

import host_rss_workload
import jax
import keras
import numpy as np
import pytest
from helpers_jax import make_distribution, scope

from keras_tpu_mem import backends, devices
from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.monitoring import _allocators as allocators
from keras_tpu_mem.monitoring import _writer

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
needs_tensorboard = pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard not installed")


# ------------------------------------------------------------------ helpers
def _messages(records, needle):
    return [r.getMessage() for r in records if needle in r.getMessage()]


def _no_crash(records):
    assert not _messages(records, "switched off"), _messages(records, "switched off")


def _mlp(units=64, inputs=16, classes=8):
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(units, activation="relu", name="dense_in"),
        keras.layers.Dense(classes, name="dense_out"),
    ])


def _compile(model, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


def _data(n=256, inputs=16, classes=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, inputs)).astype("float32"),
            rng.integers(0, classes, n).astype("int32"))


def _timeline(log_dir, subdir):
    with open(os.path.join(log_dir, subdir, "timeline.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _events(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _mesh_names(distribution):
    """The reference: device names straight from the distribution's mesh."""
    return sorted((f"CPU:{d.id}" for d in np.asarray(distribution.device_mesh.devices).flat),
                  key=lambda n: int(n.split(":")[1]))


# ---------------------------------------- host RSS floor (fresh processes)
def _fit_in_fresh_process(tmp_path, batch):
    """Runs tests/host_rss_workload.py on JAX in a fresh process."""
    log_dir = tmp_path / f"logs{batch}"
    env = dict(os.environ, KERAS_BACKEND="jax")
    done = subprocess.run([sys.executable, str(host_rss_workload.__file__), "jax",
                           str(batch), str(log_dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), done.stderr, log_dir


def test_host_rss_on_jax_cpu_every_epoch_and_growing_with_the_batch(tmp_path):
    """JAX's CPU devices keep no statistics: the process's RSS, named so, every epoch.

    The peak grows with the batch (tests/host_rss_workload.py says by how
    much and why each batch size runs in a fresh process).
    """
    small, stderr, log_dir = _fit_in_fresh_process(tmp_path, 64)
    big, _, _ = _fit_in_fresh_process(tmp_path, 4096)
    assert small["tensorflow"] is False and big["tensorflow"] is False

    history = small["history"]
    assert len(history["hbm_peak_gib"]) == 2 and min(history["hbm_peak_gib"]) > 0
    assert len(big["history"]["hbm_peak_gib"]) == 2 and min(big["history"]["hbm_peak_gib"]) > 0
    assert min(history["val_hbm_peak_gib"]) > 0 and "samples_per_sec" in history
    # Reference: the process's own RSS (psutil) before fit; training only adds to it.
    assert min(history["hbm_peak_gib"]) * devices.GIB >= 0.9 * small["rss_before"]
    peak_small = max(history["hbm_peak_gib"]) * devices.GIB
    peak_big = max(big["history"]["hbm_peak_gib"]) * devices.GIB
    assert peak_big - peak_small > host_rss_workload.activation_bytes(4096), (peak_small, peak_big)

    # Said once, and named in the data: summary, timeline, TensorBoard, table.
    notices = [ln for ln in stderr.splitlines() if "memory source: host RSS" in ln]
    assert len(notices) == 1, stderr[-3000:]
    assert "memory_stats() is None" in notices[0] and "not HBM" in notices[0]
    assert "oneDNN" not in notices[0]
    assert "cannot read memory" not in stderr and "switched off" not in stderr
    table = stderr[stderr.index("peak memory per device"):]
    assert "CPU (process RSS)" in table and "host RSS (process)" in table
    summary = small["summary"]
    assert summary["memory_sources"] == {"CPU (process RSS)": "host_rss"}
    info = summary["devices"]["CPU (process RSS)"]
    assert info["process_wide"] is True and info["source"] == "host_rss"
    assert "peak_exact" not in info  # host RSS: VmHWM is reset per phase, as on TensorFlow
    memory = _timeline(log_dir, "ktm_memory")
    assert [r["phase"] for r in memory[:2]] == ["compile", "train"]
    assert {r["memory_source"] for r in memory} == {"host_rss"}
    for record in memory:
        (reading,) = record["devices"].values()
        assert reading["source"] == "host_rss" and reading["process_wide"] is True
        assert reading["peak_bytes"] >= reading["current_bytes"] > 0
        assert "peak_exact" not in reading
    if HAS_TENSORBOARD:
        tags = set(_events(log_dir / "ktm_memory").Tags()["scalars"])
        assert {"host_rss/process/current_gib", "host_rss/process/peak_gib",
                "host_rss_eval/process/peak_gib"} <= tags
        assert not [t for t in tags if t.startswith("hbm")]


# -------------------------------------------- distributions on host devices
@pytest.mark.parametrize("case", ["dp8", "mp2x4"])
def test_host_devices_of_a_distribution_share_one_process_entry(case, tmp_path, ktm_records):
    distribution = make_distribution(case)
    x, y = _data(512)
    with scope(distribution):
        model = _compile(_mlp())
        hbm = mon.HBMMonitor(tmp_path)
        history = model.fit(x, y, batch_size=64, epochs=2, verbose=0,
                            validation_data=(x[:128], y[:128]), callbacks=[hbm])
    _no_crash(ktm_records)
    assert len(history.history["hbm_peak_gib"]) == 2 and min(history.history["hbm_peak_gib"]) > 0
    memory = _timeline(tmp_path, "ktm_memory")
    assert [r["step"] for r in memory if r["phase"] != "eval"] == list(range(1, 17))
    for record in memory:
        (label,) = record["devices"]
        assert label == "CPU (process RSS)"
        # All 8 host devices of the mesh are listed; they share the host's memory.
        assert record["devices"][label]["replicas"] == _mesh_names(distribution)
    assert hbm.memory_sources == {"CPU (process RSS)": "host_rss"}


# ------------------------------------- TPU/GPU path with a stand-in reader
class _FakeAllocator:
    """Per-device `memory_stats()` on a known schedule, as a TPU/GPU runtime reports them.

    Device `i` holds `base + i MiB` between steps. Its high-water mark (since
    the "process" started, never reset, like JAX's) rises to `first + i MiB`
    during the first step and to `leak + i MiB` at global step `leak_step`; it
    never rises in validation. `bytes_limit` is the capacity.
    """

    MIB = 2**20

    def __init__(self, leak_step):
        self.base, self.first, self.leak = 100 * self.MIB, 300 * self.MIB, 500 * self.MIB
        self.limit = 16 * devices.GIB
        self.leak_step = leak_step
        self.step = 0
        self.peaks: dict[int, int] = {}

    def stats(self, device):
        i = int(device.id)
        self.peaks.setdefault(i, self.base + i * self.MIB)
        return {"bytes_in_use": self.base + i * self.MIB, "peak_bytes_in_use": self.peaks[i],
                "bytes_limit": self.limit}

    def advance(self):  # a training step ran
        self.step += 1
        target = (self.first if self.step < self.leak_step else self.leak)
        for i in range(8):
            self.peaks[i] = max(self.peaks.get(i, 0), target + i * self.MIB)


class _Steps(keras.callbacks.Callback):
    """Placed before the monitor: the fake device "runs" each step first."""

    def __init__(self, fake):
        super().__init__()
        self.fake = fake

    def on_train_batch_end(self, batch, logs=None):
        self.fake.advance()


@pytest.mark.parametrize("case", ["dp8", "mp2x4"])
def test_each_accelerator_device_is_read_on_its_own(case, tmp_path, monkeypatch, ktm_records):
    """Per-device entries, capacity from bytes_limit, phases told apart by the mark."""
    steps_per_epoch = 8
    fake = _FakeAllocator(leak_step=steps_per_epoch + 3)  # rises again in epoch 2
    monkeypatch.setattr(backends.get("jax").devices, "memory_stats", fake.stats)
    distribution = make_distribution(case)
    x, y = _data(64 * steps_per_epoch)
    with scope(distribution):
        model = _compile(_mlp())
        hbm = mon.HBMMonitor(tmp_path, warn_headroom=0.0)
        history = model.fit(x, y, batch_size=64, epochs=2, verbose=0,
                            validation_data=(x[:128], y[:128]), callbacks=[_Steps(fake), hbm])
    _no_crash(ktm_records)
    names = _mesh_names(distribution)
    assert list(hbm.memory_sources) == names
    assert set(hbm.memory_sources.values()) == {"allocator"}

    # Worst device (CPU:7) in the logs; capacity from bytes_limit.
    mib = _FakeAllocator.MIB
    worst_first, worst_leak = fake.first + 7 * mib, fake.leak + 7 * mib
    assert history.history["hbm_peak_gib"] == pytest.approx(
        [worst_first / devices.GIB, worst_leak / devices.GIB])
    assert history.history["hbm_utilization"][1] == pytest.approx(worst_leak / fake.limit)

    memory = _timeline(tmp_path, "ktm_memory")
    train = [r for r in memory if r["phase"] != "eval"]
    assert [r["step"] for r in train] == list(range(1, 2 * steps_per_epoch + 1))
    for record in memory:
        assert sorted(record["devices"], key=lambda n: int(n.split(":")[1])) == names
        for label, reading in record["devices"].items():
            i = int(label.split(":")[1])
            assert reading["current_bytes"] == fake.base + i * mib
            assert reading["capacity_bytes"] == fake.limit
            assert reading["source"] == "allocator" and reading["replicas"] == [label]
            assert reading["shared"] is False and reading["process_wide"] is False
    # The mark: a record's peak (the peak so far in its epoch's phase) is exact from
    # the step that raised the device's high-water mark to the phase's end.
    exact_steps = {r["step"] for r in train if r["devices"]["CPU:0"]["peak_exact"]}
    assert exact_steps == {1, *range(steps_per_epoch + 3, 2 * steps_per_epoch + 1)}
    assert not any(r["devices"]["CPU:0"]["peak_exact"] for r in memory if r["phase"] == "eval")

    info = hbm.summary["devices"]["CPU:3"]
    assert info["compile_peak_bytes"] == fake.first + 3 * mib
    assert info["train_peak_bytes"] == fake.leak + 3 * mib
    assert info["peak_exact"] == {"compile": True, "train": True, "eval": False}
    assert info["capacity_bytes"] == fake.limit and info["peak_step"] == steps_per_epoch + 3
    assert "bytes_limit" in hbm.summary["capacity_source"]
    assert "cannot be reset" in hbm.summary["allocator_peak"]
    (table,) = _messages(ktm_records, "peak memory per device")
    assert "CPU:7" in table and "<= " in table  # evaluation stayed below the mark
    notices = _messages(ktm_records, "HBMMonitor: the peak counter of")
    assert len(notices) == 1 and "jax.Device.memory_stats()" in notices[0]
    assert ", ".join(names) in notices[0]
    assert len(_messages(ktm_records, "<- allocator (jax.Device.memory_stats())")) == 1
    if HAS_TENSORBOARD:
        tags = set(_events(tmp_path / "ktm_memory").Tags()["scalars"])
        assert {f"hbm/{n.replace(':', '_')}/peak_gib" for n in names} <= tags
        assert "hbm/CPU_7/utilization" in tags and "hbm_eval/CPU_0/peak_gib" in tags


def test_a_tpu_without_statistics_is_unreadable_not_host_rss(monkeypatch, ktm_records):
    """Host RSS never stands in for accelerator memory."""

    class Tpu:
        platform, id, device_kind, process_index = "tpu", 0, "TPU v4", 0

        def memory_stats(self):
            return None

    (device,) = allocators.resolve_devices([Tpu()])
    assert device.label == "TPU:0" and not device.shared
    assert devices.memory_source(Tpu()) is None
    assert devices.capacity(Tpu()) == (32 * devices.GIB, "TPU v4 per replica (ktm.HBM_TABLE)")
    reading = devices.read_memory_reading(Tpu())
    assert reading.device == "TPU:0" and reading.source is None and not reading.readable


def test_jax_readers_by_name():
    (first,) = devices.replica_devices()
    assert first == jax.local_devices()[0]
    assert devices.device_name(first) == "CPU:0"
    assert devices.memory_stats(first) is None  # JAX's CPU devices keep none
    assert devices.read_memory(first) is None and devices.reset_peak(first) is False
    assert devices.is_host_device(first) and devices.memory_source(first) == "host_rss"
    mp = make_distribution("mp2x4")
    assert [devices.device_name(d) for d in devices.replica_devices(mp)] == \
        _mesh_names(mp)
    reading = devices.read_memory_reading(first)
    assert reading.source == "host_rss" and reading.process_wide and reading.current_bytes > 0
    # The names these readers had before `keras_tpu_mem.devices` served both backends.
    assert devices.monitored_jax_devices is devices.replica_devices
    assert devices.jax_device_name is devices.device_name
    assert devices.jax_memory_stats is devices.memory_stats
    assert devices.jax_capacity is devices.capacity


class _InterruptAt(keras.callbacks.Callback):
    """Simulates a preemption at a given batch of a given epoch."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.epoch, self.batch, self._epoch = epoch, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == (self.epoch, self.batch):
            raise RuntimeError("preempted")


def test_resume_with_backup_and_restore_continues_the_step_axis(tmp_path, ktm_records):
    x, y = _data(64 * 6)
    log_dir, backup = tmp_path / "logs", tmp_path / "backup"

    def run(extra):
        with scope(make_distribution("dp8")):
            model = _compile(_mlp())
            callbacks = [keras.callbacks.BackupAndRestore(str(backup)), mon.HBMMonitor(log_dir),
                         mon.ThroughputMonitor(log_dir)] + extra
            return model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=callbacks)

    with pytest.raises(RuntimeError, match="preempted"):
        run([_InterruptAt(epoch=1, batch=2)])  # backed up after epoch 0 (6 steps)
    # No on_train_end after the crash: the writer threads still put steps 1..9 on
    # disk within about a second (as a preempted process would have before dying).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(
            os.path.exists(log_dir / d / "timeline.jsonl")
            and [r["step"] for r in _timeline(log_dir, d)] == list(range(1, 10))
            for d in ("ktm_memory", "ktm_throughput")):
        time.sleep(0.2)
    run([])
    _no_crash(ktm_records)
    for subdir in ("ktm_memory", "ktm_throughput"):
        records = [r for r in _timeline(log_dir, subdir) if r.get("phase") != "eval"]
        first = [r["step"] for r in records if r["attempt"] == 1]
        second = [r for r in records if r["attempt"] == 2]
        assert first == list(range(1, 10))
        # The restored optimizer's step counter continues the step axis.
        assert [r["step"] for r in second] == list(range(7, 19))
        assert {r["begin_step"] for r in second} == {6}


def test_standalone_evaluate_logs_one_eval_record(tmp_path, ktm_records):
    x, y = _data(256)
    model = _compile(_mlp())
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=64, verbose=0, callbacks=[mon.HBMMonitor(tmp_path)])
    (record,) = _timeline(tmp_path, "ktm_memory")
    assert record["phase"] == "eval" and record["step"] == 4
    assert record["devices"]["CPU (process RSS)"]["peak_bytes"] > 0
    assert _messages(ktm_records, "HBMMonitor (evaluate)")
    _no_crash(ktm_records)


# --------------------------------------------------------- throughput
class _Batches(keras.utils.PyDataset):
    """A PyDataset of fixed batches; counts the batches read; may sleep per batch."""

    def __init__(self, x, y, batch, delay_s=0.0):
        super().__init__()
        self.x, self.y, self.batch, self.delay_s = x, y, batch, delay_s
        self.reads = 0

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, i):
        self.reads += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        rows = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[rows], self.y[rows]


@pytest.mark.parametrize("case", ["none", "dp8"])
def test_throughput_counts_the_global_batch_from_the_engine(case, tmp_path, ktm_records):
    """steps_per_execution=4 over 9 batches: executions of 4, 4, 1 steps of the global batch."""
    x, y = _data(64 * 9)
    with scope(make_distribution(case)):
        model = _compile(_mlp(), steps_per_execution=4)
        speed = mon.ThroughputMonitor(tmp_path, warmup_steps=0)
        history = model.fit(x, y, batch_size=64, epochs=2, verbose=0,
                            callbacks=[mon.HBMMonitor(tmp_path), speed])
    _no_crash(ktm_records)
    assert [r["step"] for r in _timeline(tmp_path, "ktm_memory")] == [4, 8, 9, 13, 17, 18]
    assert speed.summary["batch_size"] == 64  # the whole global batch, over 8 devices too
    assert "fit iterates" in speed.summary["batch_size_source"]
    throughput = _timeline(tmp_path, "ktm_throughput")
    assert [r["step"] for r in throughput] == [4, 8, 9, 13, 17, 18]
    assert [r["steps"] for r in throughput] == [4, 4, 1, 4, 4, 1]
    assert sum(r["samples"] for r in throughput) == 2 * 9 * 64
    assert history.history["first_step_s"][0] > 0
    assert all(v > 0 for v in history.history["samples_per_sec"])
    if HAS_TENSORBOARD:
        tags = set(_events(tmp_path / "ktm_throughput").Tags()["scalars"])
        assert {"throughput/samples_per_sec", "throughput/first_step_s"} <= tags


def test_throughput_with_a_pydataset_names_the_bottleneck(tmp_path, ktm_records):
    x, y = _data(8 * 12)
    slow = _Batches(x, y, 8, delay_s=0.03)  # 30 ms per batch feeding a tiny model
    model = _compile(_mlp(units=8))
    speed = mon.ThroughputMonitor(tmp_path, dataset=slow, warmup_steps=1, input_batches=6)
    model.fit(slow, epochs=1, verbose=0, callbacks=[speed])
    _no_crash(ktm_records)
    assert speed.summary["batch_size"] == 8  # from the engine: a PyDataset has no static one
    assert speed.summary["bottleneck"] == "input", speed.summary
    assert "PyDataset(workers=" in speed.summary["input_verdict"]
    assert speed.summary["input_batches_timed"] == 6


def test_measure_input_rate_reads_pydatasets_and_arrays():
    x, y = _data(4 * 10)
    batches = _Batches(x, y, 4, delay_s=0.01)
    rate = mon.measure_input_rate(batches, batches=5, warmup_batches=1)
    assert rate.batches == 5 and rate.batch_size == 4 and batches.reads == 6
    assert rate.batches_per_sec < 100  # each batch sleeps 10 ms: it cannot be faster
    assert rate.samples_per_sec == pytest.approx(4 * rate.batches_per_sec)

    # Arrays: consecutive slices of batch_size rows, the last one shorter (40 = 3 x 12 + 4).
    rate = mon.measure_input_rate((x, {"y": y}), batch_size=12, batches=10, warmup_batches=0)
    assert rate.batches == 4 and rate.batch_size == pytest.approx(40 / 4)
    with pytest.raises(TypeError, match="batch_size"):
        mon.measure_input_rate(x)
    with pytest.raises(ValueError, match="arrays only"):
        mon.measure_input_rate(batches, batch_size=4)
    with pytest.raises(TypeError, match="dataset"):
        mon.measure_input_rate([1, 2, 3], batch_size=1)


def test_throughput_monitor_arguments_on_jax():
    x, y = _data(64)
    with pytest.raises(TypeError, match="batch_size="):
        mon.ThroughputMonitor(dataset=(x, y))
    with pytest.raises(TypeError, match="PyDataset"):
        mon.ThroughputMonitor(dataset=iter([x]))
    assert mon.ThroughputMonitor(dataset=(x, y), batch_size=16).dataset is not None


# ------------------------------------------------------------- the writer
def test_without_tensorboard_the_timeline_is_still_written(tmp_path, monkeypatch, ktm_records):
    monkeypatch.setattr(_writer, "_event_writer_class", lambda: None)
    monkeypatch.setattr(_writer, "_NOTICES", set())
    x, y = _data(128)
    model = _compile(_mlp())
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[mon.HBMMonitor(tmp_path), mon.ThroughputMonitor(tmp_path)])
    _no_crash(ktm_records)
    for subdir in ("ktm_memory", "ktm_throughput"):
        assert [r["step"] for r in _timeline(tmp_path, subdir)] == [1, 2, 3, 4]
        assert os.path.exists(tmp_path / subdir / "summary.json")
        assert not [f for f in os.listdir(tmp_path / subdir) if "tfevents" in f]
    notices = _messages(ktm_records, "`tensorboard` package is not installed")
    assert len(notices) == 1 and "pip install tensorboard" in notices[0]


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is not None,
                    reason="TensorFlow is installed: remote paths go through tf.io.gfile")
def test_a_remote_log_dir_without_tensorflow_is_refused_up_front():
    with pytest.raises(ValueError, match="tf.io.gfile"):
        mon.HBMMonitor("gs://bucket/logs")


# ------------------------------------------------- no TensorFlow on JAX
_NO_TF_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    import numpy as np
    import keras_tpu_mem.report as report
    loaded = {"report": sorted(m for m in ("keras", "jax", "tensorflow") if m in sys.modules)}
    import keras
    import keras_tpu_mem.monitoring as mon
    import keras_tpu_mem.profiling as profiling
    log_dir = sys.argv[1]
    x = np.random.default_rng(0).normal(size=(128, 16)).astype("float32")
    y = np.arange(128) % 4
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
        mon.HBMMonitor(log_dir), mon.ThroughputMonitor(log_dir, dataset=(x, y), batch_size=16),
        profiling.ProfileWindow(log_dir, steps=(2, 4), summary=False)])
    text = report.write_report(log_dir, charts=True).text
    print("RESULT " + json.dumps({"loaded": loaded, "tensorflow": "tensorflow" in sys.modules,
                                  "report": "training run" in text}))
""")


def test_monitoring_profiling_and_report_never_import_tensorflow(tmp_path):
    """In a fresh JAX process (TensorFlow may well be installed beside it)."""
    script = tmp_path / "no_tf.py"
    script.write_text(_NO_TF_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, KERAS_BACKEND="jax"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "switched off" not in done.stderr, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["tensorflow"] is False
    # The report only reads files: it loads no framework, not even Keras.
    assert result["loaded"] == {"report": []}
    assert result["report"] is True
