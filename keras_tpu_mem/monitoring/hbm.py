"""`HBMMonitor`: accelerator memory of every replica device during `fit`.

Reads each device's allocator, or, where a CPU allocator keeps no statistics,
the resident memory of the whole process, and names the source of every figure.
The readers live in `keras_tpu_mem.devices` (for TensorFlow device names or
`jax.Device`s, the backend's part in `backends/<name>/devices.py`),
`_allocators` groups the devices and keeps the peak intervals, `_hbm_summary`
the peaks per phase and the end-of-fit table; this module keeps the phases.
"""

from __future__ import annotations

import math
import time

from keras_tpu_mem import backends, devices
from keras_tpu_mem._utils import logger
from keras_tpu_mem.monitoring._allocators import (
    _Device,
    assign_capacity,
    peak_exact,
    read,
    reset,
    resolve_devices,
)
from keras_tpu_mem.monitoring._base import (
    _check_fraction,
    _MonitorBase,
    _never_raise,
    _StepCounter,
)
from keras_tpu_mem.monitoring._hbm_summary import DeviceStats, summarize, summary_table
from keras_tpu_mem.monitoring._layout import HOST_RSS_LABEL, MEMORY_SUBDIR, SOURCE_TAG

_GIB = float(devices.GIB)


class HBMMonitor(_MonitorBase):
    """Logs accelerator memory (HBM on TPU) of every replica device during `fit`.

    At every `every_n_steps`-th training step (counted in real steps, so with
    `steps_per_execution=N` it reads once per execution) it reads the current
    and peak bytes of each replica's allocator
    (`tf.config.experimental.get_memory_info` on `TPU:i` / `GPU:i`; on CPU the
    one host allocator that all logical CPUs and the input pipeline share,
    labelled `"CPU (shared)"`) and:

    * adds `hbm_current_gib`, `hbm_peak_gib` and, where the capacity is known,
      `hbm_utilization` to the batch and epoch logs (progress bar, `History`);
      with several devices the worst device is logged. In epoch logs
      `hbm_peak_gib` is the peak of that epoch's training steps and
      `val_hbm_peak_gib` the peak of its validation;
    * writes the same per device as TensorBoard scalars (`hbm/<device>/...`)
      and a JSON-lines timeline under `log_dir/ktm_memory/`, each figure with
      its source (see below);
    * keeps the first-step (trace + compile + first step), training and
      evaluation peaks apart by resetting the allocator's peak counter
      (`tf.config.experimental.reset_memory_stats`) between phases and epochs
      (on JAX, which cannot reset it, see below);
    * warns once per `fit`, with the numbers and what to try, when the headroom
      `1 - peak / capacity` falls below `warn_headroom`;
    * prints a per-device table at the end of training: peaks per phase,
      capacity, headroom and the step of the peak.

    **Sources.** Every figure says where it comes from. `"allocator"`: the
    device's allocator statistics, as above. `"host_rss"`: where the CPU
    allocator keeps no statistics (oneDNN off: TensorFlow's default on CPUs
    without AVX-512, such as AMD EPYC with AVX2, or `TF_ENABLE_ONEDNN_OPTS=0`),
    the monitor reads the resident memory (RSS) of the whole process instead:
    current RSS, and as the peak the highest RSS it read in the interval,
    raised to the OS high-water mark where that can be reset per phase
    (Linux). That is a process-wide figure (weights, data, Python, TensorFlow
    itself), never HBM: the device is labelled `"CPU (process RSS)"`, its
    TensorBoard tags are `host_rss/process/...` instead of `hbm/...`, timeline
    records carry `"source"`, `"process_wide"` and `"memory_source"`, the
    TensorBoard text tag `memory_source` and the end-of-fit table name it,
    and one notice says so when training starts. The log keys stay
    `hbm_current_gib` / `hbm_peak_gib` whatever the source.

    **On the JAX backend** the devices are those of the active
    `keras.distribution` that this process holds (every device of a
    `DataParallel` or `ModelParallel` mesh, each read on its own), or the
    first device without one. Each TPU/GPU device is read with
    `jax.Device.memory_stats()`: `bytes_in_use`, `peak_bytes_in_use`, and
    `bytes_limit` as the capacity (source `"allocator"`). That peak is a
    high-water mark since the process started, and JAX cannot reset it, so
    phases are told apart by the mark: at each phase boundary the monitor
    notes the peak so far; a later reading above it is the phase's own peak
    (exact), one at it says only that the phase stayed at or below it (an
    upper bound: timeline records and `summary.json` carry `"peak_exact":
    false`, the tables show `<= X`). JAX's CPU devices keep no statistics
    (`memory_stats()` is `None`): all of them share one `"CPU (process
    RSS)"` entry read from the host RSS as above, whose VmHWM reset keeps
    phases apart exactly as on TensorFlow. Log keys, tags and file layout are
    the same on both backends.

    Where nothing can read a device (a TPU or GPU plugin without statistics)
    it says so once and training goes on without the keys. It never breaks a
    run. (The CPU allocator counts only allocations of 256 KiB and more, so
    tiny models read close to 0 there; the host RSS has no such threshold but
    includes everything the process holds.)

    Args:
        log_dir: Directory for TensorBoard events and the timeline, usually the
            same as Keras' `TensorBoard(log_dir=...)`; files go to
            `log_dir/ktm_memory/`. `None` logs to `logs` and the console only.
        every_n_steps: Read memory every this many training steps (>= 1). The
            allocator's peak counter keeps the maximum in between, so a larger
            value loses no peak, only the resolution of its step.
        capacity_bytes: Memory of one device in bytes. `None` takes it from
            `ktm.HBM_TABLE` on a TPU (per replica) or from the GPU's name, and
            leaves it unknown on CPU.
        warn_headroom: Warn when the free fraction of the capacity falls below
            this, in [0, 1). `0.10` warns above 90% use.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_tpu_mem as ktm

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    x, y = np.random.rand(1024, 64).astype("float32"), np.random.randint(0, 10, 1024)
    history = model.fit(x, y, batch_size=256, epochs=2, verbose=0,
                        callbacks=[ktm.HBMMonitor("logs", capacity_bytes=64 * 1024**2)])
    print(history.history["hbm_peak_gib"], history.history["hbm_utilization"])
    ```
    """

    _subdir = MEMORY_SUBDIR

    def __init__(self, log_dir=None, *, every_n_steps=1, capacity_bytes=None,
                 warn_headroom=0.10):
        super().__init__(log_dir, every_n_steps)
        if capacity_bytes is not None:
            if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
                raise TypeError(
                    "`capacity_bytes` must be None (detect) or a positive int number of "
                    f"bytes, e.g. 16 * 1024**3; got {capacity_bytes!r}."
                )
            if capacity_bytes <= 0:
                raise ValueError(
                    f"`capacity_bytes` must be a positive number of bytes, got {capacity_bytes}."
                )
        self.capacity_bytes = capacity_bytes
        self.warn_headroom = _check_fraction(warn_headroom, "warn_headroom")
        self._devices: list[_Device] = []
        self._stats: dict[str, DeviceStats] = {}
        self._in_fit = False
        self._active = False
        self._phase = "train"
        self._capacity_source = None
        self.summary: dict | None = None

    # ------------------------------------------------------------ plumbing
    def _setup(self) -> bool:
        """Finds the devices, picks each one's source; False if none can be read."""
        backend = backends.current("HBMMonitor")
        self._reader = backend.devices.allocator_reader()
        self._devices = resolve_devices(devices.model_devices(self.model))
        self._capacity_source = assign_capacity(self._devices, self.capacity_bytes)
        unreadable = []
        for device in self._devices:
            if read(device) is not None:
                continue
            if device.shared and devices.host_memory_readable():
                device.use_host_rss()
                self._notice(
                    "host_rss",
                    "HBMMonitor: memory source: host RSS. %s, so the hbm_* keys carry the "
                    "resident memory of the whole process (%r; peak: %s): weights, data, "
                    "Python and %s itself, not HBM. %s",
                    backend.devices.host_rss_why(), HOST_RSS_LABEL, devices.host_peak_method(),
                    backend.label, backend.devices.host_rss_fix(),
                )
            else:
                unreadable.append(device)
        if unreadable:
            names = ", ".join(d.label for d in unreadable)
            self._notice(
                "unreadable",
                "HBMMonitor: cannot read memory on %s: %s. Training continues without "
                "memory logging for %s.",
                names, backend.devices.unreadable_why(), "it" if len(unreadable) == 1 else "them",
                warning=True,
            )
            self._devices = [d for d in self._devices if d not in unreadable]
        self._stats = {d.label: DeviceStats() for d in self._devices}
        if self._devices and not any(d.process_wide for d in self._devices):
            # (The host-RSS notice above already names its source.)
            # Where no peak can be reset, name the reader: its peak is a process-wide mark.
            fixed_peak = backend.devices.peak_resettable() is False
            reader = f" ({self._reader})" if fixed_peak else ""
            self._notice("sources", "HBMMonitor: memory source: %s.", "; ".join(
                f"{d.label} <- {devices.describe_source(d.source)}{reader}"
                for d in self._devices))
        return bool(self._devices)

    @property
    def memory_sources(self) -> dict[str, str]:
        """`{device label: source}` of the last fit or evaluate (`"allocator"`, `"host_rss"`)."""
        return {d.label: d.source for d in self._devices}

    def _write_sources(self) -> None:
        """One TensorBoard text entry (Text tab, tag `memory_source`) naming each source."""
        if self._files is None:
            return
        rows = ["| device | source | meaning |", "|---|---|---|"]
        for d in self._devices:
            if d.process_wide:
                meaning = ("resident memory of the whole process (the CPU allocator keeps no "
                           f"statistics); peak: {devices.host_peak_method()}; not HBM")
            elif d.resettable is False:
                meaning = (f"the device allocator's bytes in use and peak "
                           f"({self._reader}); the peak is a "
                           "high-water mark since the process started that cannot be reset: a "
                           "phase's peak is exact where the phase raised it, else an upper "
                           "bound (peak_exact false)")
            else:
                meaning = "the device allocator's bytes in use and peak"
            rows.append(f"| {d.label} | {d.source} | {meaning} |")
        step = self._counter.current if self._counter else 0
        self._files.text(step, SOURCE_TAG, "\n".join(rows))

    def _reset_peaks(self) -> None:
        fixed = [device for device in self._devices if not reset(device)]
        if fixed:
            names = ", ".join(d.label for d in fixed)
            self._notice(
                "reset",
                "HBMMonitor: the peak counter of %s cannot be reset (%s keeps one "
                "high-water mark since the process started). Phases are told apart by "
                "that mark instead: a phase's peak is exact where the phase raised the "
                "mark (a new high), and otherwise an upper bound, shown as '<= X' (the "
                "phase stayed at or below a peak reached earlier; the same step program "
                "reaches the same peak, so training steps after the first usually show "
                "'<= first step').", names,
                self._reader,
            )

    def _take_reading(self, phase: str) -> dict[str, tuple[int, int, bool]]:
        """`{label: (current, peak, exact)}`; `exact` is False for an upper bound."""
        readings = {}
        for device in self._devices:
            value = read(device)
            if value is None:
                continue
            current, peak = value
            exact = peak_exact(device, peak)
            readings[device.label] = (current, peak, exact)
            step = self._counter.current if self._counter else None
            self._stats[device.label].add(phase, current, peak, exact, step)
        self._check_headroom(readings, phase)
        return readings

    def _write(self, phase: str, readings: dict) -> None:
        if self._files is None or not readings:
            return
        step = self._counter.current if self._counter else 0
        now = time.time()
        by_label = {d.label: d for d in self._devices}
        record_devices = {}
        scalars = {}
        sources = set()
        for label, (current, peak, exact) in readings.items():
            device = by_label[label]
            sources.add(device.source)
            record_devices[label] = {
                "current_bytes": current,
                "peak_bytes": peak,
                "capacity_bytes": device.capacity,
                "shared": device.shared,
                "replicas": list(device.replicas),
                "source": device.source,
                "process_wide": device.process_wide,
            }
            if device.resettable is False and not device.process_wide:
                # A counter that cannot be reset (JAX): false marks an upper bound.
                record_devices[label]["peak_exact"] = exact
            # Host RSS is not HBM: its tags say so (host_rss/process/...).
            prefix = "host_rss" if device.process_wide else "hbm"
            prefix += "_eval" if phase == "eval" else ""
            scalars[f"{prefix}/{device.tag}/current_gib"] = current / _GIB
            scalars[f"{prefix}/{device.tag}/peak_gib"] = peak / _GIB
            if device.capacity:
                scalars[f"{prefix}/{device.tag}/utilization"] = peak / device.capacity
        self._files.record({
            "step": step,
            "time": now,
            "phase": phase,
            "epoch": self._epoch,
            "begin_step": self._counter.begin_step if self._counter else None,
            "memory_source": sources.pop() if len(sources) == 1 else "mixed",
            "devices": record_devices,
        })
        self._files.scalars(step, scalars, now)
        self._last_logged_step = step

    def _logs_from(self, peak_attr: str) -> dict:
        currents = [s.current for s in self._stats.values() if s.current is not None]
        if not currents:
            return {}
        logs = {"hbm_current_gib": max(currents) / _GIB}
        peaks = {label: getattr(s, peak_attr) for label, s in self._stats.items()}
        known = [p for p in peaks.values() if p is not None]
        if known:
            logs["hbm_peak_gib"] = max(known) / _GIB
        utilization = [
            peaks[d.label] / d.capacity
            for d in self._devices
            if d.capacity and peaks.get(d.label) is not None
        ]
        if utilization:
            logs["hbm_utilization"] = max(utilization)
        return logs

    def _check_headroom(self, readings: dict, phase: str) -> None:
        if self._warned:
            return
        for device in self._devices:
            if not device.capacity or device.label not in readings:
                continue
            peak = readings[device.label][1]
            headroom = 1.0 - peak / device.capacity
            if headroom >= self.warn_headroom:
                continue
            self._warned = True
            target = device.capacity * (1.0 - self.warn_headroom)
            factor = 2 ** max(1, math.ceil(math.log2(max(peak / target, 1.0001))))
            step = self._counter.current if self._counter else None
            logger.warning(
                "HBMMonitor: headroom on %s is %.1f%%, below warn_headroom=%.0f%%: peak %s "
                "of %s capacity at step %s (%s). The next larger batch or model will not "
                "fit. To cut activation memory, try ktm.GradientAccumulation(steps=%d) "
                "(same global batch in %d micro-batches, about 1/%d of the activations "
                "alive at once) or ktm.MixedBFloat16() (bf16 activations, about half "
                "the bytes); or lower the global batch.",
                device.label, 100.0 * headroom, 100.0 * self.warn_headroom,
                devices.format_bytes(peak), devices.format_bytes(device.capacity),
                step, "first step, with compilation" if phase == "compile" else phase,
                factor, factor, factor,
            )
            return

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        self._disabled = False
        self._begin_train()

    @_never_raise
    def _begin_train(self):
        self._in_fit = True
        self._warned = False
        self._epoch = 0
        self._first = True
        self._eval_ran = False
        self._last_logged_step = None
        self._counter = _StepCounter(self.model, self.params)
        self._active = self._setup()
        if not self._active:
            return
        self._open_files()
        self._write_sources()
        self._reset_peaks()
        self._phase = "compile"

    @_never_raise
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = int(epoch)
        self._eval_ran = False
        if self._counter is not None:
            self._counter.epoch_begin()
        if not getattr(self, "_active", False):
            return
        for stats in self._stats.values():
            stats.epoch_train_peak = None
            stats.epoch_eval_peak = None
        if not self._first:
            self._reset_peaks()

    @_never_raise
    def on_train_batch_begin(self, batch, logs=None):
        if self._counter is not None:
            self._counter.batch_begin(batch)

    @_never_raise
    def on_train_batch_end(self, batch, logs=None):
        if self._counter is None:
            return
        prev = self._counter.current
        if not self._counter.batch_end(batch):  # a skipped call of a resumed fit
            return
        if not self._active or not self._should_log(self._first, prev, self._counter.current):
            return
        phase = "compile" if self._first else "train"
        readings = self._take_reading(phase)
        self._write(phase, readings)
        if logs is not None:
            logs.update(self._logs_from("epoch_train_peak"))
        if self._first:
            self._first = False
            self._phase = "train"
            self._reset_peaks()

    def _train_tail(self):
        """Reads what the last, unlogged steps of an epoch left in the peak counter."""
        readings = self._take_reading(self._phase)
        if self._counter is not None and self._last_logged_step != self._counter.current:
            self._write(self._phase, readings)

    @_never_raise
    def on_test_begin(self, logs=None):
        if not self._in_fit:
            # A standalone `evaluate()`: set up for this one phase.
            self._counter = _StepCounter(self.model, None)
            self._warned = False
            self._epoch = None
            self._active = self._setup()
            if self._active:
                self._open_files()
                self._write_sources()
        if not self._active:
            return
        if self._in_fit and self._phase in ("compile", "train"):
            self._train_tail()
        self._reset_peaks()
        self._phase = "eval"

    @_never_raise
    def on_test_end(self, logs=None):
        if not self._active:
            return
        readings = self._take_reading("eval")
        self._write("eval", readings)
        self._eval_ran = True
        self._reset_peaks()
        if self._in_fit:
            self._phase = "compile" if self._first else "train"
        else:
            self._log_table(title="HBMMonitor (evaluate)")
            self._close_files()

    @_never_raise
    def on_epoch_end(self, epoch, logs=None):
        if not self._active:
            return
        if self._phase in ("compile", "train") and not self._eval_ran:
            self._train_tail()
        if logs is not None:
            logs.update(self._logs_from("epoch_train_peak"))
            if self._eval_ran:
                peaks = [s.epoch_eval_peak for s in self._stats.values()
                         if s.epoch_eval_peak is not None]
                if peaks:
                    logs["val_hbm_peak_gib"] = max(peaks) / _GIB
        if self._files is not None:
            self._files.flush()

    @_never_raise
    def on_train_end(self, logs=None):
        self._in_fit = False
        if not self._active:
            return
        self.summary = self._summary()
        self._log_table()
        if self._files is not None:
            self._files.write_summary(self.summary)
        self._close_files()

    # -------------------------------------------------------------- summary
    def _summary(self) -> dict:
        return summarize(self._devices, self._stats, self._capacity_source)

    def _log_table(self, title="HBMMonitor") -> None:
        summary = self._summary()
        logger.info("%s: peak memory per device (capacity: %s)\n%s", title,
                    summary["capacity_source"], summary_table(summary))
        self.summary = summary
