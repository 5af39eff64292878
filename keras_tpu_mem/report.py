"""`keras-tpu-mem report LOGDIR`: charts and a table from the monitors' timelines.

`HBMMonitor` and `ThroughputMonitor` append JSON-lines timelines to
`LOGDIR/ktm_memory/timeline.jsonl` and `LOGDIR/ktm_throughput/timeline.jsonl`.
This module reads them (every run directory under LOGDIR that has one), and
writes, next to them:

* `ktm_memory/memory.png`: memory of every device over the training steps,
  the device capacity as a line, the peak marked, the first (compiling) step
  and the evaluation peaks drawn apart, epoch and resume boundaries;
* `ktm_throughput/throughput.png`: samples/s (or steps/s) and step time over
  the steps, the warm-up greyed, the mean, and the input pipeline's own rate;
* `ktm_report.png` in the run directory: memory and throughput on one page;

and returns a text summary table. matplotlib is imported only here, lazily,
and through its object API (no pyplot), so a report never changes the
plotting backend of the calling program.
"""

from __future__ import annotations

import dataclasses
import json
import os

from keras_tpu_mem.devices import GIB, format_bytes
from keras_tpu_mem.monitoring import (
    MEMORY_SUBDIR,
    SUMMARY_FILE,
    THROUGHPUT_SUBDIR,
    TIMELINE_FILE,
    _fmt_bytes,
    format_table,
)

__all__ = ["Report", "find_runs", "load_timeline", "summarize_memory",
           "summarize_throughput", "write_report"]

_MIB = 1024**2
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22")


# ------------------------------------------------------------------ reading
def load_timeline(path: str) -> list[dict]:
    """Reads a monitor timeline, as TensorBoard would show it after a resume.

    Lines cut short by a crash are skipped. When a later attempt (a new `fit`,
    e.g. resumed by `BackupAndRestore`) starts at step `s`, the earlier
    attempts' records at steps >= `s` are dropped: those steps were trained
    again, and the new records replace them (TensorBoard's own rule for
    restarted runs).
    """
    kept: list[dict] = []
    attempt = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or "step" not in record:
                continue
            if record.get("attempt") != attempt:
                if attempt is not None:
                    start = record["step"]
                    kept = [r for r in kept if r["step"] < start]
                attempt = record.get("attempt")
            kept.append(record)
    return kept


def _load_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class _Run:
    dir: str
    memory: list[dict] | None = None
    throughput: list[dict] | None = None
    throughput_summary: dict | None = None


def find_runs(logdir: str) -> list[str]:
    """Run directories under `logdir` that hold a monitor timeline (sorted)."""
    if "://" in str(logdir):
        raise ValueError(
            f"`LOGDIR` {logdir!r} is a remote path; copy it locally first "
            "(e.g. `gsutil -m cp -r gs://bucket/logs .`)."
        )
    if not os.path.isdir(logdir):
        raise ValueError(f"`LOGDIR` {logdir!r} is not a directory.")
    runs = set()
    for root, dirs, files in os.walk(logdir):
        if TIMELINE_FILE in files and os.path.basename(root) in (MEMORY_SUBDIR, THROUGHPUT_SUBDIR):
            runs.add(os.path.dirname(root))
        dirs.sort()
    return sorted(runs)


def _load_run(run_dir: str) -> _Run:
    run = _Run(run_dir)
    memory_path = os.path.join(run_dir, MEMORY_SUBDIR, TIMELINE_FILE)
    throughput_path = os.path.join(run_dir, THROUGHPUT_SUBDIR, TIMELINE_FILE)
    if os.path.exists(memory_path):
        run.memory = load_timeline(memory_path)
    if os.path.exists(throughput_path):
        run.throughput = load_timeline(throughput_path)
        run.throughput_summary = _load_json(os.path.join(run_dir, THROUGHPUT_SUBDIR, SUMMARY_FILE))
    return run


