"""The report's numbers and text: per-device peaks, rates, and the tables.

`summarize_memory` and `summarize_throughput` reduce a training run's records
to figures; the rest writes the text `write_report` returns: what a folder
holds, the table of its training runs, and the details of one run.
"""

from __future__ import annotations

from keras_tpu_mem.devices import SOURCE_ALLOCATOR, format_bytes

# `_layout` imports no framework (the package `keras_tpu_mem.monitoring` loads
# its modules lazily), so reading a log folder never starts TensorFlow or JAX.
from keras_tpu_mem.monitoring._layout import (
    MEMORY_SUBDIR,
    THROUGHPUT_SUBDIR,
    TIMELINE_FILE,
    _fmt_bytes,
    format_table,
    source_column,
)
from keras_tpu_mem.report.timeline import MonitoredRun, RunFolder

__all__ = ["summarize_memory", "summarize_throughput"]


def summarize_memory(records: list[dict]) -> dict:
    """Per device: peaks of the first step, training and evaluation, capacity, headroom.

    Returns `{device: {"compile_peak_bytes", "train_peak_bytes", "eval_peak_bytes",
    "capacity_bytes", "headroom", "peak_step", "peak_phase", "peak_bytes", "shared",
    "source", "process_wide", "peak_exact"}}`; the peak step is that of the highest
    reading of any phase. `source` is `"allocator"` or `"host_rss"` (the
    resident memory of the whole process); timelines written before sources
    were recorded are allocator readings. `peak_exact` is `{phase: bool}`:
    False where the phase's peak is only an upper bound (a reading with
    `"peak_exact": false`, from a peak counter that cannot be reset, as on JAX;
    readings without the key are exact).
    """
    result: dict[str, dict] = {}
    for record in records:
        phase = record.get("phase", "train")
        for device, reading in (record.get("devices") or {}).items():
            info = result.setdefault(device, {
                "compile_peak_bytes": None, "train_peak_bytes": None, "eval_peak_bytes": None,
                "capacity_bytes": None, "headroom": None, "peak_step": None,
                "peak_phase": None, "shared": bool(reading.get("shared")),
                "source": reading.get("source") or SOURCE_ALLOCATOR,
                "process_wide": bool(reading.get("process_wide")), "_best": None,
                "peak_exact": {"compile": None, "train": None, "eval": None},
            })
            peak = reading.get("peak_bytes")
            if reading.get("capacity_bytes"):
                info["capacity_bytes"] = reading["capacity_bytes"]
            if peak is None:
                continue
            exact = reading.get("peak_exact", True) is not False
            key = f"{phase}_peak_bytes"
            if key in info and (info[key] is None or peak > info[key]):
                info[key] = peak
                info["peak_exact"][phase] = exact
            elif key in info and peak == info[key]:
                info["peak_exact"][phase] = bool(info["peak_exact"][phase]) or exact
            if info["_best"] is None or peak > info["_best"]:
                info.update(_best=peak, peak_step=record["step"], peak_phase=phase)
    for info in result.values():
        best = info.pop("_best", None)
        if best is not None and info["capacity_bytes"]:
            info["headroom"] = 1.0 - best / info["capacity_bytes"]
        info["peak_bytes"] = best
    return result


def summarize_throughput(records: list[dict], summary: dict | None = None) -> dict:
    """Rates over the steps after warm-up, first-step times, and the input check."""
    train = [r for r in records if r.get("phase") == "train"]
    steps = sum(r.get("steps") or 0 for r in train)
    seconds = sum(r.get("seconds") or 0.0 for r in train)
    samples_known = bool(train) and all(r.get("samples") is not None for r in train)
    samples = sum(r.get("samples") or 0 for r in train) if samples_known else None
    result = {
        "steps": steps,
        "seconds": seconds,
        "samples": samples,
        "steps_per_sec": steps / seconds if seconds else None,
        "samples_per_sec": samples / seconds if (seconds and samples is not None) else None,
        "step_time_ms": 1000.0 * seconds / steps if steps else None,
        "first_step_s": [r["seconds"] for r in records if r.get("phase") == "compile"],
        "attempts": len({r.get("attempt") for r in records}),
    }
    for key in ("input_batches_per_sec", "input_samples_per_sec", "bottleneck", "input_verdict"):
        result[key] = (summary or {}).get(key)
    return result


def _fmt_rate(value):
    return "-" if value is None else f"{value:,.1f}"


def attempts_text(attempts: list) -> str:
    """`"fit attempt 2"` or `"fit attempts 3, 4"`: the attempts a training run is made of."""
    attempts = [a for a in attempts if a is not None]
    if not attempts:
        return "fit attempt ?"
    if len(attempts) == 1:
        return f"fit attempt {attempts[0]}"
    return "fit attempts " + ", ".join(str(a) for a in attempts)


