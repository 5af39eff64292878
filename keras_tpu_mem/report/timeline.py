"""Reading the monitors' timelines: run folders, fit attempts, training runs.

`HBMMonitor` and `ThroughputMonitor` append one JSON record per logged
interval to `LOGDIR/ktm_memory/timeline.jsonl` and
`LOGDIR/ktm_throughput/timeline.jsonl`. A folder may hold several `fit`
attempts (a resume through `BackupAndRestore`, a second `fit`, the same script
run again): this module reads them as TensorBoard would show them and groups
them into training runs. It reads files only: no Keras, no framework.
"""

from __future__ import annotations

import dataclasses
import json
import os

# `_layout` imports no framework (the package `keras_tpu_mem.monitoring` loads
# its modules lazily), so reading a log folder never starts TensorFlow or JAX.
from keras_tpu_mem.monitoring._layout import (
    MEMORY_SUBDIR,
    SUMMARY_FILE,
    THROUGHPUT_SUBDIR,
    TIMELINE_FILE,
)

__all__ = ["TrainingRun", "find_runs", "load_timeline", "split_training_runs"]


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
class MonitoredRun:
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
class RunFolder:
    """A run directory: which monitor folders it has, and its training runs."""

    dir: str
    has_memory: bool
    has_throughput: bool
    runs: list[MonitoredRun]


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


def load_folder(run_dir: str) -> RunFolder:
    """Reads a run directory: its monitors' timelines, paired into training runs."""
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
        run = MonitoredRun(run_dir, index=index, count=len(pairs))
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
        runs = [MonitoredRun(run_dir, memory=[] if has_memory else None,
                     throughput=[] if has_throughput else None)]
    return RunFolder(run_dir, has_memory, has_throughput, runs)
