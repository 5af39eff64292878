"""What `batch_size_sweep` found: one `SweepRow` per batch size in a `SweepResult`,
which prints as a table and draws throughput and peak memory in a PNG."""

from __future__ import annotations

import dataclasses
import os

from keras_tpu_mem import devices


@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One batch size of a sweep.

    Attributes:
        batch_size: Global batch size (what `dataset_fn` batched with).
        samples_per_sec: Examples per second after the first execution
            (which includes compilation), or None if it did not finish.
        peak_bytes: The peak bytes during the run (largest over the replica
            devices), None where unreadable.
        status: `"ok"`, or `"oom"` for an out-of-memory error
            (TensorFlow's `ResourceExhaustedError`, JAX's RESOURCE_EXHAUSTED).
        error: The error's first line for `"oom"`.
        memory_source: Where `peak_bytes` comes from: `"allocator"` (the
            devices' allocators) or `"host_rss"` (the resident memory of the
            whole process, where the CPU allocator keeps no statistics: it
            includes everything the process holds); None where unreadable.
        peak_exact: False where `peak_bytes` is an upper bound (see the field).
    """

    batch_size: int
    samples_per_sec: float | None
    peak_bytes: int | None
    status: str = "ok"
    error: str | None = None
    memory_source: str | None = None
    #: False where `peak_bytes` is only an upper bound: a peak counter that cannot
    #: be reset (JAX's TPU/GPU allocators) did not rise in this row's run, so its
    #: peak stayed at or below a mark an earlier row (or the process) set.
    peak_exact: bool | None = None


@dataclasses.dataclass(frozen=True)
class SweepResult:
    """Rows of a `batch_size_sweep`, the largest batch that fit, and the PNG path."""

    rows: tuple[SweepRow, ...]
    skipped: tuple[int, ...] = ()
    png_path: str | None = None

    @property
    def largest_fitting(self) -> int | None:
        ok = [r.batch_size for r in self.rows if r.status == "ok"]
        return max(ok) if ok else None

    @property
    def oom_batch(self) -> int | None:
        for row in self.rows:
            if row.status == "oom":
                return row.batch_size
        return None

    @property
    def memory_source(self) -> str | None:
        """The source of the rows' peaks (`"allocator"`, `"host_rss"`), `"mixed"` or None."""
        sources = {r.memory_source for r in self.rows if r.memory_source is not None}
        if not sources:
            return None
        return sources.pop() if len(sources) == 1 else "mixed"

    def table(self) -> str:
        lines = [f"{'batch':>8}  {'samples/s':>12}  {'peak memory':>12}  {'source':<9}  status"]
        for r in self.rows:
            sps = f"{r.samples_per_sec:,.0f}" if r.samples_per_sec else "-"
            peak = devices.format_bytes(r.peak_bytes)
            if r.peak_exact is False:
                peak = "<= " + peak
            lines.append(f"{r.batch_size:>8}  {sps:>12}  {peak:>12}  "
                         f"{r.memory_source or '-':<9}  {r.status}")
        if self.oom_batch is not None:
            lines.append(f"out of memory at batch {self.oom_batch}; largest that fit: "
                         f"{self.largest_fitting}"
                         + (f"; not tried: {', '.join(map(str, self.skipped))}"
                            if self.skipped else ""))
        else:
            lines.append(f"all fit; largest: {self.largest_fitting}")
        if self.memory_source == devices.SOURCE_HOST_RSS:
            lines.append("peak memory: host RSS, the resident memory of the whole process "
                         "(the CPU allocator keeps no statistics here), not HBM")
        if any(r.peak_exact is False for r in self.rows):
            lines.append("<= X: an upper bound (the device's peak counter cannot be reset, "
                         "and this run did not raise it)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str) -> str:
        """Writes samples/s and peak memory against batch size as a PNG."""
        # The Agg canvas directly: no pyplot, no change to the user's backend.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        ok = [r for r in self.rows if r.status == "ok"]
        fig = Figure(figsize=(9, 3.6), dpi=110)
        FigureCanvasAgg(fig)
        ax_speed, ax_mem = fig.subplots(1, 2)
        xs = [r.batch_size for r in ok]
        speed = [r.samples_per_sec or 0 for r in ok]
        ax_speed.plot(xs, speed, "o-", color="tab:blue")
        ax_speed.set_title("Throughput")
        ax_speed.set_ylabel("samples / s")
        mem_rows = [r for r in ok if r.peak_bytes is not None]
        if mem_rows:
            scale, unit = _mem_unit(max(r.peak_bytes for r in mem_rows))
            ax_mem.plot([r.batch_size for r in mem_rows],
                        [r.peak_bytes / scale for r in mem_rows], "s-", color="tab:orange")
            ax_mem.set_ylabel(f"peak memory ({unit})")
        else:
            ax_mem.text(0.5, 0.5, "peak memory not readable", ha="center",
                        transform=ax_mem.transAxes)
        source = self.memory_source
        ax_mem.set_title("Peak memory (host RSS of the whole process)"
                         if source == devices.SOURCE_HOST_RSS else
                         f"Peak memory ({source or 'allocator'})")
        for ax in (ax_speed, ax_mem):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size")
            ticks = xs + ([self.oom_batch] if self.oom_batch is not None else [])
            ax.set_xticks(ticks or [1])
            ax.set_xticklabels([str(x) for x in ticks] or ["1"])
            ax.grid(True, alpha=0.3)
            if self.oom_batch is not None:
                ax.axvline(self.oom_batch, color="tab:red", ls="--")
                ax.text(self.oom_batch, 0.5, f" OOM at {self.oom_batch}", color="tab:red",
                        rotation=90, va="center", transform=ax.get_xaxis_transform())
            ax.set_ylim(bottom=0)
        fig.suptitle("Batch-size sweep: throughput and peak memory")
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path)
        return path


def _mem_unit(value: float) -> tuple[float, str]:
    for scale, unit in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if value >= scale:
            return float(scale), unit
    return 1.0, "B"
