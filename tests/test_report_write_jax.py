"""`keras-tpu-mem report` on the log folder of a JAX run (issue 16, item 4).

The report only reads files: the same code reads TensorFlow and JAX
timelines, and it loads no framework (checked in a fresh process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from helpers import make_distribution, scope

from keras_tpu_mem import cli, devices
from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.devices import format_bytes
from keras_tpu_mem.report import write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DEVICE = "CPU (process RSS)"


def _fit(log_dir, distribution=None, epochs=2, **hbm_kwargs):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype("float32")
    y = rng.integers(0, 8, 512).astype("int32")
    with scope(distribution):
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(8)])
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=64, epochs=epochs, verbose=0,
                  validation_data=(x[:128], y[:128]), callbacks=[
                      mon.HBMMonitor(log_dir, **hbm_kwargs),
                      mon.ThroughputMonitor(log_dir, dataset=(x, y), batch_size=64)])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real JAX run under DataParallel(8): host RSS, with a given capacity, both monitors."""
    keras.utils.set_random_seed(0)
    log_dir = tmp_path_factory.mktemp("report_jax") / "logs"
    _fit(log_dir, make_distribution("dp8"), capacity_bytes=4 * devices.GIB)
    return log_dir


def _raw(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_report_command_on_a_jax_run(run_dir, capsys):
    assert cli.main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    # The table agrees with an independent pass over the raw timeline.
    memory = _raw(run_dir / "ktm_memory" / "timeline.jsonl")
    peaks = {phase: max(r["devices"][DEVICE]["peak_bytes"] for r in memory if r["phase"] == phase)
             for phase in ("compile", "train", "eval")}
    row = next(line for line in out.splitlines() if line.startswith(DEVICE))
    assert "host RSS (process)" in row and "4.00 GiB" in row
    for phase in ("compile", "train", "eval"):
        assert format_bytes(peaks[phase]) in row
    assert "not HBM" in out and "<= " not in row  # host RSS peaks are reset per phase
    throughput = _raw(run_dir / "ktm_throughput" / "timeline.jsonl")
    train = [r for r in throughput if r["phase"] == "train"]
    samples_per_sec = sum(r["samples"] for r in train) / sum(r["seconds"] for r in train)
    assert f"{samples_per_sec:,.1f}" in out
    assert "bottleneck:" in out
    for name in ("ktm_memory/memory.png", "ktm_throughput/throughput.png", "ktm_report.png"):
        path = run_dir / name
        assert str(path) in out
        with open(path, "rb") as f:
            assert f.read(8) == PNG_SIGNATURE


def test_report_summary_matches_the_jax_monitor(run_dir):
    report = write_report(str(run_dir), charts=False)
    (summary,) = report.runs.values()
    info = summary["memory"][DEVICE]
    expected = json.loads((run_dir / "ktm_memory" / "summary.json").read_text())["devices"][DEVICE]
    for key in ("compile_peak_bytes", "train_peak_bytes", "eval_peak_bytes", "capacity_bytes"):
        assert info[key] == expected[key], key
    assert info["source"] == "host_rss" and info["process_wide"] is True
    assert expected["replicas"] == [f"CPU:{i}" for i in range(8)]
    assert summary["throughput"]["samples"] == 2 * 8 * 64 - 2 * 64  # 2 warm-up steps


def test_the_report_loads_no_framework(run_dir):
    """Reading a JAX run's files needs neither Keras, JAX nor TensorFlow."""
    script = textwrap.dedent(f"""
        import json, sys
        from keras_tpu_mem.report import write_report
        text = write_report({str(run_dir)!r}, charts=True).text
        print("RESULT " + json.dumps({{"loaded": [m for m in ("keras", "jax", "tensorflow")
                                                   if m in sys.modules],
                                      "table": {DEVICE!r} in text}}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert json.loads(line[len("RESULT "):]) == {"loaded": [], "table": True}
