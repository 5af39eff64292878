"""Live memory and throughput monitoring inside `model.fit`.

Two callbacks, one concern each:

* `HBMMonitor` reads the allocator's current and peak bytes of every replica
  device (`tf.config.experimental.get_memory_info`), keeps the first-step
  (compile), training and evaluation peaks apart, warns once when the headroom
  to the device's capacity gets small, and prints a per-device table at the end.
* `ThroughputMonitor` measures samples/s, steps/s, step time and the time of the
  first (compiling) execution, counts `steps_per_execution` correctly, and, given
  the training dataset, measures the input pipeline alone and names the
  bottleneck (`measure_input_rate` is the same measurement as a function).

Both put their numbers into the batch and epoch `logs` (so they show in the
progress bar and in `History`), write TensorBoard scalars to their own run
directory under `log_dir` (`ktm_memory/`, `ktm_throughput/`, beside the
`train/` and `validation/` runs of Keras' `TensorBoard` callback), and append a
JSON-lines timeline there (`timeline.jsonl`) that `keras-tpu-mem report` draws.

Neither callback can break a run: where memory cannot be read, or anything
unexpected happens inside a callback, it says so once and training goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import queue
import re
import threading
import time

import keras

from keras_tpu_mem import devices
from keras_tpu_mem._utils import logger

__all__ = ["HBMMonitor", "InputRate", "ThroughputMonitor", "measure_input_rate"]

MEMORY_SUBDIR = "ktm_memory"
THROUGHPUT_SUBDIR = "ktm_throughput"
TIMELINE_FILE = "timeline.jsonl"
SUMMARY_FILE = "summary.json"
SHARED_CPU_LABEL = "CPU (shared)"

_GIB = float(devices.GIB)


# --------------------------------------------------------------- validation
def _check_log_dir(log_dir):
    if log_dir is None:
        return None
    if isinstance(log_dir, os.PathLike):
        log_dir = os.fspath(log_dir)
    if not isinstance(log_dir, str) or not log_dir:
        raise TypeError(
            "`log_dir` must be None (no files) or a directory path (str or "
            f"os.PathLike); got {log_dir!r}."
        )
    return log_dir


def _check_int(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int >= {minimum}, got {value!r}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value}.")
    return value


def _check_optional_positive_int(value, name):
    if value is None:
        return None
    return _check_int(value, name, 1)


def _check_fraction(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a float in [0, 1), got {value!r}.")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(
            f"`{name}` must be a float in [0, 1) (a fraction of the capacity, e.g. "
            f"0.10 for 10%), got {value}."
        )
    return float(value)


# ----------------------------------------------------------- never-break guard
def _never_raise(method):
    """Runs a callback hook; an unexpected error switches the monitor off once."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._disabled:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as err:  # a monitor must never end a training run
            self._disabled = True
            logger.warning(
                "%s: switched off after an unexpected error in %s (%s: %s); "
                "training continues without it.",
                type(self).__name__, method.__name__, type(err).__name__, err,
            )
            try:
                self._close_files()
            except Exception:
                pass
            return None

    return wrapper


# ------------------------------------------------------------------ devices
@dataclasses.dataclass
class _Device:
    """One allocator to read: a TPU/GPU device, or the host CPU shared by replicas."""

    label: str
    queries: tuple[str, ...]
    replicas: tuple[str, ...]
    shared: bool
    capacity: int | None = None
    tag: str = ""  # the label as a TensorBoard tag part

    def __post_init__(self):
        self.tag = self.tag or _tag(self.label)


