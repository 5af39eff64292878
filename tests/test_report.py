"""`keras-tpu-mem report LOGDIR`: charts and table from the monitors' timelines (issue #7)."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_tpu_mem import cli
from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.devices import format_bytes
from keras_tpu_mem.report import load_timeline, summarize_memory, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


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


def _decode(path):
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    return matplotlib.image.imread(str(path))


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
        image = _decode(path)
        assert image.shape[0] > 300 and image.shape[1] > 600, name
        assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 50, name
        assert _has_color(image, (31, 119, 180)), name  # the data line (blue)
    for name in ("ktm_memory/memory.png", "ktm_report.png"):
        assert _has_color(_decode(charts[name]), (214, 39, 40)), name  # capacity line, peak star


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
    _decode(report.charts[0])


def test_load_timeline_drops_steps_redone_after_a_resume(tmp_path):
    def rec(step, attempt, peak, phase="train"):
        return {"step": step, "phase": phase, "attempt": attempt, "epoch": 0,
                "devices": {"TPU:0": {"current_bytes": 1, "peak_bytes": peak,
                                      "capacity_bytes": 100, "shared": False}}}

    rows = [rec(1, 1, 10, "compile"), rec(2, 1, 20), rec(3, 1, 90), rec(2, 1, 15, "eval"),
            rec(3, 2, 30, "compile"), rec(4, 2, 40)]
    path = tmp_path / "timeline.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "pha'  # crash mid-line
    path.write_text(text)
    kept = load_timeline(str(path))
    assert [(r["step"], r["attempt"]) for r in kept] == [(1, 1), (2, 1), (2, 1), (3, 2), (4, 2)]
    summary = summarize_memory(kept)["TPU:0"]
    # Attempt 1's 90 at step 3 was lost with the preemption; attempt 2 redid step 3.
    assert summary["peak_bytes"] == 40 and summary["peak_step"] == 4
    assert summary["compile_peak_bytes"] == 30 and summary["eval_peak_bytes"] == 15
    assert summary["headroom"] == pytest.approx(0.60)


# ------------------------------------------------------ what a folder holds
def _write_timeline(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _memory_record(step, attempt, peak, *, begin_step, phase="train", epoch=0, t=None,
                   source="allocator", device="TPU:0"):
    return {"step": step, "time": 1000.0 * attempt + step if t is None else t, "phase": phase,
            "epoch": epoch, "attempt": attempt, "begin_step": begin_step,
            "memory_source": source,
            "devices": {device: {"current_bytes": peak // 2, "peak_bytes": peak,
                                 "capacity_bytes": None, "shared": source == "host_rss",
                                 "source": source, "process_wide": source == "host_rss"}}}


def _throughput_record(step, attempt, *, begin_step, phase="train", seconds=0.01, samples=32):
    return {"step": step, "time": 1000.0 * attempt + step, "phase": phase, "epoch": 0,
            "attempt": attempt, "begin_step": begin_step, "steps": 1, "samples": samples,
            "seconds": seconds, "samples_per_sec": samples / seconds,
            "steps_per_sec": 1 / seconds, "step_time_ms": 1000 * seconds}


def test_a_folder_without_memory_says_memory_was_not_recorded(tmp_path):
    run = tmp_path / "run"
    _write_timeline(run / "ktm_throughput" / "timeline.jsonl",
                    [_throughput_record(s, 1, begin_step=0, phase="compile" if s == 1 else "train")
                     for s in (1, 2, 3)])
    text = write_report(str(tmp_path), charts=False).text
    assert "holds: throughput (ktm_throughput/)" in text
    assert "memory: not recorded - no ktm_memory/timeline.jsonl in this folder" in text
    assert "HBMMonitor(log_dir)" in text

    only_memory = tmp_path / "other"
    _write_timeline(only_memory / "ktm_memory" / "timeline.jsonl",
                    [_memory_record(1, 1, 100, begin_step=0, phase="compile")])
    report = write_report(str(tmp_path), charts=False)
    block = report.text[report.text.index(f"run folder: {only_memory}"):]
    assert "throughput: not recorded - no ktm_throughput/timeline.jsonl" in block
    assert report.runs[str(only_memory)]["has_throughput"] is False


def test_every_training_run_in_a_folder_is_reported(tmp_path):
    """Three fresh fits into one folder (steps restart at 1); the third was resumed once."""
    memory, throughput = [], []
    peaks = {1: 300, 2: 500, 3: 200}
    for attempt, begin in ((1, 0), (2, 0), (3, 0), (4, 2)):  # 4 resumes 3 from step 2
        run = min(attempt, 3)
        for step in range(begin + 1, begin + 4):
            phase = "compile" if step == begin + 1 else "train"
            peak = peaks[run] + (50 if attempt == 4 else 0)
            memory.append(_memory_record(step, attempt, peak, begin_step=begin, phase=phase))
            throughput.append(_throughput_record(step, attempt, begin_step=begin, phase=phase,
                                                 seconds=0.01 * run))
    _write_timeline(tmp_path / "ktm_memory" / "timeline.jsonl", memory)
    _write_timeline(tmp_path / "ktm_throughput" / "timeline.jsonl", throughput)

    report = write_report(str(tmp_path), charts=False)
    text = report.text
    assert "3 training runs in this folder" in text
    table = text[text.index("run  fit attempts"):].splitlines()
    assert table[1].split()[:3] == ["1", "1", "1-3"]
    assert table[2].split()[:3] == ["2", "2", "1-3"]
    assert table[3].split()[:4] == ["3", "3,", "4", "1-5"]  # attempts 3 and 4: one run
    assert format_bytes(500) in table[2] and format_bytes(250) in table[3]
    assert "training run 3 of 3, the latest" in text and "run=N" in text
    (info,) = report.runs.values()
    assert [r["attempts"] for r in info["training_runs"]] == [[1], [2], [3, 4]]
    # Details of the latest: attempt 4 replaced attempt 3's step 3.
    assert info["memory"]["TPU:0"]["peak_bytes"] == 250
    assert info["memory"]["TPU:0"]["peak_step"] == 3

    second = write_report(str(tmp_path), charts=False, run=2)
    assert "training run 2 of 3: fit attempt 2, steps 1-3" in second.text
    assert second.runs[str(tmp_path)]["memory"]["TPU:0"]["peak_bytes"] == 500

    every = write_report(str(tmp_path), run="all")
    names = sorted(p.rsplit("/", 1)[-1] for p in every.charts)
    assert names == sorted(["memory_run1.png", "memory_run2.png", "memory.png",
                            "throughput_run1.png", "throughput_run2.png", "throughput.png",
                            "ktm_report_run1.png", "ktm_report_run2.png", "ktm_report.png"])
    for n in (1, 2, 3):
        assert f"training run {n} of 3" in every.text


@pytest.mark.parametrize("run, error, words", [
    (0, ValueError, "int >= 1"), ("first", TypeError, "`run`"), (True, TypeError, "`run`"),
    (9, ValueError, "the most is 1"),
])
def test_report_rejects_a_bad_run(tmp_path, run, error, words):
    _write_timeline(tmp_path / "ktm_memory" / "timeline.jsonl",
                    [_memory_record(1, 1, 100, begin_step=0, phase="compile")])
    with pytest.raises(error, match=words):
        write_report(str(tmp_path), charts=False, run=run)


def test_two_real_fits_of_fresh_models_are_two_training_runs(tmp_path, digits):
    (x, y), _ = digits
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(128, drop_remainder=True).take(3)
    for units in (1024, 2048):
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(units, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(train, epochs=1, verbose=0,
                  callbacks=[mon.HBMMonitor(tmp_path), mon.ThroughputMonitor(tmp_path)])
    model.fit(train, epochs=1, verbose=0,  # the same model again: continues run 2
              callbacks=[mon.HBMMonitor(tmp_path), mon.ThroughputMonitor(tmp_path)])
    report = write_report(str(tmp_path), charts=False)
    (info,) = report.runs.values()
    assert [r["attempts"] for r in info["training_runs"]] == [[1], [2, 3]]
    assert "2 training runs in this folder" in report.text
    assert "training run 2 of 2: fit attempts 2, 3, steps 1-6" in report.text


def test_host_rss_figures_are_named_in_the_table_and_chart(tmp_path):
    records = [_memory_record(s, 1, 800 * 2**20 + s * 2**20, begin_step=0, source="host_rss",
                              device="CPU (process RSS)", phase="compile" if s == 1 else "train")
               for s in (1, 2, 3)]
    _write_timeline(tmp_path / "ktm_memory" / "timeline.jsonl", records)
    report = write_report(str(tmp_path))
    row = next(ln for ln in report.text.splitlines() if ln.startswith("CPU (process RSS)"))
    assert "host RSS (process)" in row and "[shared]" not in row
    assert "not HBM" in report.text
    info = report.runs[str(tmp_path)]["memory"]["CPU (process RSS)"]
    assert info["source"] == "host_rss" and info["process_wide"] is True
    _decode(report.charts[0])

    # Timelines written before sources were recorded read as allocator figures.
    old = [{k: v for k, v in r.items() if k != "memory_source"} for r in records]
    for r in old:
        for reading in r["devices"].values():
            reading.pop("source"), reading.pop("process_wide")
    assert summarize_memory(old)["CPU (process RSS)"]["source"] == "allocator"


# -------------------------------------------------------- readable charts
def _epoch_labels(n_epochs, steps_per_epoch=5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from keras_tpu_mem import report as report_module

    records = [_memory_record(e * steps_per_epoch + s, 1, 100 + s, begin_step=0, epoch=e,
                              phase="compile" if e == s == 0 else "train")
               for e in range(n_epochs) for s in range(1, steps_per_epoch + 1)]
    fig, (ax,) = report_module._figure(1, 4.2)
    canvas = FigureCanvasAgg(fig)
    report_module._plot_memory(ax, records, summarize_memory(records))
    canvas.draw()
    renderer = canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_text().startswith(" epoch")]
    return [t.get_text().strip() for t in labels], [t.get_window_extent(renderer) for t in labels]


@pytest.mark.parametrize("n_epochs", [3, 30, 400])
def test_epoch_labels_stay_readable_at_any_number_of_epochs(n_epochs):
    texts, boxes = _epoch_labels(n_epochs)
    assert 1 <= len(texts) <= 8
    if n_epochs == 3:
        assert texts == ["epoch 2", "epoch 3"]  # few epochs: every boundary labelled
    for a, b in zip(boxes, boxes[1:]):
        assert a.x1 < b.x0, (texts, a, b)  # no two labels touch
