"""The report's PNG charts: memory and throughput over the training steps.

matplotlib is imported only here, lazily, and through its object API (no
pyplot), so a report never changes the plotting backend of the calling
program. Every memory chart names its source (the allocator, or the whole
process' resident memory where the CPU allocator kept no statistics).
"""

from __future__ import annotations

import os

from keras_tpu_mem.devices import GIB, format_bytes
from keras_tpu_mem.monitoring._layout import MEMORY_SUBDIR, THROUGHPUT_SUBDIR
from keras_tpu_mem.report.summary import attempts_text
from keras_tpu_mem.report.timeline import MonitoredRun

_MIB = 1024**2
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22")


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


#: Most epoch labels along the top of a chart: about one per inch of a 12-inch
#: figure whose legend takes the right quarter, so " epoch 1000" never overlaps.
_MAX_EPOCH_LABELS = 8
#: Beyond this many epoch boundaries only the labelled ones get a line (the
#: dotted lines of every epoch would grey the whole chart).
_MAX_EPOCH_LINES = 60


def _epoch_stride(count: int, most: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that leaves at most `most` of `count`."""
    scale = 1
    while True:
        for step in (1, 2, 5):
            if count <= most * step * scale:
                return step * scale
        scale *= 10


def _boundaries(ax, records, label_epochs=True):
    """Faint lines at epoch changes, red ones where a resumed attempt starts.

    Epoch labels are thinned to every 2nd, 5th, 10th, ... epoch so they stay
    readable however many epochs the run has.
    """
    previous = None
    epochs = []  # (x, epoch number from 1)
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
                epochs.append((x, int(record["epoch"]) + 1))
        previous = record
    stride = _epoch_stride(len(epochs), _MAX_EPOCH_LABELS)
    for x, epoch in epochs:
        labelled = epoch % stride == 0 or stride == 1
        if labelled or len(epochs) <= _MAX_EPOCH_LINES:
            ax.axvline(x, color="0.75", lw=0.8, ls=":")
        if label_epochs and labelled:
            ax.annotate(f" epoch {epoch}", (x, 1.0), xycoords=("data", "axes fraction"),
                        fontsize=7, color="0.35", ha="left", va="top")


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
            # Right of the star, or left of it in the right third of the steps
            # (where the box would run into the legend).
            steps = [r["step"] for r in records]
            right_side = info["peak_step"] > min(steps) + 0.66 * (max(steps) - min(steps))
            ax.annotate(text, (info["peak_step"], info["peak_bytes"] / scale),
                        textcoords="offset points", xytext=(-10, 6) if right_side else (8, 6),
                        ha="right" if right_side else "left", fontsize=8,
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
        what = ("Host memory (resident memory of the whole process, not HBM)"
                if best["process_wide"] else "Memory per device (allocator)")
        if best["capacity_bytes"]:
            title = (f"{what}: peak {format_bytes(best['peak_bytes'])} of "
                     f"{format_bytes(best['capacity_bytes'])} "
                     f"({100 * best['headroom']:.0f}% headroom)")
        else:
            title = (f"{what}: peak {format_bytes(best['peak_bytes'])} "
                     "(capacity unknown; HBMMonitor(capacity_bytes=...) draws it)")
        if any(i["process_wide"] for i in summary.values()):
            title += ("\nCPU allocator kept no statistics (TensorFlow with oneDNN off, or "
                      "JAX on CPU): host RSS includes "
                      "weights, data, Python and the framework")
        elif any(i["shared"] for i in summary.values()):
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


def write_charts(run: MonitoredRun, memory, throughput, suffix: str = "") -> list[str]:
    """Writes the memory, throughput and combined PNGs of one training run; returns their paths."""
    written = []
    which = (f"training run {run.index} of {run.count} ({attempts_text(run.attempts)})"
             if run.count > 1 else "")
    if memory:
        fig, (ax,) = _figure(1, 4.2)
        _plot_memory(ax, run.memory, memory)
        ax.set_xlabel("training step")
        if which:
            fig.suptitle(which, fontsize=10)
        written.append(_save(fig, os.path.join(run.dir, MEMORY_SUBDIR, f"memory{suffix}.png")))
    if throughput:
        fig, (ax_rate, ax_time) = _figure(2, 3.2)
        _plot_rate(ax_rate, run.throughput, throughput)
        _plot_step_time(ax_time, run.throughput, throughput)
        ax_time.set_xlabel("training step")
        if which:
            fig.suptitle(which, fontsize=10)
        written.append(_save(fig, os.path.join(run.dir, THROUGHPUT_SUBDIR,
                                               f"throughput{suffix}.png")))
    if memory and throughput:
        fig, (ax_mem, ax_rate) = _figure(2, 3.8)
        _plot_memory(ax_mem, run.memory, memory)
        _plot_rate(ax_rate, run.throughput, throughput)
        ax_rate.set_xlabel("training step")
        fig.suptitle(f"keras-tpu-mem report: {run.dir}" + (f", {which}" if which else ""),
                     fontsize=11)
        written.append(_save(fig, os.path.join(run.dir, f"ktm_report{suffix}.png")))
    return written
