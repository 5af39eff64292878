"""`keras-tpu-mem report LOGDIR` and `write_report`: charts and table from the
monitors' timelines (issue #7)."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from report_timelines import decode, memory_record, write_timeline

from keras_tpu_mem import cli
from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.devices import format_bytes
from keras_tpu_mem.report import write_report


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, digits):
    """A real two-epoch run with validation, a given capacity and a timed input pipeline."""
    keras.utils.set_random_seed(0)
    (x, y), (xv, yv) = digits
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(128, drop_remainder=True)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    log_dir = tmp_path_factory.mktemp("report") / "logs"
    model.fit(train, validation_data=(xv, yv), epochs=2, verbose=0, callbacks=[
        mon.HBMMonitor(log_dir, capacity_bytes=8 * 1024**2),
        mon.ThroughputMonitor(log_dir, dataset=train, warmup_steps=2),
    ])
    return log_dir


def _raw(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _has_color(image, rgb, tolerance=0.06):
    target = np.array(rgb) / 255.0
    return bool(np.any(np.all(np.abs(image[..., :3] - target) < tolerance, axis=-1)))


def test_report_command_writes_pngs_and_a_table(run_dir, capsys):
    assert cli.main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out

    # The table's numbers agree with an independent pass over the raw timeline.
    memory = _raw(run_dir / "ktm_memory" / "timeline.jsonl")
    peaks = [r["devices"]["CPU (shared)"]["peak_bytes"] for r in memory]
    best = max(peaks)
    step = memory[peaks.index(best)]["step"]
    eval_peak = max(r["devices"]["CPU (shared)"]["peak_bytes"]
                    for r in memory if r["phase"] == "eval")
    row = next(line for line in out.splitlines() if line.startswith("CPU (shared)"))
    assert format_bytes(eval_peak) in row and "8.00 MiB" in row
    assert f"{100 * (1 - best / (8 * 1024**2)):.1f}%" in row
    assert f"{step} (" in row
    throughput = _raw(run_dir / "ktm_throughput" / "timeline.jsonl")
    train = [r for r in throughput if r["phase"] == "train"]
    samples_per_sec = sum(r["samples"] for r in train) / sum(r["seconds"] for r in train)
    assert f"{samples_per_sec:,.1f}" in out
    assert "bottleneck:" in out and "first execution" in out

    # Three charts, each a decodable PNG with real content drawn in the chart colours.
    charts = {name: run_dir / name for name in
              ("ktm_memory/memory.png", "ktm_throughput/throughput.png", "ktm_report.png")}
    for name, path in charts.items():
        assert str(path) in out
        image = decode(path)
        assert image.shape[0] > 300 and image.shape[1] > 600, name
        assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 50, name
        assert _has_color(image, (31, 119, 180)), name  # the data line (blue)
    for name in ("ktm_memory/memory.png", "ktm_report.png"):
        assert _has_color(decode(charts[name]), (214, 39, 40)), name  # capacity line, peak star


def test_report_summary_matches_the_monitor(run_dir):
    report = write_report(str(run_dir), charts=False)
    assert report.charts == []
    (summary,) = report.runs.values()
    info = summary["memory"]["CPU (shared)"]
    monitor_summary = json.loads((run_dir / "ktm_memory" / "summary.json").read_text())
    expected = monitor_summary["devices"]["CPU (shared)"]
    assert info["train_peak_bytes"] == expected["train_peak_bytes"]
    assert info["eval_peak_bytes"] == expected["eval_peak_bytes"]
    assert info["capacity_bytes"] == 8 * 1024**2
    assert summary["throughput"]["bottleneck"] in ("input", "balanced", "compute")


def test_report_without_timelines_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "No monitor timeline" in err and "ktm_memory" in err
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_report_finds_runs_below_logdir_and_handles_one_monitor(tmp_path):
    lines = [{"step": s, "time": 0.0, "phase": "compile" if s == 1 else "train", "epoch": 0,
              "steps": 1, "samples": None, "seconds": 0.01, "samples_per_sec": None,
              "steps_per_sec": 100.0, "step_time_ms": 10.0, "attempt": 1} for s in (1, 2, 3)]
    run = tmp_path / "experiment" / "run1" / "ktm_throughput"
    run.mkdir(parents=True)
    (run / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    report = write_report(str(tmp_path))
    assert [p.split("/")[-1] for p in report.charts] == ["throughput.png"]
    assert "steps/s" in report.text and "100.0" in report.text
    decode(report.charts[0])


@pytest.mark.parametrize("run, error, words", [
    (0, ValueError, "int >= 1"), ("first", TypeError, "`run`"), (True, TypeError, "`run`"),
    (9, ValueError, "the most is 1"),
])
def test_report_rejects_a_bad_run(tmp_path, run, error, words):
    write_timeline(tmp_path / "ktm_memory" / "timeline.jsonl",
                    [memory_record(1, 1, 100, begin_step=0, phase="compile")])
    with pytest.raises(error, match=words):
        write_report(str(tmp_path), charts=False, run=run)
