"""Reading the monitors' timelines: resumed attempts and training runs (report.timeline)."""

from __future__ import annotations

import json

import keras
import pytest
import tensorflow as tf
from report_timelines import memory_record, throughput_record, write_timeline

from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.devices import format_bytes
from keras_tpu_mem.report import load_timeline, summarize_memory, write_report


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


def test_every_training_run_in_a_folder_is_reported(tmp_path):
    """Three fresh fits into one folder (steps restart at 1); the third was resumed once."""
    memory, throughput = [], []
    peaks = {1: 300, 2: 500, 3: 200}
    for attempt, begin in ((1, 0), (2, 0), (3, 0), (4, 2)):  # 4 resumes 3 from step 2
        run = min(attempt, 3)
        for step in range(begin + 1, begin + 4):
            phase = "compile" if step == begin + 1 else "train"
            peak = peaks[run] + (50 if attempt == 4 else 0)
            memory.append(memory_record(step, attempt, peak, begin_step=begin, phase=phase))
            throughput.append(throughput_record(step, attempt, begin_step=begin, phase=phase,
                                                 seconds=0.01 * run))
    write_timeline(tmp_path / "ktm_memory" / "timeline.jsonl", memory)
    write_timeline(tmp_path / "ktm_throughput" / "timeline.jsonl", throughput)

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
