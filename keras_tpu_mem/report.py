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

The report only reads files: it imports neither Keras nor a framework
(TensorFlow, JAX), and reads the timelines of either backend alike. Peaks
recorded as upper bounds (`"peak_exact": false`, written where a device's
peak counter cannot be reset, as on JAX's TPU/GPU allocators) are shown as
`<= X`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from keras_tpu_mem.devices import GIB, SOURCE_ALLOCATOR, format_bytes

# `_layout` imports no framework (the package `keras_tpu_mem.monitoring` loads
# its modules lazily), so reading a log folder never starts TensorFlow or JAX.
from keras_tpu_mem.monitoring._layout import (
    MEMORY_SUBDIR,
    SUMMARY_FILE,
    THROUGHPUT_SUBDIR,
    TIMELINE_FILE,
    _fmt_bytes,
    format_table,
    source_column,
)

__all__ = ["Report", "TrainingRun", "find_runs", "load_timeline", "split_training_runs",
           "summarize_memory", "summarize_throughput", "write_report"]

_MIB = 1024**2
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22")


# ------------------------------------------------------------------ reading
def _read_records(path: str) -> list[dict]:
    """Every complete record of a timeline, in file order (a line cut short by a
    crash is skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return records


def _merge_attempt(kept: list[dict], records: list[dict]) -> list[dict]:
    """Adds one fit attempt's records to a training run, as TensorBoard would.

    When the attempt starts at step `s`, the earlier records at steps >= `s`
    are dropped: those steps were trained again, and the new records replace
    them (TensorBoard's own rule for restarted runs). An attempt of
    evaluation records only (a standalone `evaluate`) trains nothing again.
    """
    if kept and any(r.get("phase") != "eval" for r in records):
        start = records[0]["step"]
        kept = [r for r in kept if r["step"] < start]
    return kept + records


def load_timeline(path: str) -> list[dict]:
    """Reads a monitor timeline, as TensorBoard would show it after a resume.

    Lines cut short by a crash are skipped. When a later attempt (a new `fit`,
    e.g. resumed by `BackupAndRestore`) starts at step `s`, the earlier
    attempts' records at steps >= `s` are dropped: those steps were trained
    again, and the new records replace them (TensorBoard's own rule for
    restarted runs). Use `split_training_runs` to keep separate runs that were
    written into the same folder apart.
    """
    kept: list[dict] = []
    for records in _by_attempt(_read_records(path)):
        kept = _merge_attempt(kept, records)
    return kept


def _by_attempt(records: list[dict]) -> list[list[dict]]:
    groups: list[list[dict]] = []
    attempt = object()
    for record in records:
        if not groups or record.get("attempt") != attempt:
            attempt = record.get("attempt")
            groups.append([])
        groups[-1].append(record)
    return groups


@dataclasses.dataclass
class TrainingRun:
    """One training run in a monitor folder: a `fit` and the fits that continued it.

    Attributes:
        attempts: The fit attempts (numbers in the timeline) it is made of;
            more than one where a `fit` resumed (`BackupAndRestore`) or
            continued (`fit` again on the same model) the previous one.
        records: Its records, with steps trained again after a resume kept
            from the later attempt only.
    """

    attempts: list
    records: list[dict]

    @property
    def steps(self) -> tuple[int, int] | None:
        steps = [r["step"] for r in self.records]
        return (min(steps), max(steps)) if steps else None

    @property
    def times(self) -> tuple[float, float] | None:
        times = [r["time"] for r in self.records if isinstance(r.get("time"), (int, float))]
        return (min(times), max(times)) if times else None


def _begin_step(records: list[dict]):
    for record in records:
        if record.get("begin_step") is not None:
            return record["begin_step"]
    return None


def split_training_runs(records: list[dict]) -> list[TrainingRun]:
    """Splits a timeline's records (file order) into training runs.

    A fit attempt continues the previous run when it starts from a trained
    optimizer (`begin_step > 0`, as after `BackupAndRestore` or a second
    `fit` on the same model); one that starts from step 0 (a fresh model,
    e.g. the same script run again into the same log folder) starts a new
    run. Timelines written before `begin_step` was recorded fall back to the
    steps: an attempt whose first step is not beyond the run's first step
    starts a new run.
    """
    runs: list[TrainingRun] = []
    for group in _by_attempt(records):
        begin = _begin_step(group)
        evaluation_only = all(r.get("phase") == "eval" for r in group)
        if not runs:
            continues = False
        elif evaluation_only:
            continues = True
        elif begin is not None:
            continues = begin > 0
        else:
            first = runs[-1].steps
            continues = first is not None and group[0]["step"] > first[0]
        if continues:
            runs[-1].records = _merge_attempt(runs[-1].records, group)
            runs[-1].attempts.append(group[0].get("attempt"))
        else:
            runs.append(TrainingRun([group[0].get("attempt")], list(group)))
    return runs


def _load_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


@dataclasses.dataclass
class _Run:
    """One training run of a folder, with what each monitor recorded of it."""

    dir: str
    memory: list[dict] | None = None
    throughput: list[dict] | None = None
    throughput_summary: dict | None = None
    memory_attempts: list = dataclasses.field(default_factory=list)
    throughput_attempts: list = dataclasses.field(default_factory=list)
    index: int = 1
    count: int = 1

    @property
    def attempts(self) -> list:
        return self.memory_attempts or self.throughput_attempts


@dataclasses.dataclass
class _Folder:
    """A run directory: which monitor folders it has, and its training runs."""

    dir: str
    has_memory: bool
    has_throughput: bool
    runs: list[_Run]


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


def _overlap(a: TrainingRun, b: TrainingRun) -> bool:
    ta, tb = a.times, b.times
    if ta is None or tb is None:
        return a.attempts == b.attempts
    slack = 1.0  # seconds: the two monitors stamp the same steps a moment apart
    return ta[0] <= tb[1] + slack and tb[0] <= ta[1] + slack


def _load_folder(run_dir: str) -> _Folder:
    memory_path = os.path.join(run_dir, MEMORY_SUBDIR, TIMELINE_FILE)
    throughput_path = os.path.join(run_dir, THROUGHPUT_SUBDIR, TIMELINE_FILE)
    has_memory, has_throughput = os.path.exists(memory_path), os.path.exists(throughput_path)
    memory = split_training_runs(_read_records(memory_path)) if has_memory else []
    throughput = split_training_runs(_read_records(throughput_path)) if has_throughput else []
    summary = (_load_json(os.path.join(run_dir, THROUGHPUT_SUBDIR, SUMMARY_FILE))
               if has_throughput else None)
    # The two monitors number their attempts separately (one may have been
    # left out of a fit): a memory run and a throughput run are the same
    # training run when they ran at the same time.
    pairs: list[tuple[TrainingRun | None, TrainingRun | None]] = []
    unmatched = list(throughput)
    for m in memory:
        match = next((t for t in unmatched if _overlap(m, t)), None)
        if match is not None:
            unmatched.remove(match)
        pairs.append((m, match))
    pairs += [(None, t) for t in unmatched]
    pairs.sort(key=lambda p: min(((x.times or (0.0, 0.0))[0]) for x in p if x is not None))
    runs = []
    for index, (m, t) in enumerate(pairs, start=1):
        run = _Run(run_dir, index=index, count=len(pairs))
        if m is not None:
            run.memory, run.memory_attempts = m.records, m.attempts
        elif has_memory and not memory:
            run.memory = []  # the file is there but holds no record
        if t is not None:
            run.throughput, run.throughput_attempts = t.records, t.attempts
            if index == len(pairs):  # summary.json is the last fit's
                run.throughput_summary = summary
        runs.append(run)
    if not runs:
        runs = [_Run(run_dir, memory=[] if has_memory else None,
                     throughput=[] if has_throughput else None)]
    return _Folder(run_dir, has_memory, has_throughput, runs)


# -------------------------------------------------------------- summarising
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


def _attempts_text(attempts: list) -> str:
    attempts = [a for a in attempts if a is not None]
    if not attempts:
        return "fit attempt ?"
    if len(attempts) == 1:
        return f"fit attempt {attempts[0]}"
    return "fit attempts " + ", ".join(str(a) for a in attempts)


def _folder_holdings(folder: _Folder) -> list[str]:
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


def _run_holdings(folder: _Folder, run: _Run) -> list[str]:
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


def _run_text(folder: _Folder, run: _Run, memory: dict | None, throughput: dict | None) -> list:
    records = (run.memory or []) + (run.throughput or [])
    head = (f"training run {run.index} of {run.count}" if run.count > 1 else "training run")
    if records:
        steps = [r["step"] for r in records]
        head += f": {_attempts_text(run.attempts)}, steps {min(steps)}-{max(steps)}"
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


def _runs_table(folder: _Folder, summaries: list[tuple]) -> str:
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


def _check_run(run):
    if run is None or run in ("latest", "all"):
        return run or "latest"
    if isinstance(run, bool) or not isinstance(run, int):
        raise TypeError("`run` must be None or 'latest' (the latest training run of each "
                        "folder), 'all', or an int >= 1 (a training run's number in the "
                        f"report's table); got {run!r}.")
    if run < 1:
        raise ValueError(f"`run` must be an int >= 1 (training runs count from 1), got {run}.")
    return run


def write_report(logdir: str, *, charts: bool = True, run: int | str | None = None) -> Report:
    """Reads every monitor timeline under `logdir`, writes PNG charts, returns a summary.

    For each run folder (a directory holding `ktm_memory/` and/or
    `ktm_throughput/`) the text says what the folder holds and what it lacks
    (e.g. "memory: not recorded - no ktm_memory/timeline.jsonl ..."), lists
    every *training run* written into it (a `fit` of a fresh model starts
    one; a `fit` that resumes or continues it, e.g. through
    `BackupAndRestore`, belongs to it), with its fit attempts, steps, peak
    memory and its source, and throughput, then details and charts of the
    latest run, or of the one `run` picks. Every memory figure names its
    source: `allocator`, or `host RSS (process)` where the CPU allocator kept
    no statistics (the resident memory of the whole process, not HBM).

    Args:
        logdir: The `log_dir` given to `HBMMonitor` / `ThroughputMonitor`, or a
            directory above several of them.
        charts: Write the PNG files (False: only the table).
        run: Which training run of each folder to detail and chart: `None`
            (the latest), an int (its number in the table, from 1) or `"all"`
            (every one; charts of earlier runs get a `_run<N>` suffix).

    Returns:
        A `Report` with the table text and the chart paths.

    Raises:
        ValueError: if `logdir` is not a local directory or holds no timeline,
            or no folder has training run `run`.
        TypeError: if `run` is not None, "latest", "all" or an int.
        ImportError: if matplotlib is missing (`pip install matplotlib`).

    Example:

    ```python
    import keras_tpu_mem.report as ktm_report

    report = ktm_report.write_report("logs")
    print(report.text)          # the table; report.charts lists the PNG files
    ```
    """
    which = _check_run(run)
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
    folders = [_load_folder(d) for d in run_dirs]
    if isinstance(which, int) and not any(len(f.runs) >= which for f in folders):
        most = max(len(f.runs) for f in folders)
        raise ValueError(f"`run`={which}: no folder under {logdir!r} has that many training "
                         f"runs (the most is {most}).")
    blocks, written, runs = [], [], {}
    for folder in folders:
        summaries = [(r, summarize_memory(r.memory) if r.memory else None,
                      summarize_throughput(r.throughput, r.throughput_summary)
                      if r.throughput else None) for r in folder.runs]
        latest = len(summaries)
        if which == "all":
            chosen = list(range(1, latest + 1))
        elif which == "latest":
            chosen = [latest]
        else:
            chosen = [which] if which <= latest else []
        lines = [f"run folder: {folder.dir}"] + _folder_holdings(folder)
        if latest > 1:
            lines += ["", f"{latest} training runs in this folder (a fit of a fresh model "
                          "starts one; a resumed or continued fit belongs to its run):",
                      _runs_table(folder, summaries)]
            if which == "latest":
                lines.append(f"below: training run {latest} of {latest}, the latest; "
                             "keras_tpu_mem.report.write_report(LOGDIR, run=N) details and "
                             "charts run N, run='all' every one")
            elif not chosen:
                lines.append(f"training run {which}: not in this folder (it has {latest})")
        for index in chosen:
            item, memory, throughput = summaries[index - 1]
            lines += [""] + _run_text(folder, item, memory, throughput)
            if charts:
                suffix = "" if index == latest or which != "all" else f"_run{index}"
                written += _charts(item, memory, throughput, suffix)
        first = summaries[(chosen or [latest])[-1] - 1]
        runs[folder.dir] = {
            "memory": first[1], "throughput": first[2],
            "training_runs": [{"index": r.index, "attempts": r.attempts, "memory": m,
                               "throughput": t} for r, m, t in summaries],
            "has_memory": folder.has_memory, "has_throughput": folder.has_throughput,
        }
        blocks.append("\n".join(lines))
    text = "\n\n".join(blocks)
    if written:
        text += "\n\ncharts:\n" + "\n".join(f"  {p}" for p in written)
    return Report(text=text, charts=written, runs=runs)


def _charts(run: _Run, memory, throughput, suffix: str = "") -> list[str]:
    written = []
    which = (f"training run {run.index} of {run.count} ({_attempts_text(run.attempts)})"
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