# -------------------------------------------------------------- summarising
def summarize_memory(records: list[dict]) -> dict:
    """Per device: peaks of the first step, training and evaluation, capacity, headroom.

    Returns `{device: {"compile_peak_bytes", "train_peak_bytes", "eval_peak_bytes",
    "capacity_bytes", "headroom", "peak_step", "peak_phase"}}`; the peak step is
    that of the highest reading of any phase.
    """
    result: dict[str, dict] = {}
    for record in records:
        phase = record.get("phase", "train")
        for device, reading in (record.get("devices") or {}).items():
            info = result.setdefault(device, {
                "compile_peak_bytes": None, "train_peak_bytes": None, "eval_peak_bytes": None,
                "capacity_bytes": None, "headroom": None, "peak_step": None,
                "peak_phase": None, "shared": bool(reading.get("shared")), "_best": None,
            })
            peak = reading.get("peak_bytes")
            if reading.get("capacity_bytes"):
                info["capacity_bytes"] = reading["capacity_bytes"]
            if peak is None:
                continue
            key = f"{phase}_peak_bytes"
            if key in info and (info[key] is None or peak > info[key]):
                info[key] = peak
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


def _summary_text(run: _Run, memory: dict | None, throughput: dict | None) -> str:
    lines = [f"run: {run.dir}"]
    records = (run.memory or []) + (run.throughput or [])
    if records:
        steps = [r["step"] for r in records]
        attempts = len({r.get("attempt") for r in records})
        lines[0] += f"  (steps {min(steps)}-{max(steps)}, {attempts} fit attempt(s))"
    if memory:
        rows = [("device", "first step", "training", "evaluation", "capacity", "headroom",
                 "peak at step")]
        for device, info in memory.items():
            label = device + (" [shared]" if info["shared"] and "shared" not in device else "")
            rows.append((
                label,
                _fmt_bytes(info["compile_peak_bytes"]),
                _fmt_bytes(info["train_peak_bytes"]),
                _fmt_bytes(info["eval_peak_bytes"]),
                format_bytes(info["capacity_bytes"]),
                "unknown" if info["headroom"] is None else f"{100 * info['headroom']:.1f}%",
                "-" if info["peak_step"] is None else f"{info['peak_step']} ({info['peak_phase']})",
            ))
        lines += ["", "memory (peak per phase and device)", format_table(rows)]
    elif run.memory is not None:
        lines += ["", "memory: the timeline has no readings"]
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
    return "\n".join(lines)


# ----------------------------------------------------------------- plotting
def _figure(rows: int, height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, height * rows), dpi=110, layout="constrained")
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    return fig, list(axes)


def _memory_unit(records):
    top = 0
    for record in records:
        for reading in (record.get("devices") or {}).values():
            top = max(top, reading.get("peak_bytes") or 0, reading.get("capacity_bytes") or 0)
    return (GIB, "GiB") if top >= GIB else (_MIB, "MiB")


def _boundaries(ax, records, label_epochs=True):
    """Faint lines at epoch changes, orange ones where a resumed attempt starts."""
    previous = None
    for record in records:
        if record.get("phase") == "eval":
            continue
        if previous is not None:
            x = (previous["step"] + record["step"]) / 2
            if record.get("attempt") != previous.get("attempt"):
                ax.axvline(x, color="#d62728", lw=1.2, ls="-.", alpha=0.8)
                ax.annotate(f"resumed (fit #{record.get('attempt')})", (x, 1.0),
                            xycoords=("data", "axes fraction"), fontsize=8, color="#d62728",
                            ha="left", va="top", rotation=90)
            elif record.get("epoch") != previous.get("epoch") and record.get("epoch") is not None:
                ax.axvline(x, color="0.75", lw=0.8, ls=":")
                if label_epochs:
                    ax.annotate(f" epoch {record['epoch'] + 1}", (x, 1.0),
                                xycoords=("data", "axes fraction"), fontsize=7, color="0.35",
                                ha="left", va="top")
        previous = record


