"""The report's table on a JAX allocator's timelines: upper bounds (report.summary)."""

from __future__ import annotations

import json

from keras_tpu_mem.report import summarize_memory, write_report


def test_upper_bounds_of_a_jax_allocator_read_as_such(tmp_path):
    """Timelines from a peak counter that cannot be reset: `<=` where a phase did not raise it."""
    def record(step, phase, peak, exact):
        return {"step": step, "time": float(step), "phase": phase, "epoch": 0, "begin_step": 0,
                "memory_source": "allocator", "attempt": 1, "devices": {"TPU:0": {
                    "current_bytes": 2**30, "peak_bytes": peak, "capacity_bytes": 16 * 2**30,
                    "shared": False, "replicas": ["TPU:0"], "source": "allocator",
                    "process_wide": False, "peak_exact": exact}}}

    gib = 2**30
    records = [record(1, "compile", 6 * gib, True), record(2, "train", 6 * gib, False),
               record(3, "train", 6 * gib, False), record(3, "eval", 6 * gib, False)]
    path = tmp_path / "ktm_memory" / "timeline.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarize_memory(records)["TPU:0"]
    assert summary["peak_exact"] == {"compile": True, "train": False, "eval": False}
    report = write_report(str(tmp_path))
    row = next(ln for ln in report.text.splitlines() if ln.startswith("TPU:0"))
    assert row.split()[2:4] == ["6.00", "GiB"] and row.count("<= 6.00 GiB") == 2
    assert "an upper bound" in report.text
    # TensorFlow's readings carry no peak_exact: exact, as before.
    for r in records:
        r["devices"]["TPU:0"].pop("peak_exact")
    assert summarize_memory(records)["TPU:0"]["peak_exact"] == {
        "compile": True, "train": True, "eval": True}