def _tag(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


def _short(name: str) -> str:
    return name.split("device:")[-1]


def _resolve_devices(strategy) -> list[_Device]:
    """The allocators behind the replicas; all logical CPUs share one."""
    result: list[_Device] = []
    cpu_replicas = []
    for name in devices.replica_device_names(strategy):
        short = _short(name)
        if short.upper().startswith("CPU"):
            cpu_replicas.append(short)
            continue
        queries = (name, short) if name != short else (short,)
        result.append(_Device(short, queries, (short,), shared=False))
    if cpu_replicas:
        result.insert(0, _Device(SHARED_CPU_LABEL, ("CPU:0",), tuple(cpu_replicas), shared=True))
    return result


def _tpu_capacity() -> tuple[int | None, str]:
    import tensorflow as tf

    accelerator = os.environ.get("TPU_ACCELERATOR_TYPE")
    kinds = [accelerator] if accelerator else []
    for lister in (tf.config.list_physical_devices, tf.config.list_logical_devices):
        try:
            found = lister("TPU")[:1]
        except Exception:
            found = []
        for device in found:
            try:
                kinds.append(tf.config.experimental.get_device_details(device).get("device_kind"))
            except Exception:
                pass
    for kind in kinds:
        if not kind:
            continue
        try:
            spec = devices.lookup_tpu(kind)
        except ValueError:
            continue
        return spec.hbm_bytes_per_replica, f"{spec.device_kind} per replica (ktm.HBM_TABLE)"
    return None, "TPU generation unknown"


def _gpu_capacity() -> tuple[int | None, str]:
    import tensorflow as tf

    try:
        gpu = tf.config.list_physical_devices("GPU")[0]
        name = tf.config.experimental.get_device_details(gpu).get("device_name")
    except Exception:
        name = None
    capacity = devices.gpu_memory_bytes(name)
    return capacity, (f"{name} (from its name)" if capacity else f"{name or 'GPU'}: unknown")


def _assign_capacity(device_list, capacity_bytes) -> str:
    """Fills in each device's capacity; returns where the figure came from."""
    if capacity_bytes is not None:
        for device in device_list:
            device.capacity = capacity_bytes
        return "capacity_bytes argument"
    source = "unknown on CPU (pass capacity_bytes=)"
    for device in device_list:
        if device.shared:
            continue
        if device.label.upper().startswith("TPU"):
            device.capacity, source = _tpu_capacity()
        elif device.label.upper().startswith("GPU"):
            device.capacity, source = _gpu_capacity()
    return source


def _read(device: _Device) -> tuple[int, int] | None:
    for query in device.queries:
        value = devices.read_memory(query)
        if value is not None:
            if len(device.queries) > 1:
                device.queries = (query,)  # remember the spelling that works
            return value
    return None


def _reset(device: _Device) -> bool:
    return any(devices.reset_peak(query) for query in device.queries)


def _read_iterations(model) -> int:
    """The optimizer's step counter (restored by `BackupAndRestore`), or 0."""
    try:
        return int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    except Exception:
        return 0


# ------------------------------------------------------------- step counter
class _StepCounter:
    """Counts real training steps per callback call, `steps_per_execution` included.

    Keras calls `on_train_batch_begin(first)` / `on_train_batch_end(last)` once
    per execution of `steps_per_execution` steps. The last execution of an
    epoch may hold fewer steps than `last - first + 1`; it is clamped to the
    epoch's length where Keras knows it (`params["steps"]`). The global step
    starts from the optimizer's `iterations`, so it continues after a resume.
    """

    def __init__(self, model, params):
        self._model = model
        self.epoch_steps = (params or {}).get("steps") or None
        self.step: int | None = None
        self._begin = 0

    def epoch_begin(self):
        self._begin = 0

    def batch_begin(self, batch):
        if self.step is None:
            self.step = _read_iterations(self._model)
        self._begin = int(batch)

    def batch_end(self, batch) -> int:
        if self.step is None:
            self.step = _read_iterations(self._model)
        last = int(batch)
        if self.epoch_steps:
            last = min(last, self.epoch_steps - 1)
        count = max(1, last - self._begin + 1)
        self.step += count
        self._begin = int(batch) + 1
        return count

    @property
    def current(self) -> int:
        return self.step if self.step is not None else _read_iterations(self._model)


# ------------------------------------------------------------ file outputs
class _RunFiles:
    """A monitor's run directory: TensorBoard events plus the JSON-lines timeline.

    Each `fit` is one *attempt*; its records carry the attempt number, and the
    timeline is appended to, never truncated, so a run resumed with
    `BackupAndRestore` continues the same file.

    The training thread only puts records on a queue (about a microsecond);
    a background thread encodes them, writes the files and flushes them to
    disk at least once a second while there is something new, at epoch ends
    and at the end of training (so a run killed without `on_train_end`, as a
    preempted one is, loses about the last second of records). On `gs://` and
    other stores that cannot append, the timeline is rewritten whole at each
    flush, so there the periodic flush is once a minute. TensorBoard
    events are written with TensorBoard's own pure-Python event writer, not
    `tf.summary` ops: a `tf.summary.scalar` costs about 0.4 ms per call in
    eager mode, and writing and flushing in the training thread cost about
    0.2 ms per step, either of which alone would break a 2% overhead budget
    on a 10 ms step.
    """

    _FLUSH_EVERY_S = 1.0          # local files
    _REMOTE_FLUSH_EVERY_S = 60.0  # gs:// and the like: each flush rewrites the timeline

    def __init__(self, log_dir: str, subdir: str):
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.dir = os.path.join(log_dir, subdir)
        self._remote = "://" in self.dir
        self.timeline_path = os.path.join(self.dir, TIMELINE_FILE)
        self._lines: list[str] = []
        if self._remote:
            import tensorflow as tf

            tf.io.gfile.makedirs(self.dir)
            if tf.io.gfile.exists(self.timeline_path):
                with tf.io.gfile.GFile(self.timeline_path, "r") as f:
                    self._lines = f.read().splitlines(keepends=True)
            self.attempt = _last_attempt(self._lines[-50:]) + 1
            self._file = None
        else:
            os.makedirs(self.dir, exist_ok=True)
            self.attempt = _last_attempt(_tail_lines(self.timeline_path)) + 1
            self._file = open(self.timeline_path, "a", encoding="utf-8")  # noqa: SIM115
        self._events = EventFileWriter(self.dir, flush_secs=30)
        self._flush_every = self._REMOTE_FLUSH_EVERY_S if self._remote else self._FLUSH_EVERY_S
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True,
                                        name=f"keras_tpu_mem-{subdir}-writer")
        self._thread.start()

    # -------------------------------------------------- training thread
    def _put(self, item) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(f"writing {self.dir} failed: {error}") from error
        self._queue.put(item)

    def record(self, record: dict) -> None:
        """Appends one timeline record (the attempt number is added)."""
        record["attempt"] = self.attempt
        self._put(("record", record))

    def scalars(self, step: int, values: dict, wall_time: float | None = None) -> None:
        """Writes TensorBoard scalars `{tag: value}` at `step`; None and NaN are skipped."""
        self._put(("scalars", int(step), values, wall_time or time.time()))

    def flush(self, timeout: float = 30.0) -> None:
        """Blocks until everything queued so far is on disk."""
        done = threading.Event()
        self._put(("flush", done))
        done.wait(timeout)

    def write_summary(self, summary: dict) -> None:
        path = os.path.join(self.dir, SUMMARY_FILE)
        text = json.dumps(summary, indent=2, default=str)
        if self._remote:
            import tensorflow as tf

            with tf.io.gfile.GFile(path + ".tmp", "w") as f:
                f.write(text)
            tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
        else:
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._queue.put(None)
            self._thread.join(timeout=30.0)
            self._events.close()
            if self._file is not None:
                self._file.close()
                self._file = None

    # ------------------------------------------------ writer thread
    def _work(self) -> None:
        last_flush, dirty = time.monotonic(), False
        while True:
            try:
                item = self._queue.get(timeout=min(self._flush_every / 2, 0.5))
            except queue.Empty:
                # Idle: put what was written on disk, so that a run killed
                # without on_train_end (a preemption) loses at most ~1 s of it.
                if dirty and time.monotonic() - last_flush > self._flush_every:
                    self._safely(self._flush_files)
                    last_flush, dirty = time.monotonic(), False
                continue
            if item is None:
                return
            kind = item[0]
            if kind == "record":
                self._safely(self._write_line, item[1])
                dirty = True
            elif kind == "scalars":
                self._safely(self._write_event, *item[1:])
                dirty = True
            elif kind == "flush":
                self._safely(self._flush_files)
                last_flush, dirty = time.monotonic(), False
                item[1].set()
            if dirty and time.monotonic() - last_flush > self._flush_every:
                self._safely(self._flush_files)
                last_flush, dirty = time.monotonic(), False

    def _safely(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as err:  # reported to the training thread at its next write
            self._error = err

    def _write_line(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        if self._file is not None:
            self._file.write(line)
        else:
            self._lines.append(line)

    def _write_event(self, step, values, wall_time) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        summary = summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
            for tag, value in values.items()
            if value is not None and math.isfinite(value)
        ])
        self._events.add_event(event_pb2.Event(wall_time=wall_time, step=step, summary=summary))

    def _flush_files(self) -> None:
        if self._file is not None:
            self._file.flush()
        else:
            # Object stores cannot append: rewrite the whole file, then move it
            # over the old one (a crash in between leaves the old one intact).
            import tensorflow as tf

            tmp = self.timeline_path + ".tmp"
            with tf.io.gfile.GFile(tmp, "w") as f:
                f.write("".join(self._lines))
            tf.io.gfile.rename(tmp, self.timeline_path, overwrite=True)
        self._events.flush()


