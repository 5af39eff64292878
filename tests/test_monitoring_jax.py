"""The monitors on the JAX backend as a whole: the run directory's files, and no
TensorFlow in a JAX run (issue 16, item 4). On both backends: the host-RSS floor in fresh
processes (test_monitoring_host_rss.py), resume (test_monitoring_resume.py).

Each monitor's own JAX tests are in test_monitoring_hbm_jax.py and
test_monitoring_throughput_jax.py; the device readers' in test_devices_jax.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import monitoring_cases as cases
import pytest

from keras_tpu_mem import _utils
from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.monitoring import _writer


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
