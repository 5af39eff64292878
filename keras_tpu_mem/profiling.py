"""Measure while you run: `ProfileWindow` (XProf capture) and `batch_size_sweep`.

* `ProfileWindow(log_dir, steps=(start, stop))` is a Keras callback that
  captures an XProf trace of training steps `start .. stop-1` into
  `log_dir/plugins/profile/<run>/`, which TensorBoard's Profile tab opens
  (`mode="local"`), or starts the profiler server so a TPU profile can be
  captured from TensorBoard's "Capture Profile" button (`mode="server"`).
  After a local capture it logs a short summary read with xprof's converters,
  without a server: the step time from the overview page and, for XLA-compiled
  steps, the memory viewer's peak heap.
* `batch_size_sweep(build_fn, dataset_fn, batch_sizes)` trains a few steps at
  each batch size and returns samples per second and the allocator's peak
  bytes, stopping at the first out-of-memory error; it can draw both against
  the batch size in a PNG.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence

import keras

from keras_tpu_mem import devices
from keras_tpu_mem._utils import logger, require_tensorflow_backend

_MODES = ("local", "server")
# Profiler servers started in this process, by port: TensorFlow offers no way
# to stop one, and a second start on the same port would fail.
_SERVERS: dict[int, bool] = {}


# --------------------------------------------------------------------------
# xprof conversion without a server
# --------------------------------------------------------------------------
class _Converter:
    """Finds an XSpace converter: xprof, tensorboard_plugin_profile or TF's own.

    All of them wrap the same C++ `xspace_to_tools_data(paths, tool, options)`;
    the pure-Python wrapper of newer xprof releases can fail to import on an
    older protobuf (TensorFlow 2.19 pins protobuf 5, xprof 2.22 is generated
    with protobuf 6), so the raw binding is tried next.
    """

    def __init__(self):
        self.name = None
        self.reason = None
        self._raw = None
        errors = []
        candidates = (
            ("xprof", "xprof.convert._pywrap_profiler_plugin"),
            ("tensorboard_plugin_profile",
             "tensorboard_plugin_profile.convert._pywrap_profiler_plugin"),
            ("tensorflow", "tensorflow.python.profiler.internal._pywrap_profiler_plugin"),
        )
        import importlib

        for name, module_name in candidates:
            try:
                module = importlib.import_module(module_name)
            except Exception as err:  # ImportError, protobuf VersionError, ...
                errors.append(f"{module_name}: {type(err).__name__}")
                continue
            if hasattr(module, "xspace_to_tools_data"):
                self.name, self._raw = name, module.xspace_to_tools_data
                return
            errors.append(f"{module_name}: no xspace_to_tools_data")
        self.reason = "no XSpace converter could be imported (" + "; ".join(errors) + ")"

    @property
    def available(self) -> bool:
        return self._raw is not None

    def tool_names(self, paths: list[str]) -> list[str]:
        data, ok = self._raw(paths, "tool_names")
        if not ok:
            return []
        data = data.decode() if isinstance(data, bytes) else str(data)
        return [t for t in data.split(",") if t]

    def tool(self, paths: list[str], tool: str, options: dict | None = None):
        data, ok = self._raw(paths, tool, dict(options or {}))
        if not ok or not data:
            return None
        if isinstance(data, bytes):
            data = data.decode("utf-8", errors="replace")
        return json.loads(data)


@dataclasses.dataclass(frozen=True)
class ProfileSummary:
    """What `ProfileWindow` read back from one capture.

    Attributes:
        run_dir: The run directory TensorBoard lists (`log_dir/plugins/profile/<run>`).
        xplane_path: The captured `*.xplane.pb`.
        first_step, last_step: Training steps (0-based, this `fit` call) traced.
        steps_per_execution: Steps in each traced execution.
        step_time_ms: Average time of one traced execution from the overview
            page (`None` where unknown), and its min / max.
        peak_heap_bytes: The memory viewer's peak heap of the largest XLA
            module captured (`None` where no XLA module was captured).
        module_name: That module's name.
        wall_ms_per_step: Host wall-clock time per traced step, measured by
            the callback around each execution (profiler on), or None.
        note: Why a part is missing, if it is.
    """

    run_dir: str
    xplane_path: str
    first_step: int
    last_step: int
    steps_per_execution: int = 1
    step_time_ms: float | None = None
    step_time_min_ms: float | None = None
    step_time_max_ms: float | None = None
    peak_heap_bytes: int | None = None
    module_name: str | None = None
    wall_ms_per_step: float | None = None
    note: str | None = None

    def text(self) -> str:
        lines = [f"ProfileWindow: captured steps {self.first_step}..{self.last_step} into "
                 f"{self.run_dir}"]
        if self.step_time_ms is not None:
            spe = self.steps_per_execution
            unit = "step" if spe == 1 else f"execution of {spe} steps"
            line = (f"  step time (overview page): {self.step_time_ms:.2f} ms per {unit} "
                    f"(min {self.step_time_min_ms:.2f}, max {self.step_time_max_ms:.2f})")
            if spe > 1:
                line += f" = {self.step_time_ms / spe:.2f} ms per step"
            lines.append(line)
        if self.wall_ms_per_step is not None:
            lines.append(f"  host wall clock: {self.wall_ms_per_step:.2f} ms per step over "
                         f"{self.last_step - self.first_step + 1} steps (profiler on)")
        if self.peak_heap_bytes is not None:
            lines.append(f"  XLA peak heap (memory viewer): "
                         f"{devices.format_bytes(self.peak_heap_bytes)} in {self.module_name}")
        if self.note:
            lines.append(f"  note: {self.note}")
        lines.append(f"  open it: tensorboard --logdir "
                     f"{os.path.dirname(os.path.dirname(os.path.dirname(self.run_dir)))} "
                     "-> Profile")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


_HLO_FILE_RE = re.compile(r"^(?P<name>.+?)(?:\((?P<pid>\d+)\))?\.hlo_proto\.pb$")


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _xspace_class():
    for module_name in ("tensorflow.tsl.profiler.protobuf.xplane_pb2",
                        "tsl.profiler.protobuf.xplane_pb2"):
        try:
            import importlib

            return importlib.import_module(module_name).XSpace
        except Exception:
            continue
    return None


def executed_xla_modules(xplane_path: str) -> set[str] | None:
    """Names of the XLA modules that ran in a capture, or None if unreadable.

    The profiler stores every XLA module compiled so far in the process in the
    capture's metadata, also those that did not run in the window. Execution
    events carry an `hlo_module` stat (XLA:CPU thunks, TPU/GPU ops) and device
    planes have an "XLA Modules" line; those name the modules that ran.
    """
    xspace_cls = _xspace_class()
    if xspace_cls is None:
        return None
    space = xspace_cls()
    try:
        with open(xplane_path, "rb") as handle:
            space.ParseFromString(handle.read())
    except Exception:
        return None
    names: set[str] = set()
    for plane in space.planes:
        stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
        module_ids = {k for k, n in stat_names.items() if n == "hlo_module"}
        for line in plane.lines:
            if line.name == "XLA Modules":
                for event in line.events:
                    meta = plane.event_metadata.get(event.metadata_id)
                    if meta is not None:
                        names.add(re.sub(r"\(\d+\)$", "", meta.name))
                continue
            if not module_ids:
                continue
            for event in line.events:
                for stat in event.stats:
                    if stat.metadata_id in module_ids:
                        value = stat.str_value or stat_names.get(stat.ref_value, "")
                        if value:
                            names.add(re.sub(r"\(\d+\)$", "", value))
    return names


def summarize_profile(xplane_path: str, *, first_step: int = 0, last_step: int = 0,
                      steps_per_execution: int = 1) -> ProfileSummary:
    """Reads step time and XLA peak memory from a captured `*.xplane.pb`.

    Converts a temporary copy, so the converters' cache files (`*.hlo_proto.pb`,
    `*.op_stats*.pb`) never land in the run directory: it keeps only what
    TensorFlow's profiler wrote, as TensorBoard would have found it.
    """
    run_dir = os.path.dirname(xplane_path)
    base = dict(run_dir=run_dir, xplane_path=xplane_path, first_step=first_step,
                last_step=last_step, steps_per_execution=steps_per_execution)
    converter = _Converter()
    if not converter.available:
        return ProfileSummary(**base, note=f"no summary: {converter.reason}; open it in "
                                           "TensorBoard's Profile tab instead")
    notes = []
    step = dict(step_time_ms=None, step_time_min_ms=None, step_time_max_ms=None)
    peak = module = None
    with tempfile.TemporaryDirectory(prefix="ktm_xprof_") as tmp:
        copy = os.path.join(tmp, os.path.basename(xplane_path))
        shutil.copyfile(xplane_path, copy)
        try:
            tools = converter.tool_names([copy])  # also writes the HLO protos
        except Exception as err:  # a converter crash must not end training
            tools = []
            notes.append(f"tool list failed ({type(err).__name__}: {err})")
        if "overview_page" in tools:
            try:
                overview = converter.tool([copy], "overview_page")
                props = overview[1]["p"] if overview else {}
                average = _float(props.get("steptime_ms_average"))
                if average:
                    step = dict(step_time_ms=average,
                                step_time_min_ms=_float(props.get("steptime_ms_minimum")),
                                step_time_max_ms=_float(props.get("steptime_ms_maximum")))
                else:
                    notes.append("the overview page measured no step time; see the host wall clock")
            except Exception as err:
                notes.append(f"overview page failed ({type(err).__name__}: {err})")
        ran = executed_xla_modules(copy) if "memory_viewer" in tools else None
        if "memory_viewer" in tools:
            for path in glob.glob(os.path.join(tmp, "*.hlo_proto.pb")):
                match = _HLO_FILE_RE.match(os.path.basename(path))
                if not match or (ran is not None and match.group("name") not in ran):
                    continue  # compiled earlier in the process, not run in the window
                # The module is named as the converter named its file,
                # program id included: "a_inference_..._803__.7(0)".
                full_name = os.path.basename(path)[: -len(".hlo_proto.pb")]
                options = {"module_name": full_name,
                           "view_memory_allocation_timeline": False, "memory_space": ""}
                try:
                    viewer = converter.tool([copy], "memory_viewer", options)
                except Exception as err:
                    notes.append(f"memory viewer failed ({type(err).__name__}: {err})")
                    continue
                mib = _float((viewer or {}).get("peakHeapMib"))
                if mib is not None and (peak is None or mib * 2**20 > peak):
                    peak, module = int(round(mib * 2**20)), match.group("name")
        if peak is None and "memory_viewer" in tools:
            notes.append("no XLA-compiled step ran in the window (compile with "
                         "jit_compile=True, as on TPU, to see XLA's peak heap)")
    return ProfileSummary(**base, **step, peak_heap_bytes=peak, module_name=module,
                          note="; ".join(notes) or None)


# --------------------------------------------------------------------------
# ProfileWindow
# --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


def _run_dirs(log_dir: str) -> set[str]:
    root = os.path.join(log_dir, "plugins", "profile")
    if not os.path.isdir(root):
        return set()
    return {os.path.join(root, d) for d in os.listdir(root)}


class ProfileWindow(keras.callbacks.Callback):
    """Captures an XProf profile of a window of training steps.

    Steps are counted from 0 at the start of each `fit` call, over epochs, the
    way `model.optimizer.iterations` advances: `steps=(10, 15)` traces steps
    10, 11, 12, 13 and 14. With `steps_per_execution=N` Keras runs N steps per
    call of its train function, so the trace covers whole executions: it
    starts before the execution holding step `start` and stops after the one
    holding step `stop - 1` (the summary says which steps were traced). Each
    traced execution is marked as a step for XProf's overview page.

    `mode="local"`: the trace is written to `log_dir/plugins/profile/<run>/`
    (open it with `tensorboard --logdir LOG_DIR`, Profile tab) and a short
    summary is logged (step time, and XLA's peak heap for `jit_compile=True`
    steps, read with xprof's converters from a temporary copy, so the run
    directory holds only what TensorBoard itself would write). Several windows
    in one run each give their own run directory.

    `mode="server"`: starts TensorFlow's profiler server on `port` (a free one
    if None) when training begins, and logs when the window's steps run, so a
    profile can be captured from TensorBoard's Profile tab ("Capture Profile",
    address `localhost:PORT`, or the TPU VM's host name) or with
    `tf.profiler.experimental.client.trace`. That is the documented way to
    profile a Cloud TPU. The server lives until the process ends.

    Another profiler already running (Keras' `TensorBoard(profile_batch=...)`,
    a second overlapping `ProfileWindow`) is reported in the log, not raised:
    the window is then skipped.

    Args:
        log_dir: Where TensorBoard reads logs; the profile goes under
            `log_dir/plugins/profile/`.
        steps: `(start, stop)` with `0 <= start < stop`: steps start..stop-1.
        mode: `"local"` or `"server"`.
        port: The server's port (`mode="server"` only).
        summary: Log the summary after a local capture (default True).

    Example:

    ```python
    model.compile(..., jit_compile=True, steps_per_execution=4)
    model.fit(ds, epochs=2, callbacks=[ktm.ProfileWindow("logs", steps=(8, 16))])
    # tensorboard --logdir logs  -> Profile
    ```
    """

    def __init__(self, log_dir, steps=(10, 15), *, mode: str = "local",
                 port: int | None = None, summary: bool = True):
        super().__init__()
        require_tensorflow_backend("ProfileWindow")
        if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
            raise TypeError(f"`log_dir` must be a non-empty path, got {log_dir!r}.")
        if (not isinstance(steps, (tuple, list)) or len(steps) != 2
                or any(isinstance(s, bool) or not isinstance(s, int) for s in steps)):
            raise TypeError(f"`steps` must be a (start, stop) pair of ints, got {steps!r}.")
        start, stop = steps
        if start < 0 or stop <= start:
            raise ValueError(
                f"`steps` must satisfy 0 <= start < stop (steps start..stop-1 are traced), "
                f"got {tuple(steps)}."
            )
        if mode not in _MODES:
            raise ValueError(f"`mode` must be one of {_MODES}, got {mode!r}.")
        if port is not None:
            if mode != "server":
                raise ValueError("`port` applies to mode='server' only; mode='local' writes "
                                 "to log_dir.")
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"`port` must be an int in 1..65535, got {port!r}.")
        self.log_dir = os.fspath(log_dir)
        self.start, self.stop = int(start), int(stop)
        self.mode = mode
        self.port = port
        self.summary = bool(summary)
        self.summaries: list[ProfileSummary] = []
        self.captured_runs: list[str] = []
        self._reset_state()

    def _reset_state(self):
        self._tracing = False
        self._done = False
        self._base = 0
        self._epoch_offset = 0
        self._counted = 0
        self._first_traced = None
        self._last_traced = None
        self._step_trace = None
        self._t_begin = None
        self._wall_s = 0.0
        self._wall_steps = 0
        self._runs_before: set[str] = set()
        self._announced = False

    # ------------------------------------------------------------ counting
    def _iterations(self) -> int | None:
        optimizer = getattr(self.model, "optimizer", None)
        iterations = getattr(optimizer, "iterations", None)
        if iterations is None:
            return None
        try:
            return int(keras.ops.convert_to_numpy(iterations))
        except Exception:
            return None

    def _spe(self) -> int:
        return max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))

    def on_train_begin(self, logs=None):
        self._reset_state()
        self._base = self._iterations() or 0
        if self.mode == "server":
            self._start_server()

    def on_epoch_begin(self, epoch, logs=None):
        now = self._iterations()
        # Keras numbers batches from 0 in every epoch; the optimizer counts on.
        self._epoch_offset = (now - self._base) if now is not None else self._counted

    def on_train_batch_begin(self, batch, logs=None):
        first = self._epoch_offset + int(batch)
        last = first + self._spe() - 1
        in_window = first < self.stop and last >= self.start
        if self.mode == "server":
            if in_window and not self._announced:
                self._announced = True
                logger.info("ProfileWindow: steps %d..%d run now; capture them from the "
                            "profiler server on port %s.", self.start, self.stop - 1, self.port)
        elif in_window and not self._tracing and not self._done:
            self._start_local(first)
        if self._tracing or self.mode == "server":
            import tensorflow as tf

            # A step marker per execution, as Keras' TensorBoard callback
            # sets: XProf's overview page measures step time from them.
            self._step_trace = tf.profiler.experimental.Trace(
                "train", step_num=first, _r=1)
            self._step_trace.__enter__()
        self._t_begin = (first, time.perf_counter()) if self._tracing else None

    def on_train_batch_end(self, batch, logs=None):
        # Keras reports the last step of a full execution even when the
        # epoch's last execution ran fewer steps; inside the window the
        # optimizer's counter (read after the step finished) is exact.
        last = self._epoch_offset + int(batch)
        if self._tracing:
            now = self._iterations()
            if now is not None:
                last = now - self._base - 1
        self._counted = max(self._counted, last + 1)
        if self._step_trace is not None:
            self._step_trace.__exit__(None, None, None)
            self._step_trace = None
        if self._tracing:
            if self._t_begin is not None:
                first, t0 = self._t_begin
                self._wall_s += time.perf_counter() - t0
                self._wall_steps += max(1, last - first + 1)
            self._last_traced = last
            if last >= self.stop - 1:
                self._stop_local()

    def on_train_end(self, logs=None):
        if self._step_trace is not None:
            self._step_trace.__exit__(None, None, None)
            self._step_trace = None
        if self._tracing:
            logger.info("ProfileWindow: training ended at step %s, before step %d; saving "
                        "what was traced.", self._last_traced, self.stop - 1)
            self._stop_local()

    # ---------------------------------------------------------- local mode
    def _start_local(self, first_step: int):
        import tensorflow as tf

        os.makedirs(self.log_dir, exist_ok=True)
        self._runs_before = _run_dirs(self.log_dir)
        try:
            tf.profiler.experimental.start(self.log_dir)
        except tf.errors.AlreadyExistsError:
            self._done = True
            logger.warning(
                "ProfileWindow(steps=(%d, %d)): another profiler is already running (Keras' "
                "TensorBoard(profile_batch=...) or another ProfileWindow whose steps overlap); "
                "this window is skipped. Profile with one of them at a time.",
                self.start, self.stop)
            return
        self._tracing = True
        self._first_traced = first_step

    def _stop_local(self):
        import tensorflow as tf

        self._tracing = False
        self._done = True
        # The profiler names a run after the current second: two windows
        # closing within one second would write into the same run directory.
        taken = {os.path.basename(d) for d in self._runs_before}
        while time.strftime("%Y_%m_%d_%H_%M_%S") in taken:
            time.sleep(0.05)
        try:
            tf.profiler.experimental.stop()
        except tf.errors.UnavailableError:
            logger.warning("ProfileWindow(steps=(%d, %d)): the profiler was stopped by someone "
                           "else (another profiling callback?); nothing saved by this window.",
                           self.start, self.stop)
            return
        new_runs = sorted(_run_dirs(self.log_dir) - self._runs_before)
        xplanes = [p for d in new_runs for p in glob.glob(os.path.join(d, "*.xplane.pb"))]
        if not xplanes:
            logger.warning("ProfileWindow: the profiler wrote no *.xplane.pb under %s.",
                           self.log_dir)
            return
        self.captured_runs.extend(new_runs)
        summary = ProfileSummary(run_dir=os.path.dirname(xplanes[0]), xplane_path=xplanes[0],
                                 first_step=self._first_traced, last_step=self._last_traced,
                                 steps_per_execution=self._spe())
        if self.summary:
            summary = summarize_profile(xplanes[0], first_step=self._first_traced,
                                        last_step=self._last_traced,
                                        steps_per_execution=self._spe())
        if self._wall_steps:
            summary = dataclasses.replace(
                summary, wall_ms_per_step=1000.0 * self._wall_s / self._wall_steps)
        if self.summary:
            logger.info("%s", summary.text())
        self.summaries.append(summary)

    # --------------------------------------------------------- server mode
    def _start_server(self):
        import tensorflow as tf

        if self.port is None:
            self.port = _free_port()
        if self.port in _SERVERS:
            logger.info("ProfileWindow: the profiler server already listens on port %d.",
                        self.port)
            return
        try:
            tf.profiler.experimental.server.start(self.port)
        except Exception as err:  # e.g. the port is taken by another process
            logger.warning("ProfileWindow: could not start the profiler server on port %d "
                           "(%s: %s).", self.port, type(err).__name__, err)
            return
        _SERVERS[self.port] = True
        logger.info(
            "ProfileWindow: profiler server listening on port %d. In TensorBoard "
            "(tensorboard --logdir %s) open Profile -> Capture Profile and enter "
            "localhost:%d (on a TPU VM, its host name), or run "
            "tf.profiler.experimental.client.trace('grpc://localhost:%d', %r, 2000).",
            self.port, self.log_dir, self.port, self.port, self.log_dir)


# --------------------------------------------------------------------------
# batch_size_sweep
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SweepRow:
    """One batch size of a sweep.

    Attributes:
        batch_size: Global batch size (what `dataset_fn` batched with).
        samples_per_sec: Examples per second after the first execution
            (which includes compilation), or None if it did not finish.
        peak_bytes: The allocator's peak bytes during the run (largest over
            the replica devices), None where unreadable.
        status: `"ok"`, or `"oom"` for a `ResourceExhaustedError`.
        error: The error's first line for `"oom"`.
    """

    batch_size: int
    samples_per_sec: float | None
    peak_bytes: int | None
    status: str = "ok"
    error: str | None = None


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

    def table(self) -> str:
        lines = [f"{'batch':>8}  {'samples/s':>12}  {'peak memory':>12}  status"]
        for r in self.rows:
            sps = f"{r.samples_per_sec:,.0f}" if r.samples_per_sec else "-"
            lines.append(f"{r.batch_size:>8}  {sps:>12}  "
                         f"{devices.format_bytes(r.peak_bytes):>12}  {r.status}")
        if self.oom_batch is not None:
            lines.append(f"out of memory at batch {self.oom_batch}; largest that fit: "
                         f"{self.largest_fitting}"
                         + (f"; not tried: {', '.join(map(str, self.skipped))}"
                            if self.skipped else ""))
        else:
            lines.append(f"all fit; largest: {self.largest_fitting}")
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
            ax_mem.text(0.5, 0.5, "allocator peak not readable", ha="center",
                        transform=ax_mem.transAxes)
        ax_mem.set_title("Peak memory (allocator)")
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


def _memory_devices(model) -> list[str]:
    """Allocators to watch: each replica's device, the host CPU once."""
    import tensorflow as tf

    strategy = getattr(model, "_distribute_strategy", None)
    names = []
    if strategy is not None:
        try:
            names = [n.split("device:")[-1] for n in strategy.extended.worker_devices]
        except (RuntimeError, AttributeError):
            names = []
    if not names:
        for kind in ("TPU", "GPU"):
            found = tf.config.list_logical_devices(kind)
            if found:
                names = [found[0].name.split("device:")[-1]]
                break
    out = []
    for name in names or ["CPU:0"]:
        name = "CPU:0" if name.upper().startswith("CPU") else name
        if name not in out:
            out.append(name)
    return out