def _tail_lines(path: str, nbytes: int = 65536) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - nbytes))
        data = f.read().decode("utf-8", errors="replace")
    return data.splitlines()


def _last_attempt(lines) -> int:
    last = 0
    for line in lines:
        try:
            last = max(last, int(json.loads(line).get("attempt", 0)))
        except (ValueError, TypeError, AttributeError):
            continue  # a line cut short by a crash
    return last


class _MonitorBase(keras.callbacks.Callback):
    """Shared plumbing: argument checks, the guard, the step counter, the files."""

    _subdir = ""

    def __init__(self, log_dir, every_n_steps):
        super().__init__()
        self.log_dir = _check_log_dir(log_dir)
        self.every_n_steps = _check_int(every_n_steps, "every_n_steps", 1)
        self._disabled = False
        self._files: _RunFiles | None = None
        self._notices: set[str] = set()
        self._counter: _StepCounter | None = None
        self._last_logged_step: int | None = None

    def _notice(self, key: str, message: str, *args, warning: bool = False) -> None:
        if key in self._notices:
            return
        self._notices.add(key)
        (logger.warning if warning else logger.info)(message, *args)

    def _open_files(self) -> None:
        self._close_files()
        if self.log_dir is not None:
            self._files = _RunFiles(self.log_dir, self._subdir)

    def _close_files(self) -> None:
        if self._files is not None:
            files, self._files = self._files, None
            files.close()

    def _should_log(self, first: bool, prev_step: int, step: int) -> bool:
        n = self.every_n_steps
        return first or step // n > prev_step // n

    @property
    def run_dir(self) -> str | None:
        """Where this monitor writes (`log_dir/<subdir>`), or `None` without `log_dir`."""
        return None if self.log_dir is None else os.path.join(self.log_dir, self._subdir)


