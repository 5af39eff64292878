"""The monitors on the JAX backend as a whole: the host-RSS floor in fresh processes,
the run directory's files, and no TensorFlow in a JAX run (issue 16, item 4); resume:
test_monitoring_resume.py (both backends).

Each monitor's own JAX tests are in test_monitoring_hbm_jax.py and
test_monitoring_throughput_jax.py; the device readers' in test_devices_jax.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import host_rss_workload
import monitoring_cases as cases
import pytest

from keras_tpu_mem import _utils, devices
from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.monitoring import _writer


@pytest.mark.slow  # two fresh processes (docs/testing.md: slow)
def test_host_rss_on_jax_cpu_every_epoch_and_growing_with_the_batch(tmp_path):
    """JAX's CPU devices keep no statistics: the process's RSS, named so, every epoch.

    The peak grows with the batch (tests/host_rss_workload.py says by how
    much and why each batch size runs in a fresh process).
    """
    small, stderr, log_dir = cases.run_host_rss_workload(tmp_path, 64)
    big, _, _ = cases.run_host_rss_workload(tmp_path, 4096)
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
    memory = cases.read_timeline(log_dir, "ktm_memory")
    assert [r["phase"] for r in memory[:2]] == ["compile", "train"]
    assert {r["memory_source"] for r in memory} == {"host_rss"}
    for record in memory:
        (reading,) = record["devices"].values()
        assert reading["source"] == "host_rss" and reading["process_wide"] is True
        assert reading["peak_bytes"] >= reading["current_bytes"] > 0
        assert "peak_exact" not in reading
    if cases.HAS_TENSORBOARD:
        tags = set(cases.event_accumulator(log_dir / "ktm_memory").Tags()["scalars"])
        assert {"host_rss/process/current_gib", "host_rss/process/peak_gib",
                "host_rss_eval/process/peak_gib"} <= tags
        assert not [t for t in tags if t.startswith("hbm")]


def test_without_tensorboard_the_timeline_is_still_written(tmp_path, monkeypatch, ktm_records):
    monkeypatch.setattr(_writer, "_event_writer_class", lambda: None)
    monkeypatch.setattr(_utils, "_LOGGED", set())
    x, y = cases.random_data(128)
    model = cases.compile_model(cases.small_mlp())
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[mon.HBMMonitor(tmp_path), mon.ThroughputMonitor(tmp_path)])
    cases.assert_no_crash(ktm_records)
    for subdir in ("ktm_memory", "ktm_throughput"):
        assert [r["step"] for r in cases.read_timeline(tmp_path, subdir)] == [1, 2, 3, 4]
        assert os.path.exists(tmp_path / subdir / "summary.json")
        assert not [f for f in os.listdir(tmp_path / subdir) if "tfevents" in f]
    notices = cases.log_messages(ktm_records, "`tensorboard` package is not installed")
    assert len(notices) == 1 and "pip install tensorboard" in notices[0]


def test_a_remote_log_dir_that_no_file_system_writes_is_refused_up_front():
    # On JAX remote paths go through fsspec (never TensorFlow): a scheme it does not know
    # is refused before the fit, naming it.
    with pytest.raises(ValueError, match="fsspec cannot write nosuchfs:// paths"):
        mon.HBMMonitor("nosuchfs://bucket/logs")


def test_a_remote_log_dir_is_written_through_fsspec_without_tensorflow(ktm_records):
    # fsspec's in-memory file system stands in for gs:// (gcsfs): the timeline, the summary
    # and the TensorBoard events reach it.
    fsspec = pytest.importorskip("fsspec")
    x, y = cases.random_data(128)
    model = cases.compile_model(cases.small_mlp())
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[mon.HBMMonitor("memory://ktm-remote/logs")])
    cases.assert_no_crash(ktm_records)
    fs = fsspec.filesystem("memory")
    names = [p.rsplit("/", 1)[-1] for p in fs.ls("/ktm-remote/logs/ktm_memory", detail=False)]
    assert "timeline.jsonl" in names and "summary.json" in names
    assert any(n.startswith("events.out.tfevents.") for n in names)
    with fs.open("/ktm-remote/logs/ktm_memory/timeline.jsonl", "r") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]


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


@pytest.mark.slow  # a fresh process; it proves most with TensorFlow installed
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
