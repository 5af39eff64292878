"""`write_report`: the report of a log folder, its table and its charts."""

from __future__ import annotations

import dataclasses
import os

from keras_tpu_mem.monitoring._layout import MEMORY_SUBDIR, THROUGHPUT_SUBDIR, TIMELINE_FILE
from keras_tpu_mem.report.charts import write_charts
from keras_tpu_mem.report.summary import (
    folder_holdings,
    run_text,
    runs_table,
    summarize_memory,
    summarize_throughput,
)
from keras_tpu_mem.report.timeline import find_runs, load_folder

__all__ = ["Report", "write_report"]


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
    folders = [load_folder(d) for d in run_dirs]
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
        lines = [f"run folder: {folder.dir}"] + folder_holdings(folder)
        if latest > 1:
            lines += ["", f"{latest} training runs in this folder (a fit of a fresh model "
                          "starts one; a resumed or continued fit belongs to its run):",
                      runs_table(folder, summaries)]
            if which == "latest":
                lines.append(f"below: training run {latest} of {latest}, the latest; "
                             "keras_tpu_mem.report.write_report(LOGDIR, run=N) details and "
                             "charts run N, run='all' every one")
            elif not chosen:
                lines.append(f"training run {which}: not in this folder (it has {latest})")
        for index in chosen:
            item, memory, throughput = summaries[index - 1]
            lines += [""] + run_text(folder, item, memory, throughput)
            if charts:
                suffix = "" if index == latest or which != "all" else f"_run{index}"
                written += write_charts(item, memory, throughput, suffix)
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