# ================================================================ HBMMonitor
_PHASES = ("compile", "train", "eval")


@dataclasses.dataclass
class _DeviceStats:
    peaks: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(_PHASES))
    best: int | None = None        # highest compile/train reading of the fit
    peak_step: int | None = None   # the step it was read at
    epoch_train_peak: int | None = None
    epoch_eval_peak: int | None = None
    current: int | None = None

    @property
    def max_peak(self) -> int | None:
        values = [v for v in self.peaks.values() if v is not None]
        return max(values) if values else None


def _max(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


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
      and a JSON-lines timeline under `log_dir/ktm_memory/`;
    * keeps the first-step (trace + compile + first step), training and
      evaluation peaks apart by resetting the allocator's peak counter
      (`tf.config.experimental.reset_memory_stats`) between phases and epochs;
    * warns once per `fit`, with the numbers and what to try, when the headroom
      `1 - peak / capacity` falls below `warn_headroom`;
    * prints a per-device table at the end of training: peaks per phase,
      capacity, headroom and the step of the peak.

    Where the memory cannot be read (the CPU allocator with oneDNN off,
    `TF_ENABLE_ONEDNN_OPTS=0`; some plugins) it says so once and training goes
    on without the keys. It never breaks a run. (The CPU allocator counts only
    allocations of 256 KiB and more, so tiny models read close to 0 on CPU.)

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
        self._stats: dict[str, _DeviceStats] = {}
        self._in_fit = False
        self._active = False
        self._phase = "train"
        self._capacity_source = None
        self.summary: dict | None = None

    # ------------------------------------------------------------ plumbing
    def _setup(self) -> bool:
        """Finds the devices and checks they can be read; False if none can."""
        self._devices = _resolve_devices(self.model.distribute_strategy)
        self._capacity_source = _assign_capacity(self._devices, self.capacity_bytes)
        unreadable = [d for d in self._devices if _read(d) is None]
        if unreadable:
            names = ", ".join(d.label for d in unreadable)
            self._notice(
                "unreadable",
                "HBMMonitor: cannot read memory on %s: TensorFlow keeps no allocator "
                "statistics there%s. Training continues without memory logging for %s.",
                names,
                " (on CPU this happens with oneDNN off, TF_ENABLE_ONEDNN_OPTS=0)"
                if any(d.shared for d in unreadable) else "",
                "it" if len(unreadable) == 1 else "them",
                warning=True,
            )
            self._devices = [d for d in self._devices if d not in unreadable]
        self._stats = {d.label: _DeviceStats() for d in self._devices}
        return bool(self._devices)

    def _reset_peaks(self) -> None:
        for device in self._devices:
            if not _reset(device):
                self._notice(
                    "reset",
                    "HBMMonitor: cannot reset the peak counter of %s; its peaks count "
                    "from the start of the process, so first-step, training and "
                    "evaluation peaks are not separated.", device.label,
                )

    def _take_reading(self, phase: str) -> dict[str, tuple[int, int]]:
        readings = {}
        for device in self._devices:
            value = _read(device)
            if value is None:
                continue
            current, peak = value
            readings[device.label] = value
            stats = self._stats[device.label]
            stats.current = current
            stats.peaks[phase] = _max(stats.peaks[phase], peak)
            if phase == "eval":
                stats.epoch_eval_peak = _max(stats.epoch_eval_peak, peak)
            else:
                stats.epoch_train_peak = _max(stats.epoch_train_peak, peak)
                if stats.best is None or peak > stats.best:
                    stats.best = peak
                    stats.peak_step = self._counter.current if self._counter else None
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
        prefix = "hbm_eval" if phase == "eval" else "hbm"
        for label, (current, peak) in readings.items():
            device = by_label[label]
            record_devices[label] = {
                "current_bytes": current,
                "peak_bytes": peak,
                "capacity_bytes": device.capacity,
                "shared": device.shared,
                "replicas": list(device.replicas),
            }
            scalars[f"{prefix}/{device.tag}/current_gib"] = current / _GIB
            scalars[f"{prefix}/{device.tag}/peak_gib"] = peak / _GIB
            if device.capacity:
                scalars[f"{prefix}/{device.tag}/utilization"] = peak / device.capacity
        self._files.record({
            "step": step,
            "time": now,
            "phase": phase,
            "epoch": self._epoch,
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
        self._counter.batch_end(batch)
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
        result = {"capacity_source": self._capacity_source, "devices": {}}
        for device in self._devices:
            stats = self._stats[device.label]
            peak = stats.max_peak
            headroom = (1.0 - peak / device.capacity) if (
                peak is not None and device.capacity) else None
            result["devices"][device.label] = {
                "compile_peak_bytes": stats.peaks["compile"],
                "train_peak_bytes": stats.peaks["train"],
                "eval_peak_bytes": stats.peaks["eval"],
                "capacity_bytes": device.capacity,
                "headroom": headroom,
                "peak_step": stats.peak_step,
                "shared": device.shared,
                "replicas": list(device.replicas),
            }
        return result

    def _log_table(self, title="HBMMonitor") -> None:
        summary = self._summary()
        rows = [("device", "first step", "training", "evaluation", "capacity",
                 "headroom", "peak at step")]
        for label, info in summary["devices"].items():
            headroom = info["headroom"]
            rows.append((
                label,
                _fmt_bytes(info["compile_peak_bytes"]),
                _fmt_bytes(info["train_peak_bytes"]),
                _fmt_bytes(info["eval_peak_bytes"]),
                devices.format_bytes(info["capacity_bytes"]),
                "unknown" if headroom is None else f"{100 * headroom:.1f}%",
                "-" if info["peak_step"] is None else str(info["peak_step"]),
            ))
        logger.info("%s: peak memory per device (capacity: %s)\n%s", title,
                    summary["capacity_source"], format_table(rows))
        self.summary = summary


def _fmt_bytes(num) -> str:
    return "-" if num is None else devices.format_bytes(num)


def format_table(rows) -> str:
    """Formats rows of strings as left-aligned columns (first row is the header)."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in rows
    )


# ======================================================== input measurement
@dataclasses.dataclass(frozen=True)
class InputRate:
    """How fast a dataset yields batches on its own.

    Attributes:
        batches_per_sec: Batches per second over the timed batches.
        samples_per_sec: Samples per second, or `None` if the batch size is unknown.
        batches: Batches timed (after the warm-up batches).
        seconds: Wall time of the timed batches.
        batch_size: Samples per batch (mean over the timed batches), or `None`.
    """

    batches_per_sec: float
    samples_per_sec: float | None
    batches: int
    seconds: float
    batch_size: float | None


def _leading_dim(element) -> int | None:
    """Samples in one (possibly per-replica) batch element or spec."""
    import tensorflow as tf

    leaf = tf.nest.flatten(element)[0] if element is not None else None
    if leaf is None:
        return None
    shape = getattr(leaf, "shape", None)
    if shape is None:
        # A PerReplicaSpec (distributed iterator) or a PerReplica value: the
        # global batch is the sum of the replicas' batches.
        parts = getattr(leaf, "_component_specs", None) or getattr(leaf, "values", None)
        if not parts or not isinstance(parts, (list, tuple)):
            return None
        sizes = [_leading_dim(part) for part in parts]
        return None if any(s is None for s in sizes) else sum(sizes)
    if shape.rank is None or shape.rank == 0:
        return None
    dim = shape[0]
    return None if dim is None else int(dim)


def _check_dataset(dataset, name="dataset"):
    import tensorflow as tf

    if dataset is None:
        return None
    if not isinstance(dataset, (tf.data.Dataset, tf.distribute.DistributedDataset)):
        raise TypeError(
            f"`{name}` must be None or the batched tf.data.Dataset given to fit "
            f"(or its distributed form); got {type(dataset).__name__}."
        )
    return dataset


def measure_input_rate(dataset, *, batches=20, warmup_batches=2, max_seconds=10.0) -> InputRate:
    """Times a dataset alone: how many batches per second it can deliver.

    Iterates a fresh iterator over `dataset`, drops `warmup_batches` (pipeline
    start-up, shuffle buffers), then times up to `batches` batches or
    `max_seconds`, whichever ends first. Compare `batches_per_sec` with the
    training steps per second: if they are close, the input pipeline, not the
    model, sets the pace.

    Limits: the pipeline runs here without the training step competing for the
    host CPU, so on a CPU-only machine it reads faster than it can during
    training (on a TPU or GPU host, where the step runs on the accelerator, the
    two agree better); Python iteration adds about 0.1 ms per batch; a
    `.cache()` that training already filled is read from the cache.

    Args:
        dataset: A batched `tf.data.Dataset` (or a distributed dataset).
        batches: Batches to time, >= 1.
        warmup_batches: Batches to drop before timing, >= 0.
        max_seconds: Stop timing after this many seconds (> 0).

    Returns:
        An `InputRate`.

    Raises:
        TypeError / ValueError: for arguments of the wrong type or range.
        ValueError: if the dataset ends before any batch could be timed.

    Example:

    ```python
    import tensorflow as tf
    import keras_tpu_mem as ktm

    ds = tf.data.Dataset.range(10_000).map(lambda i: tf.cast(i, "float32")).batch(128)
    rate = ktm.measure_input_rate(ds, batches=20)
    print(f"{rate.batches_per_sec:.0f} batches/s, {rate.samples_per_sec:.0f} samples/s")
    ```
    """
    _check_dataset(dataset)
    _check_int(batches, "batches", 1)
    _check_int(warmup_batches, "warmup_batches", 0)
    if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)):
        raise TypeError(f"`max_seconds` must be a positive number, got {max_seconds!r}.")
    if not max_seconds > 0:
        raise ValueError(f"`max_seconds` must be a positive number, got {max_seconds}.")

    iterator = iter(dataset)
    skipped = 0
    for _ in range(warmup_batches):
        try:
            next(iterator)
        except StopIteration:
            break
        skipped += 1
    count = 0
    samples = 0
    sizes_known = True
    start = time.perf_counter()
    while count < batches:
        try:
            element = next(iterator)
        except StopIteration:
            break
        count += 1
        size = _leading_dim(element)
        if size is None:
            sizes_known = False
        else:
            samples += size
        if time.perf_counter() - start >= max_seconds:
            break
    seconds = time.perf_counter() - start
    if count == 0:
        raise ValueError(
            f"The dataset ended after {skipped} batch(es), all used as warm-up; lower "
            "`warmup_batches` or pass a longer dataset."
        )
    seconds = max(seconds, 1e-9)
    batch_size = samples / count if sizes_known else None
    return InputRate(
        batches_per_sec=count / seconds,
        samples_per_sec=samples / seconds if sizes_known else None,
        batches=count,
        seconds=seconds,
        batch_size=batch_size,
    )


def input_verdict(train_steps_per_sec: float, input_batches_per_sec: float) -> tuple[str, str]:
    """Names the bottleneck from the two rates: `("input" | "balanced" | "compute", sentence)`."""
    ratio = input_batches_per_sec / train_steps_per_sec
    rates = (f"the input pipeline alone delivers {input_batches_per_sec:,.1f} batches/s; "
             f"training ran at {train_steps_per_sec:,.1f} steps/s ({ratio:.2f}x)")
    if ratio < 1.2:
        return "input", (
            f"bottleneck: input pipeline. {rates[0].upper() + rates[1:]}, so the step "
            "waits for data. Try .cache() after expensive maps, "
            "map(..., num_parallel_calls=tf.data.AUTOTUNE), .prefetch(tf.data.AUTOTUNE), "
            "or moving preprocessing into the model."
        )
    if ratio < 2.0:
        return "balanced", (
            f"bottleneck: train step, with little slack in the input pipeline. "
            f"{rates[0].upper() + rates[1:]}; a slower pipeline (bigger batch, heavier "
            "augmentation) would make it the bottleneck."
        )
    return "compute", (
        f"bottleneck: train step; the input pipeline keeps up. "
        f"{rates[0].upper() + rates[1:]}."
    )


# ========================================================== ThroughputMonitor
class _BatchSizeProbe:
    """Stands in for `model.train_function` for one call to read the batch shape.

    On its first call it puts the original function back, reads
    `iterator.element_spec` (per-replica specs are summed into the global
    batch), and runs the original. Nothing inside the compiled step changes.
    """

    def __init__(self, model, original, callback):
        self._model = model
        self._original = original
        self._callback = callback

    def __call__(self, iterator, *args, **kwargs):
        if self._model.train_function is self:
            self._model.train_function = self._original
        try:
            self._callback(_leading_dim(getattr(iterator, "element_spec", None)))
        except Exception:
            pass
        return self._original(iterator, *args, **kwargs)


class ThroughputMonitor(_MonitorBase):
    """Logs samples/s, steps/s, step time and the first-step (compile) time of `fit`.

    Time is taken on the host around each execution Keras runs (one
    `on_train_batch_begin`/`on_train_batch_end` pair per `steps_per_execution`
    steps): an interval runs from the end of the previous execution (or the
    start of the epoch) to the end of this one, so it includes waiting for
    input and the callbacks' own time, and excludes validation and epoch-end
    work. Steps are counted per execution, the last, shorter execution of an
    epoch included.

    Samples per step (the global batch) come from, in order: `batch_size`; the
    static batch dimension of `dataset`; the static batch dimension of the
    data `fit` iterates, read once from the iterator's `element_spec` at the
    first step (per-replica parts summed). A batch whose size is not static
    (`drop_remainder=False`, or arrays whose length is not a multiple of the
    batch) gives `None` there: pass `batch_size` then, or only steps/s and step
    time are logged.

    Logged keys (batch logs: per logged interval; epoch logs: over the epoch's
    steps after the first `warmup_steps` steps of the `fit`, NaN if none):
    `samples_per_sec`, `steps_per_sec`, `step_time_ms`; epoch logs also
    `first_step_s`, the wall time of the first execution of the `fit` (trace,
    XLA compilation and the first `steps_per_execution` steps).

    With `dataset`, at the end of training the input pipeline is timed alone
    (`measure_input_rate`) and compared with the training step rate; the
    result names the bottleneck (`"input"`, `"balanced"` or `"compute"`) and
    is logged, written to TensorBoard and kept in `self.summary`.

    Args:
        log_dir: Directory for TensorBoard events and the timeline; files go to
            `log_dir/ktm_throughput/`. `None` logs to `logs` and the console only.
        warmup_steps: Steps at the start of the `fit` left out of the epoch and
            run averages, >= 0 (the first execution, which compiles, is always
            reported separately as `first_step_s`).
        every_n_steps: Log an interval every this many training steps, >= 1.
        batch_size: Global batch size (samples per step), if it cannot be read
            from the data.
        dataset: The batched `tf.data.Dataset` passed to `fit`, to read the
            batch size and to time the input pipeline at the end of training.
        input_batches: Batches to time when measuring `dataset`, >= 1.

    Example:

    ```python
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_tpu_mem as ktm

    x, y = np.random.rand(2048, 64).astype("float32"), np.random.randint(0, 10, 2048)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(128, drop_remainder=True)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  steps_per_execution=4)
    history = model.fit(ds, epochs=2, verbose=0,
                        callbacks=[ktm.ThroughputMonitor("logs", dataset=ds)])
    print(history.history["samples_per_sec"])
    ```
    """

    _subdir = THROUGHPUT_SUBDIR

    def __init__(self, log_dir=None, *, warmup_steps=2, every_n_steps=1, batch_size=None,
                 dataset=None, input_batches=20):
        super().__init__(log_dir, every_n_steps)
        self.warmup_steps = _check_int(warmup_steps, "warmup_steps", 0)
        self.batch_size = _check_optional_positive_int(batch_size, "batch_size")
        self.dataset = _check_dataset(dataset)
        self.input_batches = _check_int(input_batches, "input_batches", 1)
        self.summary: dict | None = None

    # ---------------------------------------------------------- batch size
    def _resolve_batch_size(self) -> None:
        self._batch = self.batch_size
        self._batch_source = "batch_size argument"
        if self._batch is None and self.dataset is not None:
            self._batch = _leading_dim(self.dataset.element_spec)
            self._batch_source = "dataset's static batch dimension"
        if self._batch is None:
            original = getattr(self.model, "train_function", None)
            if callable(original) and not isinstance(original, _BatchSizeProbe):
                self.model.train_function = _BatchSizeProbe(self.model, original, self._probed)
            self._batch_source = "the static batch dimension of the data fit iterates"

    def _probed(self, size):
        if self._batch is None and size:
            self._batch = size

    def _remove_probe(self):
        fn = getattr(self.model, "train_function", None)
        if isinstance(fn, _BatchSizeProbe):
            self.model.train_function = fn._original

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        self._disabled = False
        self._begin_train()

    @_never_raise
    def _begin_train(self):
        self._counter = _StepCounter(self.model, self.params)
        self._resolve_batch_size()
        self._open_files()
        self._first = True
        self._epoch = 0
        self._last_logged_step = None
        self._steps_in_fit = 0
        self.first_step_s = None
        self._exec_start = None
        self._fit = [0, 0.0]    # steps, seconds after warm-up
        self._epoch_acc = [0, 0.0]  # steps, seconds after warm-up, this epoch
        self._interval = [0, 0.0, False]  # steps, seconds, holds warm-up steps

    @_never_raise
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = int(epoch)
        self._counter.epoch_begin()
        self._exec_start = time.perf_counter()
        self._epoch_acc = [0, 0.0]

    @_never_raise
    def on_train_batch_begin(self, batch, logs=None):
        if self._exec_start is None:  # a loop that skips on_epoch_begin
            self._exec_start = time.perf_counter()
        self._counter.batch_begin(batch)

    @_never_raise
    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        start = self._exec_start if self._exec_start is not None else now
        seconds = now - start
        self._exec_start = now
        prev = self._counter.current
        steps = self._counter.batch_end(batch)
        warmup = self._steps_in_fit < self.warmup_steps
        self._steps_in_fit += steps
        if self._first:
            self.first_step_s = seconds
        if not warmup:
            self._fit[0] += steps
            self._fit[1] += seconds
            self._epoch_acc[0] += steps
            self._epoch_acc[1] += seconds
        interval = self._interval
        interval[0] += steps
        interval[1] += seconds
        interval[2] = interval[2] or warmup
        if self._should_log(self._first, prev, self._counter.current):
            self._log_interval(logs)

    def _log_interval(self, logs=None) -> None:
        """Writes the steps since the last record as one record; fills batch `logs`."""
        steps, seconds, has_warmup = self._interval
        self._interval = [0, 0.0, False]
        phase = "compile" if self._first else ("warmup" if has_warmup else "train")
        values = self._rates(steps, seconds)
        keys = ("samples_per_sec", "steps_per_sec", "step_time_ms")
        if self._files is not None:
            step = self._counter.current
            record = {"step": step, "time": time.time(), "phase": phase, "epoch": self._epoch,
                      "steps": steps, "samples": values.get("samples"), "seconds": seconds}
            record.update({k: values.get(k) for k in keys})
            self._files.record(record)
            if self._first:
                self._files.scalars(step, {"throughput/first_step_s": seconds})
            else:
                self._files.scalars(step, {f"throughput/{k}": values.get(k) for k in keys})
            self._last_logged_step = step
        if logs is not None:
            logs.update({k: values[k] for k in keys if k in values})
        self._first = False

    def _rates(self, steps: int, seconds: float) -> dict:
        seconds = max(seconds, 1e-9)
        values = {"steps": steps, "seconds": seconds, "steps_per_sec": steps / seconds,
                  "step_time_ms": 1000.0 * seconds / steps if steps else float("nan")}
        if self._batch:
            values["samples"] = steps * self._batch
            values["samples_per_sec"] = steps * self._batch / seconds
        return values

    @_never_raise
    def on_epoch_end(self, epoch, logs=None):
        if self._interval[0]:
            self._log_interval()  # the epoch's last steps, short of every_n_steps
        if logs is None:
            return
        steps, seconds = self._epoch_acc
        nan = float("nan")
        if steps:
            values = self._rates(steps, seconds)
        else:
            values = {"steps_per_sec": nan, "step_time_ms": nan, "samples_per_sec": nan}
        keys = ["steps_per_sec", "step_time_ms"]
        if self._batch:
            keys.insert(0, "samples_per_sec")
        else:
            self._notice(
                "batch", "ThroughputMonitor: the global batch size is unknown: the data "
                "fit iterates has no static batch dimension (a last, smaller batch?). "
                "Logging steps/s and step time only; pass batch_size= to get samples/s.",
            )
        logs.update({k: values.get(k, nan) for k in keys})
        logs["first_step_s"] = self.first_step_s if self.first_step_s is not None else nan
        if self._files is not None:
            self._files.flush()

    @_never_raise
    def on_train_end(self, logs=None):
        self._remove_probe()
        steps, seconds = self._fit
        summary = {
            "batch_size": self._batch,
            "batch_size_source": self._batch_source if self._batch else None,
            "warmup_steps": self.warmup_steps,
            "first_step_s": self.first_step_s,
            "steps": steps,
            "seconds": seconds,
        }
        if steps:
            summary.update({k: v for k, v in self._rates(steps, seconds).items()
                            if k in ("samples", "samples_per_sec", "steps_per_sec",
                                     "step_time_ms")})
        lines = []
        if steps:
            rate = (f"{summary['samples_per_sec']:,.1f} samples/s, " if self._batch else "")
            lines.append(
                f"{rate}{summary['steps_per_sec']:,.2f} steps/s, "
                f"{summary['step_time_ms']:,.2f} ms/step over {steps} steps after "
                f"{self.warmup_steps} warm-up step(s)"
            )
        if self.first_step_s is not None:
            lines.append(f"first execution (trace + compile + steps): {self.first_step_s:.2f} s")
        if self.dataset is not None and steps:
            summary.update(self._measure_input(summary["steps_per_sec"]))
            if summary.get("input_verdict"):
                lines.append(summary["input_verdict"])
        elif steps:
            lines.append("input pipeline not measured (pass dataset= to compare its rate "
                         "with the step rate)")
        self.summary = summary
        if lines:
            logger.info("ThroughputMonitor: %s", "\n  ".join(lines))
        if self._files is not None:
            self._files.write_summary(summary)
        self._close_files()

    def _measure_input(self, steps_per_sec: float) -> dict:
        try:
            rate = measure_input_rate(self.dataset, batches=self.input_batches)
        except Exception as err:
            self._notice("input", "ThroughputMonitor: could not time the input pipeline "
                         "(%s: %s).", type(err).__name__, err)
            return {}
        bottleneck, sentence = input_verdict(steps_per_sec, rate.batches_per_sec)
        result = {
            "input_batches_per_sec": rate.batches_per_sec,
            "input_samples_per_sec": rate.samples_per_sec,
            "input_batches_timed": rate.batches,
            "bottleneck": bottleneck,
            "input_verdict": sentence,
        }
        if self._files is not None:
            self._files.scalars(self._counter.current, {
                "throughput/input_batches_per_sec": rate.batches_per_sec,
                "throughput/input_samples_per_sec": rate.samples_per_sec,
            })
        return result