class _Timer(keras.callbacks.Callback):
    """Times the executions after the first one (which includes compilation)."""

    def __init__(self):
        super().__init__()
        self.t_first_end = None
        self.t_last_end = None
        self.steps_after_first = 0
        self._first = True
        self._begin = 0

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = int(batch)

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()  # logs were converted to numpy: the step finished
        if self._first:
            self._first = False
            self.t_first_end = now
            return
        self.steps_after_first += int(batch) - self._begin + 1
        self.t_last_end = now


def _check_sweep_args(build_fn, dataset_fn, batch_sizes, steps):
    if not callable(build_fn):
        raise TypeError("`build_fn` must be a callable returning a compiled keras.Model, got "
                        f"{type(build_fn).__name__}.")
    if not callable(dataset_fn):
        raise TypeError("`dataset_fn` must be a callable batch_size -> tf.data.Dataset, got "
                        f"{type(dataset_fn).__name__}.")
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence) \
            or not batch_sizes:
        raise TypeError("`batch_sizes` must be a non-empty sequence of positive ints, got "
                        f"{batch_sizes!r}.")
    for b in batch_sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"`batch_sizes` must hold positive ints, got {b!r}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"`steps` must be an int >= 2 (the first includes compilation), "
                         f"got {steps!r}.")