def _plot_memory(ax, records, summary):
    scale, unit = _memory_unit(records)
    names = list(summary)
    capacities = set()
    for index, device in enumerate(names):
        color = _COLORS[index % len(_COLORS)]
        train = [r for r in records if r.get("phase") in ("compile", "train")
                 and device in (r.get("devices") or {})]
        evals = [r for r in records
                 if r.get("phase") == "eval" and device in (r.get("devices") or {})]
        if train:
            xs = [r["step"] for r in train]
            ax.plot(xs, [r["devices"][device]["peak_bytes"] / scale for r in train],
                    color=color, lw=1.6, marker="." if len(xs) < 200 else None,
                    label=f"{device}: peak so far this epoch")
            ax.plot(xs, [r["devices"][device]["current_bytes"] / scale for r in train],
                    color=color, lw=1.0, ls="--", alpha=0.8,
                    label=f"{device}: in use between steps")
        compile_records = [r for r in train if r.get("phase") == "compile"]
        if compile_records:
            ax.scatter([r["step"] for r in compile_records],
                       [r["devices"][device]["peak_bytes"] / scale for r in compile_records],
                       marker="s", s=46, facecolor="white", edgecolor=color, zorder=4,
                       label="first step (trace + compile)" if index == 0 else None)
        if evals:
            ax.scatter([r["step"] for r in evals],
                       [r["devices"][device]["peak_bytes"] / scale for r in evals],
                       marker="v", s=40, color=color, zorder=4, alpha=0.85,
                       label="evaluation peak" if index == 0 else None)
        info = summary[device]
        if info["capacity_bytes"]:
            capacities.add(info["capacity_bytes"])
        if info["peak_bytes"] is not None:
            ax.scatter([info["peak_step"]], [info["peak_bytes"] / scale], marker="*", s=220,
                       color="#d62728", edgecolor="black", linewidth=0.6, zorder=5,
                       label="highest peak" if index == 0 else None)
            text = (f"peak {format_bytes(info['peak_bytes'])}\n"
                    f"step {info['peak_step']} ({info['peak_phase']})")
            ax.annotate(text, (info["peak_step"], info["peak_bytes"] / scale),
                        textcoords="offset points", xytext=(8, 6), fontsize=8,
                        bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "0.6",
                              "alpha": 0.9})
    for capacity in sorted(capacities):
        ax.axhline(capacity / scale, color="#d62728", lw=1.6, ls="--",
                   label=f"capacity {format_bytes(capacity)} per device")
    peaks = [i["peak_bytes"] for i in summary.values() if i["peak_bytes"] is not None]
    top = max(peaks + list(capacities) or [1])
    ax.set_ylim(0, top / scale * 1.18)
    _boundaries(ax, records)
    ax.set_ylabel(f"memory ({unit})")
    ax.grid(alpha=0.3)
    _legend(ax)
    best = max(summary.values(), key=lambda i: i["peak_bytes"] or -1) if summary else None
    if best and best["peak_bytes"] is not None:
        if best["capacity_bytes"]:
            title = (f"Memory per device: peak {format_bytes(best['peak_bytes'])} of "
                     f"{format_bytes(best['capacity_bytes'])} "
                     f"({100 * best['headroom']:.0f}% headroom)")
        else:
            title = (f"Memory per device: peak {format_bytes(best['peak_bytes'])} "
                     "(capacity unknown; HBMMonitor(capacity_bytes=...) draws it)")
        if any(i["shared"] for i in summary.values()):
            title += "\nCPU: one host allocator shared by all replicas and the input pipeline"
        ax.set_title(title, fontsize=10, loc="left")