def folder_holdings(folder: RunFolder) -> list[str]:
    """What a run folder holds and what it lacks."""
    holds = []
    lines = []
    if folder.has_memory:
        holds.append(f"memory ({MEMORY_SUBDIR}/)")
    else:
        lines.append(f"memory: not recorded - no {MEMORY_SUBDIR}/{TIMELINE_FILE} in this "
                     "folder (only ThroughputMonitor wrote here; add ktm.HBMMonitor(log_dir) "
                     "to record memory)")
    if folder.has_throughput:
        holds.append(f"throughput ({THROUGHPUT_SUBDIR}/)")
    else:
        lines.append(f"throughput: not recorded - no {THROUGHPUT_SUBDIR}/{TIMELINE_FILE} in "
                     "this folder (only HBMMonitor wrote here; add "
                     "ktm.ThroughputMonitor(log_dir) to record it)")
    return ["holds: " + ", ".join(holds)] + lines


def _run_holdings(folder: RunFolder, run: MonitoredRun) -> list[str]:
    """What one training run lacks although its folder has the monitor's timeline."""
    lines = []
    if folder.has_memory:
        if run.memory is None:
            lines.append("memory: not recorded for this training run (HBMMonitor was not "
                         "among this fit's callbacks)")
        elif not any(r.get("devices") for r in run.memory):
            lines.append("memory: not recorded - the timeline has no readings (HBMMonitor "
                         "could read no device; its notice at the start of training says why)")
    if folder.has_throughput:
        if run.throughput is None:
            lines.append("throughput: not recorded for this training run (ThroughputMonitor "
                         "was not among this fit's callbacks)")
        elif not run.throughput:
            lines.append("throughput: not recorded - the timeline has no intervals")
    return lines


def _memory_rows(memory: dict) -> list[tuple]:
    rows = [("device", "source", "first step", "training", "evaluation", "capacity",
             "headroom", "peak at step")]
    for device, info in memory.items():
        label = device + (" [shared]" if info["shared"] and "shared" not in device
                          and not info["process_wide"] else "")
        rows.append((
            label,
            source_column(info["source"]),
            _fmt_bytes(info["compile_peak_bytes"], info["peak_exact"].get("compile")),
            _fmt_bytes(info["train_peak_bytes"], info["peak_exact"].get("train")),
            _fmt_bytes(info["eval_peak_bytes"], info["peak_exact"].get("eval")),
            format_bytes(info["capacity_bytes"]),
            "unknown" if info["headroom"] is None else f"{100 * info['headroom']:.1f}%",
            "-" if info["peak_step"] is None else f"{info['peak_step']} ({info['peak_phase']})",
        ))
    return rows


def run_text(folder: RunFolder, run: MonitoredRun, memory: dict | None,
             throughput: dict | None) -> list:
    """The lines that detail one training run: its holdings, memory and throughput tables."""
    records = (run.memory or []) + (run.throughput or [])
    head = (f"training run {run.index} of {run.count}" if run.count > 1 else "training run")
    if records:
        steps = [r["step"] for r in records]
        head += f": {attempts_text(run.attempts)}, steps {min(steps)}-{max(steps)}"
    lines = [head] + _run_holdings(folder, run)
    if memory:
        lines += ["", "memory (peak per phase and device)", format_table(_memory_rows(memory))]
        if any(i["process_wide"] for i in memory.values()):
            lines.append("host RSS (process): the resident memory of the whole training "
                         "process (the CPU allocator kept no statistics), not HBM")
        if any(v is False for i in memory.values() for v in i["peak_exact"].values()):
            lines.append("<= X: an upper bound. The device's peak counter could not be reset "
                         "(JAX): that phase stayed at or below a peak reached earlier")
    if throughput:
        first = ", ".join(f"{s:.2f} s" for s in throughput["first_step_s"]) or "-"
        step_ms = throughput["step_time_ms"]
        rows = [("samples/s", "steps/s", "step time", "steps timed", "first execution"),
                (_fmt_rate(throughput["samples_per_sec"]), _fmt_rate(throughput["steps_per_sec"]),
                 "-" if step_ms is None else f"{step_ms:.2f} ms",
                 str(throughput["steps"]), first)]
        lines += ["", "throughput (after warm-up)", format_table(rows)]
        if throughput.get("input_verdict"):
            lines.append(f"input pipeline: {throughput['input_verdict']}")
        else:
            lines.append("input pipeline: not measured "
                         "(ThroughputMonitor(dataset=...) measures it)")
    return lines


def runs_table(folder: RunFolder, summaries: list[tuple]) -> str:
    """The table of every training run of a folder, one row each."""
    rows = [("run", "fit attempts", "steps", "memory peak", "source", "samples/s",
             "first execution")]
    for run, memory, throughput in summaries:
        records = (run.memory or []) + (run.throughput or [])
        steps = [r["step"] for r in records]
        peaks = [i for i in (memory or {}).values() if i["peak_bytes"] is not None]
        best = max(peaks, key=lambda i: i["peak_bytes"]) if peaks else None
        rate = None
        if throughput:
            rate = throughput["samples_per_sec"] or throughput["steps_per_sec"]
        rows.append((
            str(run.index),
            ", ".join(str(a) for a in run.attempts if a is not None) or "?",
            f"{min(steps)}-{max(steps)}" if steps else "-",
            _fmt_bytes(best["peak_bytes"]) if best else "-",
            source_column(best["source"]) if best else "-",
            _fmt_rate(rate) + ("" if not throughput or throughput["samples_per_sec"]
                                 else " steps/s"),
            ", ".join(f"{s:.2f} s" for s in throughput["first_step_s"]) if throughput else "-",
        ))
    return format_table(rows)
