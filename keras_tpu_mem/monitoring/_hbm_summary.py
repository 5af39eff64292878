"""`HBMMonitor`'s bookkeeping: peaks per device and phase, the summary and its table."""

from __future__ import annotations

import dataclasses

from keras_tpu_mem import devices
from keras_tpu_mem.monitoring._layout import (
    UPPER_BOUND_MARK,
    _fmt_bytes,
    format_table,
    source_column,
)

PHASES = ("compile", "train", "eval")


def _max(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


@dataclasses.dataclass
class DeviceStats:
    """The peaks one allocator reached, per phase of the fit and per epoch."""

    peaks: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES))
    # Per phase: whether its peak is the phase's own (True) or an upper bound
    # (False: a counter that cannot be reset stayed at a mark set earlier).
    exact: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES))
    best: int | None = None        # highest compile/train reading of the fit
    peak_step: int | None = None   # the step it was read at
    epoch_train_peak: int | None = None
    epoch_eval_peak: int | None = None
    current: int | None = None

    @property
    def max_peak(self) -> int | None:
        values = [v for v in self.peaks.values() if v is not None]
        return max(values) if values else None

    def add(self, phase: str, current: int, peak: int, exact: bool, step: int | None) -> None:
        """Takes one reading of `phase` (read at training step `step`)."""
        self.current = current
        old = self.peaks[phase]
        if old is None or peak > old:
            self.peaks[phase], self.exact[phase] = peak, exact
        elif peak == old:
            self.exact[phase] = bool(self.exact[phase]) or exact
        if phase == "eval":
            self.epoch_eval_peak = _max(self.epoch_eval_peak, peak)
        else:
            self.epoch_train_peak = _max(self.epoch_train_peak, peak)
            if self.best is None or peak > self.best:
                self.best = peak
                self.peak_step = step


def summarize(device_list, stats: dict, capacity_source) -> dict:
    """The `summary` of a fit or evaluate: per device its peaks, capacity and headroom."""
    result = {"capacity_source": capacity_source, "devices": {},
              "memory_sources": {d.label: d.source for d in device_list}}
    if any(d.process_wide for d in device_list):
        result["host_rss_peak"] = devices.host_peak_method()
    if any(d.resettable is False and not d.process_wide for d in device_list):
        result["allocator_peak"] = (
            "high-water mark since the process started (it cannot be reset): a phase's "
            "peak is exact where the phase raised it, else an upper bound "
            "(peak_exact false)")
    for device in device_list:
        device_stats = stats[device.label]
        peak = device_stats.max_peak
        headroom = (1.0 - peak / device.capacity) if (
            peak is not None and device.capacity) else None
        result["devices"][device.label] = {
            "compile_peak_bytes": device_stats.peaks["compile"],
            "train_peak_bytes": device_stats.peaks["train"],
            "eval_peak_bytes": device_stats.peaks["eval"],
            "capacity_bytes": device.capacity,
            "headroom": headroom,
            "peak_step": device_stats.peak_step,
            "shared": device.shared,
            "replicas": list(device.replicas),
            "source": device.source,
            "process_wide": device.process_wide,
        }
        if device.resettable is False and not device.process_wide:
            result["devices"][device.label]["peak_exact"] = dict(device_stats.exact)
    return result


def summary_table(summary: dict) -> str:
    """The end-of-fit table of `summary`, with a note on host-RSS and upper-bound peaks."""
    rows = [("device", "source", "first step", "training", "evaluation", "capacity",
             "headroom", "peak at step")]
    for label, info in summary["devices"].items():
        headroom = info["headroom"]
        exact = info.get("peak_exact") or {}
        rows.append((
            label,
            source_column(info.get("source")),
            _fmt_bytes(info["compile_peak_bytes"], exact.get("compile")),
            _fmt_bytes(info["train_peak_bytes"], exact.get("train")),
            _fmt_bytes(info["eval_peak_bytes"], exact.get("eval")),
            devices.format_bytes(info["capacity_bytes"]),
            "unknown" if headroom is None else f"{100 * headroom:.1f}%",
            "-" if info["peak_step"] is None else str(info["peak_step"]),
        ))
    note = ""
    if "host_rss_peak" in summary:
        note = ("\nhost RSS: resident memory of the whole process, not HBM; peak = "
                + summary["host_rss_peak"])
    if "allocator_peak" in summary:
        note += (f"\n{UPPER_BOUND_MARK.strip()} X: an upper bound; allocator peak = "
                 + summary["allocator_peak"])
    return format_table(rows) + note