def batch_size_sweep(
    build_fn: Callable[[], keras.Model],
    dataset_fn: Callable[[int], object],
    batch_sizes: Sequence[int],
    *,
    steps: int = 20,
    png_path: str | None = None,
) -> SweepResult:
    """Trains a few steps at each batch size; measures throughput and peak memory.

    For each batch size (smallest first) a fresh model from `build_fn()` trains
    `steps` steps on `dataset_fn(batch_size)` (repeated as needed). Samples per
    second are timed after the first execution, which includes compilation;
    the peak is the allocator's (`tf.config.experimental.get_memory_info`) over
    the whole run, on each replica's device. The sweep stops at the first
    out-of-memory error (`tf.errors.ResourceExhaustedError`), records it and
    reports the largest batch that fit.

    Args:
        build_fn: `() -> compiled keras.Model` (build it in your strategy's
            scope for a multi-replica sweep).
        dataset_fn: `batch_size -> tf.data.Dataset` of batches of that (global)
            size.
        batch_sizes: Batch sizes to try.
        steps: Training steps per batch size (>= 2).
        png_path: If given, write the throughput / peak-memory figure there.

    Returns:
        A `SweepResult` (`.rows`, `.largest_fitting`, `.oom_batch`, `.table()`).
    """
    import tensorflow as tf

    require_tensorflow_backend("batch_size_sweep")
    _check_sweep_args(build_fn, dataset_fn, batch_sizes, steps)
    sizes = sorted(set(batch_sizes))
    rows: list[SweepRow] = []
    skipped: tuple[int, ...] = ()
    for i, batch in enumerate(sizes):
        model = None
        try:
            model = build_fn()
            if not isinstance(model, keras.Model) or not getattr(model, "compiled", False):
                raise TypeError("`build_fn` must return a compiled keras.Model, got "
                                f"{type(model).__name__}.")
            data = dataset_fn(batch)
            if not isinstance(data, tf.data.Dataset):
                raise TypeError("`dataset_fn` must return a tf.data.Dataset, got "
                                f"{type(data).__name__}.")
            watch = _memory_devices(model)
            for name in watch:
                devices.reset_peak(name)
            timer = _Timer()
            model.fit(data.repeat(), steps_per_epoch=steps, epochs=1, verbose=0,
                      shuffle=False, callbacks=[timer])
            peaks = [devices.read_memory(name) for name in watch]
            peaks = [p[1] for p in peaks if p is not None]
            elapsed = (timer.t_last_end - timer.t_first_end) if timer.t_last_end else None
            sps = (timer.steps_after_first * batch / elapsed) if elapsed else None
            rows.append(SweepRow(batch, sps, max(peaks) if peaks else None))
            logger.info("batch_size_sweep: batch %d: %s samples/s, peak %s", batch,
                        f"{sps:,.0f}" if sps else "-",
                        devices.format_bytes(max(peaks) if peaks else None))
        except (tf.errors.ResourceExhaustedError, MemoryError) as err:
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            rows.append(SweepRow(batch, None, None, "oom", message[:300]))
            skipped = tuple(sizes[i + 1:])
            logger.info("batch_size_sweep: out of memory at batch %d; stopping (largest that "
                        "fit: %s).", batch, max((r.batch_size for r in rows
                                                 if r.status == "ok"), default=None))
            break
        finally:
            del model
            gc.collect()
    result = SweepResult(tuple(rows), skipped)
    if png_path is not None:
        result = dataclasses.replace(result, png_path=result.plot(os.fspath(png_path)))
    return result