def _plot_rate(ax, records, summary):
    points = [r for r in records if r.get("phase") in ("warmup", "train")]
    use_samples = bool(points) and all(r.get("samples_per_sec") is not None for r in points)
    key, unit = ("samples_per_sec", "samples/s") if use_samples else ("steps_per_sec", "steps/s")
    warm = [r for r in points if r["phase"] == "warmup"]
    train = [r for r in points if r["phase"] == "train"]
    if train:
        ax.plot([r["step"] for r in train], [r[key] for r in train], color="#1f77b4", lw=1.4,
                marker="." if len(train) < 200 else None, label=f"{unit} per logged interval")
    if warm:
        ax.scatter([r["step"] for r in warm], [r[key] for r in warm], color="0.6", s=18,
                   label="warm-up (left out of the mean)")
    _mark_epoch_starts(ax, records, train, key, "#1f77b4")
    mean = summary.get(key)
    if mean:
        ax.axhline(mean, color="#1f77b4", ls="--", lw=1.2,
                   label=f"overall {mean:,.0f} {unit} (all samples / all time)")
    input_rate = summary.get("input_samples_per_sec" if use_samples else "input_batches_per_sec")
    values = [r[key] for r in points] + ([mean] if mean else [])
    top = max(values) * 1.18 if values else None
    if input_rate and top and input_rate > 2.5 * top:
        # Far above the training rate: a line there would flatten the chart.
        ax.annotate(f"input pipeline alone: {input_rate:,.0f} {unit} "
                    f"({input_rate / mean:,.0f}x the training rate, off the chart)"
                    if mean else f"input pipeline alone: {input_rate:,.0f} {unit}",
                    (0.01, 0.97), xycoords="axes fraction", ha="left", va="top", fontsize=8,
                    color="#2ca02c")
    elif input_rate:
        ax.axhline(input_rate, color="#2ca02c", ls=":", lw=1.8,
                   label=f"input pipeline alone {input_rate:,.0f} {unit}")
        top = max(top or 0, input_rate * 1.18)
    if top:
        ax.set_ylim(0, top)
    first = summary.get("first_step_s") or []
    title = f"Throughput: {mean:,.0f} {unit} after warm-up" if mean else "Throughput"
    if first:
        title += "; first execution (trace + compile) " + ", ".join(f"{s:.2f} s" for s in first)
    if summary.get("bottleneck"):
        title += f"\n{summary['input_verdict'].split('.')[0]}"
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_ylabel(unit)
    ax.grid(alpha=0.3)
    _boundaries(ax, records, label_epochs=False)
    if points or mean:
        _legend(ax)


def _epoch_starts(records, points):
    """The first logged interval of each epoch after the first (it holds a new iterator)."""
    first_of_epoch, seen = set(), set()
    for record in records:
        if record.get("phase") == "eval":
            continue
        key = (record.get("attempt"), record.get("epoch"))
        if key not in seen:
            seen.add(key)
            first_of_epoch.add(id(record))
    return [r for r in points if id(r) in first_of_epoch]


def _mark_epoch_starts(ax, records, points, key, color):
    starts = _epoch_starts(records, points)
    if starts:
        ax.scatter([r["step"] for r in starts], [r[key] for r in starts], s=48,
                   facecolor="white", edgecolor=color, linewidth=1.4, zorder=4,
                   label="first interval of an epoch (Keras starts a new input iterator)")


def _plot_step_time(ax, records, summary):
    points = [r for r in records if r.get("phase") in ("warmup", "train")]
    train = [r for r in points if r["phase"] == "train"]
    warm = [r for r in points if r["phase"] == "warmup"]
    if train:
        ax.plot([r["step"] for r in train], [r["step_time_ms"] for r in train], color="#9467bd",
                lw=1.2, marker="." if len(train) < 200 else None, label="time per step")
    if warm:
        ax.scatter([r["step"] for r in warm], [r["step_time_ms"] for r in warm], color="0.6", s=18,
                   label="warm-up")
    _mark_epoch_starts(ax, records, train, "step_time_ms", "#9467bd")
    if summary.get("step_time_ms"):
        ax.axhline(summary["step_time_ms"], color="#9467bd", ls="--", lw=1.0,
                   label=f"overall {summary['step_time_ms']:.2f} ms (all time / all steps)")
    ax.set_ylabel("ms per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if points:
        _legend(ax)


def _legend(ax):
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              frameon=False)


def _save(fig, path):
    fig.savefig(path, format="png")
    return path


# -------------------------------------------------------------------- entry
@dataclasses.dataclass
class Report:
    """What `write_report` produced.

    Attributes:
        text: The summary table(s), one block per run directory.
        charts: Paths of the PNG files written.
        runs: Per run directory, the memory and throughput summaries.
    """

    text: str
    charts: list[str]
    runs: dict


def write_report(logdir: str, *, charts: bool = True) -> Report:
    """Reads every monitor timeline under `logdir`, writes PNG charts, returns a summary.

    Args:
        logdir: The `log_dir` given to `HBMMonitor` / `ThroughputMonitor`, or a
            directory above several of them.
        charts: Write the PNG files (False: only the table).

    Returns:
        A `Report` with the table text and the chart paths.

    Raises:
        ValueError: if `logdir` is not a local directory or holds no timeline.
        ImportError: if matplotlib is missing (`pip install matplotlib`).

    Example:

    ```python
    import keras_tpu_mem.report as ktm_report

    report = ktm_report.write_report("logs")
    print(report.text)          # the table; report.charts lists the PNG files
    ```
    """
    run_dirs = find_runs(logdir)
    if not run_dirs:
        raise ValueError(
            f"No monitor timeline under {logdir!r}: expected "
            f"{os.path.join(logdir, MEMORY_SUBDIR, TIMELINE_FILE)} or "
            f"{os.path.join(logdir, THROUGHPUT_SUBDIR, TIMELINE_FILE)} (written by "
            "ktm.HBMMonitor(log_dir) / ktm.ThroughputMonitor(log_dir))."
        )
    if charts:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "keras-tpu-mem report draws with matplotlib: `pip install matplotlib`."
            ) from err
    blocks, written, runs = [], [], {}
    for run_dir in run_dirs:
        run = _load_run(run_dir)
        memory = summarize_memory(run.memory) if run.memory else None
        throughput = (summarize_throughput(run.throughput, run.throughput_summary)
                      if run.throughput else None)
        runs[run_dir] = {"memory": memory, "throughput": throughput}
        if charts:
            written += _charts(run, memory, throughput)
        blocks.append(_summary_text(run, memory, throughput))
    text = "\n\n".join(blocks)
    if written:
        text += "\n\ncharts:\n" + "\n".join(f"  {p}" for p in written)
    return Report(text=text, charts=written, runs=runs)


def _charts(run: _Run, memory, throughput) -> list[str]:
    written = []
    if memory:
        fig, (ax,) = _figure(1, 4.2)
        _plot_memory(ax, run.memory, memory)
        ax.set_xlabel("training step")
        written.append(_save(fig, os.path.join(run.dir, MEMORY_SUBDIR, "memory.png")))
    if throughput:
        fig, (ax_rate, ax_time) = _figure(2, 3.2)
        _plot_rate(ax_rate, run.throughput, throughput)
        _plot_step_time(ax_time, run.throughput, throughput)
        ax_time.set_xlabel("training step")
        written.append(_save(fig, os.path.join(run.dir, THROUGHPUT_SUBDIR, "throughput.png")))
    if memory and throughput:
        fig, (ax_mem, ax_rate) = _figure(2, 3.8)
        _plot_memory(ax_mem, run.memory, memory)
        _plot_rate(ax_rate, run.throughput, throughput)
        ax_rate.set_xlabel("training step")
        fig.suptitle(f"keras-tpu-mem report: {run.dir}", fontsize=11)
        written.append(_save(fig, os.path.join(run.dir, "ktm_report.png")))
    return written
