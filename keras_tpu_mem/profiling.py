"""Measure while you run: `ProfileWindow` (XProf capture) and `batch_size_sweep`.

* `ProfileWindow(log_dir, steps=(start, stop))` is a Keras callback that
  captures an XProf trace of training steps `start .. stop-1` into
  `log_dir/plugins/profile/<run>/`, which TensorBoard's Profile tab opens
  (`mode="local"`), or starts the profiler server so a TPU profile can be
  captured from TensorBoard's "Capture Profile" button (`mode="server"`).
  After a local capture it logs a short summary read with xprof's converters,
  without a server: the step time from the overview page and, for XLA-compiled
  steps, the memory viewer's peak heap. xprof is optional (the `[profile]`
  extra): the capture needs only the framework, and where no converter is
  found one notice names the extra that adds the summary. On the JAX backend
  the same files come from `jax.profiler.start_trace` / `stop_trace`, each
  traced execution marked with `jax.profiler.StepTraceAnnotation`, and
  `mode="server"` starts `jax.profiler.start_server(port)`; nothing of it
  imports TensorFlow.
* `batch_size_sweep(build_fn, dataset_fn, batch_sizes)` trains a few steps at
  each batch size and returns samples per second and the peak memory (the
  allocator's, or the process's resident memory where a CPU allocator keeps
  no statistics, each row naming its source), stopping at the first
  out-of-memory error; it can draw both against the batch size in a PNG.
  On JAX it takes arrays, a `keras.utils.PyDataset` or (where TensorFlow is
  installed) a `tf.data.Dataset`, and reads each device's `memory_stats()`
  (TPU, GPU) or the host RSS (JAX's CPU devices keep no statistics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import glob
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import keras

from keras_tpu_mem import devices
from keras_tpu_mem._compat import jax_profiler as jax_profiler_compat
from keras_tpu_mem._compat import profiler as profiler_compat
from keras_tpu_mem._utils import logger

_MODES = ("local", "server")
_BACKENDS = ("tensorflow", "jax")
# Profiler servers started in this process, by port: neither TensorFlow nor JAX
# can run two, and a second start on the same port would fail.
_SERVERS: dict[int, bool] = {}


# --------------------------------------------------------------------------
# The backend's profiler: start/stop a capture, mark a step, start a server
# --------------------------------------------------------------------------
class _ProfilerBusy(Exception):
    """Another capture is running (Keras' TensorBoard profiler, another window)."""


class _ProfilerNotRunning(Exception):
    """Someone else stopped the capture this window started."""


class _TensorFlowProfiler:
    name = "TensorFlow"

    def start(self, log_dir: str) -> None:
        import tensorflow as tf

        try:
            tf.profiler.experimental.start(log_dir)
        except tf.errors.AlreadyExistsError as err:
            raise _ProfilerBusy(str(err)) from err

    def stop(self) -> None:
        import tensorflow as tf

        try:
            tf.profiler.experimental.stop()
        except tf.errors.UnavailableError as err:
            raise _ProfilerNotRunning(str(err)) from err

    def step(self, name: str, step_num: int):
        return profiler_compat.step_trace(name, step_num)

    def start_server(self, port: int) -> None:
        import tensorflow as tf

        tf.profiler.experimental.server.start(port)

    def capture_hint(self, port: int, log_dir: str) -> str:
        return (f"tf.profiler.experimental.client.trace('grpc://localhost:{port}', "
                f"{log_dir!r}, 2000)")


class _JaxProfiler:
    """`jax.profiler`'s public API (checked: jax 0.10.2), writing the same XProf files."""

    name = "JAX"

    def start(self, log_dir: str) -> None:
        import jax

        try:
            jax.profiler.start_trace(log_dir)
        except RuntimeError as err:  # "Profile has already been started"
            raise _ProfilerBusy(str(err)) from err

    def stop(self) -> None:
        import jax

        try:
            jax.profiler.stop_trace()
        except RuntimeError as err:  # "No profile started"
            raise _ProfilerNotRunning(str(err)) from err

    def step(self, name: str, step_num: int):
        import jax

        # XProf's overview page measures step time from these (checked on
        # jax 0.10.2 with xprof 2.22.1), as from TensorFlow's `_r=1` traces.
        return jax.profiler.StepTraceAnnotation(name, step_num=step_num)

    def start_server(self, port: int) -> None:
        import jax

        # JAX keeps its one server in a module global until the process ends.
        jax.profiler.start_server(port)

    def capture_hint(self, port: int, log_dir: str) -> str:
        return (f"python -m jax.collect_profile {port} 2000 --log_dir={log_dir} "
                "--no_perfetto_link (it needs xprof)")


def _profiler_for(backend: str):
    return _JaxProfiler() if backend == "jax" else _TensorFlowProfiler()


# --------------------------------------------------------------------------
# xprof conversion without a server
# --------------------------------------------------------------------------
def _find_converter():
    """The XSpace converter finder (tests replace it to simulate a bare install)."""
    return profiler_compat.find_xspace_converter()


class _Converter:
    """An XSpace converter: xprof's (or an older tensorboard_plugin_profile's).

    All of them wrap the same C++ `xspace_to_tools_data(paths, tool, options)`
    (see `keras_tpu_mem._compat.profiler`).
    """

    def __init__(self):
        found, detail = _find_converter()
        self.name = found
        self.reason = None if found else detail
        self._raw = detail if found else None

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
        open_it = (f"  open it: tensorboard --logdir "
                   f"{os.path.dirname(os.path.dirname(os.path.dirname(self.run_dir)))} "
                   "-> Profile")
        if not profiler_compat.profile_plugin_installed():
            open_it += (f" (TensorBoard's Profile tab needs tensorboard-plugin-profile: "
                        f"{profiler_compat.PROFILE_EXTRA})")
        lines.append(open_it)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


_HLO_FILE_RE = re.compile(r"^(?P<name>.+?)(?:\((?P<pid>\d+)\))?\.hlo_proto\.pb$")


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def executed_xla_modules(xplane_path: str) -> set[str] | None:
    """Names of the XLA modules that ran in a capture, or None if unreadable.

    The profiler stores every XLA module compiled so far in the process in the
    capture's metadata, also those that did not run in the window. Execution
    events carry an `hlo_module` stat (XLA:CPU thunks, TPU/GPU ops) and device
    planes have an "XLA Modules" line; those name the modules that ran.
    """
    # TensorFlow's own XSpace class where TensorFlow is installed, else the same
    # schema built from protobuf (a JAX-only environment).
    xspace_cls = profiler_compat.xspace_class() or jax_profiler_compat.xspace_class()
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


_NOTICES: set[str] = set()


def _notice_missing_converter(reason: str) -> None:
    """Says once per process that the summary needs xprof, and which extra adds it."""
    if "converter" in _NOTICES:
        return
    _NOTICES.add("converter")
    logger.info(
        "ProfileWindow: the capture is written, but its summary (step time, XLA peak heap) "
        "needs xprof's converters, which are not installed: %s adds them (%s).",
        profiler_compat.PROFILE_EXTRA, reason)


def summarize_profile(xplane_path: str, *, first_step: int = 0, last_step: int = 0,
                      steps_per_execution: int = 1) -> ProfileSummary:
    """Reads step time and XLA peak memory from a captured `*.xplane.pb`.

    Converts a temporary copy, so the converters' cache files (`*.hlo_proto.pb`,
    `*.op_stats*.pb`) never land in the run directory: it keeps only what
    the framework's profiler wrote, as TensorBoard would have found it.
    Works on captures of either backend.
    """
    run_dir = os.path.dirname(xplane_path)
    base = dict(run_dir=run_dir, xplane_path=xplane_path, first_step=first_step,
                last_step=last_step, steps_per_execution=steps_per_execution)
    converter = _Converter()
    if not converter.available:
        _notice_missing_converter(converter.reason)
        return ProfileSummary(**base, note=(
            f"no step-time or peak-heap summary: xprof's converters are not installed "
            f"({profiler_compat.PROFILE_EXTRA} adds them); the capture itself is complete: "
            "open it in TensorBoard's Profile tab"))
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
    in one run each give their own run directory. The capture needs only
    the framework; the summary needs xprof's converters
    (`pip install "keras-tpu-mem[profile]"`): without them one notice names
    the extra and the summary's `note` says so.

    `mode="server"`: starts the framework's profiler server on `port` (a free
    one if None) when training begins, and logs when the window's steps run,
    so a profile can be captured from TensorBoard's Profile tab ("Capture
    Profile", address `localhost:PORT`, or the TPU VM's host name) or with
    `tf.profiler.experimental.client.trace` (`python -m jax.collect_profile`
    on JAX). That is the documented way to profile a Cloud TPU. The server
    lives until the process ends.

    **On the JAX backend** the capture is `jax.profiler.start_trace(log_dir)`
    / `stop_trace()`, which writes the same `plugins/profile/<run>/*.xplane.pb`
    (and a `*.trace.json.gz` beside it, JAX's own), each traced execution is a
    `jax.profiler.StepTraceAnnotation`, and the server is
    `jax.profiler.start_server(port)`. Keras' own `TensorBoard(profile_batch=)`
    profiles JAX only on Python >= 3.12; this callback needs no such Python.
    Steps are counted from Keras' batch indices (clamped to the epoch's
    length), because reading the optimizer's step counter mid-epoch would make
    Keras copy the whole training state back into the model every step.

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
        backend = keras.backend.backend()
        if backend not in _BACKENDS:
            raise RuntimeError(
                f"ProfileWindow needs the Keras TensorFlow or JAX backend, but Keras is running "
                f"on {backend!r}. Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax before "
                "importing keras.")
        self._backend = backend
        self._profiler = _profiler_for(backend)
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
        self._spe_value = 1
        self._epoch_steps = None

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
        # Read once: on JAX every `self.model` look-up in a batch hook makes
        # Keras copy the training state back into the model's variables.
        self._spe_value = self._spe()
        self._epoch_steps = (self.params or {}).get("steps") or None
        if self.mode == "server":
            self._start_server()

    def on_epoch_begin(self, epoch, logs=None):
        now = self._iterations()
        # Keras numbers batches from 0 in every epoch; the optimizer counts on.
        self._epoch_offset = (now - self._base) if now is not None else self._counted

    def on_train_batch_begin(self, batch, logs=None):
        first = self._epoch_offset + int(batch)
        last = first + self._spe_value - 1
        in_window = first < self.stop and last >= self.start
        if self.mode == "server":
            if in_window and not self._announced:
                self._announced = True
                logger.info("ProfileWindow: steps %d..%d run now; capture them from the "
                            "profiler server on port %s.", self.start, self.stop - 1, self.port)
        elif in_window and not self._tracing and not self._done:
            self._start_local(first)
        if self._tracing or self.mode == "server":
            # A step marker per execution, as Keras' TensorBoard callback
            # sets: XProf's overview page measures step time from them.
            self._step_trace = self._profiler.step("train", first)
            self._step_trace.__enter__()
        self._t_begin = (first, time.perf_counter()) if self._tracing else None

    def on_train_batch_end(self, batch, logs=None):
        # Keras reports the last step of a full execution even when the
        # epoch's last execution ran fewer steps; inside the window the
        # optimizer's counter (read after the step finished) is exact.
        last = self._epoch_offset + int(batch)
        if self._tracing and self._backend == "tensorflow":
            now = self._iterations()
            if now is not None:
                last = now - self._base - 1
        elif self._epoch_steps:
            # JAX: Keras' index of the execution's last step, clamped to the
            # epoch (the last execution may run fewer steps than it says).
            last = min(last, self._epoch_offset + self._epoch_steps - 1)
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
        os.makedirs(self.log_dir, exist_ok=True)
        self._runs_before = _run_dirs(self.log_dir)
        try:
            self._profiler.start(self.log_dir)
        except _ProfilerBusy:
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
        self._tracing = False
        self._done = True
        # The profiler names a run after the current second: two windows
        # closing within one second would write into the same run directory.
        taken = {os.path.basename(d) for d in self._runs_before}
        while time.strftime("%Y_%m_%d_%H_%M_%S") in taken:
            time.sleep(0.05)
        try:
            self._profiler.stop()
        except _ProfilerNotRunning:
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
                                 steps_per_execution=self._spe_value)
        if self.summary:
            summary = summarize_profile(xplanes[0], first_step=self._first_traced,
                                        last_step=self._last_traced,
                                        steps_per_execution=self._spe_value)
        if self._wall_steps:
            summary = dataclasses.replace(
                summary, wall_ms_per_step=1000.0 * self._wall_s / self._wall_steps)
        if self.summary:
            logger.info("%s", summary.text())
        self.summaries.append(summary)

    # --------------------------------------------------------- server mode
    def _start_server(self):
        if self.port is None:
            self.port = _free_port()
        if self.port in _SERVERS:
            logger.info("ProfileWindow: the profiler server already listens on port %d.",
                        self.port)
            return
        try:
            self._profiler.start_server(self.port)
        except Exception as err:  # e.g. the port is taken, or JAX runs one already
            logger.warning("ProfileWindow: could not start the profiler server on port %d "
                           "(%s: %s).", self.port, type(err).__name__, err)
            return
        _SERVERS[self.port] = True
        logger.info(
            "ProfileWindow: %s profiler server listening on port %d. In TensorBoard "
            "(tensorboard --logdir %s) open Profile -> Capture Profile and enter "
            "localhost:%d (on a TPU VM, its host name), or run %s.",
            self._profiler.name, self.port, self.log_dir, self.port,
            self._profiler.capture_hint(self.port, self.log_dir))


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


def _memory_devices(model) -> list[tuple]:
    """`(device, source)` to watch: each replica's device, the host CPU once.

    The source is the device's allocator where it keeps statistics, else for
    the host the process's resident memory (`devices.memory_source`);
    devices nothing can read are left out. On JAX the devices are
    `jax.Device`s of the active distribution (`devices.monitored_jax_devices`).
    """
    if keras.backend.backend() == "jax":
        out, host = [], False
        for device in devices.monitored_jax_devices():
            source = devices.memory_source(device)
            if source == devices.SOURCE_HOST_RSS:
                if host:
                    continue  # one process: its RSS once
                host = True
            if source is not None:
                out.append((device, source))
        return out
    names = [n.split("device:")[-1]
             for n in devices.replica_device_names(model.distribute_strategy)]
    out = []
    for name in names or ["CPU:0"]:
        name = "CPU:0" if devices.is_host_device(name) else name
        if name in (n for n, _ in out):
            continue
        source = devices.memory_source(name)
        if source is not None:
            out.append((name, source))
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


class _Cycle(keras.utils.PyDataset):
    """`steps` batches for the sweep's one epoch, cycling through a finite source
    (what `.repeat()` does for a tf.data dataset)."""

    def __init__(self, get, count: int | None, steps: int):
        super().__init__()
        self._get, self._count, self._steps = get, count, steps

    def __len__(self):
        return self._steps

    def __getitem__(self, index):
        return self._get(index % self._count if self._count else index)


def _sweep_input(data, batch: int, steps: int):
    """What `fit` trains on for one sweep row, and a TypeError's message for bad data.

    tf.data (where TensorFlow is loaded): repeated. JAX also takes a
    `keras.utils.PyDataset` (cycled) and arrays, a tuple `(x, y)` or dict,
    cut into full batches of `batch` rows (one static shape, one compile), cycled.
    """
    from keras_tpu_mem.monitoring.input_rate import _array_batches, _dataset_kind

    kind = _dataset_kind(data)
    if kind == "tf.data":
        return data.repeat()
    if keras.backend.backend() != "jax":
        raise TypeError("`dataset_fn` must return a tf.data.Dataset, got "
                        f"{type(data).__name__}.")
    if kind == "PyDataset":
        return _Cycle(data.__getitem__, data.num_batches, steps)
    if kind == "arrays":
        full = [b for b in _array_batches(data, batch)
                if keras.tree.flatten(b)[0].shape[0] == batch]
        if not full:
            raise ValueError(f"`dataset_fn({batch})` returned arrays with fewer than {batch} "
                             "rows: not one full batch.")
        return _Cycle(full.__getitem__, len(full), steps)
    raise TypeError(
        "`dataset_fn` must return a tf.data.Dataset (where TensorFlow is installed), a "
        "keras.utils.PyDataset, or arrays (a tuple (x, y) or dict of arrays), got "
        f"{type(data).__name__}.")


def _is_oom(err: BaseException) -> bool:
    """An out-of-memory error of either framework (or Python's own MemoryError)."""
    if isinstance(err, MemoryError):
        return True
    tf = sys.modules.get("tensorflow")
    errors = getattr(tf, "errors", None)
    if errors is not None and isinstance(err, errors.ResourceExhaustedError):
        return True
    # JAX: XlaRuntimeError / JaxRuntimeError whose message starts RESOURCE_EXHAUSTED.
    return (type(err).__name__ in ("XlaRuntimeError", "JaxRuntimeError")
            and "RESOURCE_EXHAUSTED" in str(err))


@contextlib.contextmanager
def _quiet_framework():
    """Keeps TensorFlow's Python log lines (retracing notices for every fresh
    model, ...) out of the sweep's progress bar; errors still show."""
    tf_logger = logging.getLogger("tensorflow")
    level = tf_logger.level
    tf_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tf_logger.setLevel(level)


def batch_size_sweep(
    build_fn: Callable[[], keras.Model],
    dataset_fn: Callable[[int], object],
    batch_sizes: Sequence[int],
    *,
    steps: int = 20,
    png_path: str | None = None,
    verbose: int = 1,
) -> SweepResult:
    """Trains a few steps at each batch size; measures throughput and peak memory.

    For each batch size (smallest first) a fresh model from `build_fn()` trains
    `steps` steps on `dataset_fn(batch_size)` (repeated as needed). Samples per
    second are timed after the first execution, which includes compilation.
    The peak is taken over the whole run on each replica's device, from the
    device's allocator (`tf.config.experimental.get_memory_info`); where a CPU
    allocator keeps no statistics (oneDNN off: CPUs without AVX-512, or
    `TF_ENABLE_ONEDNN_OPTS=0`) it is the peak resident memory of the whole
    process instead, said once and kept in each row's `memory_source`
    (`"host_rss"`). The sweep stops at the first out-of-memory error
    (`tf.errors.ResourceExhaustedError`; on JAX an `XlaRuntimeError` with
    RESOURCE_EXHAUSTED), records it and reports the largest batch that fit.

    On the JAX backend `dataset_fn` may also return a `keras.utils.PyDataset`
    or arrays (a tuple `(x, y)`, cut into full batches); the devices are those
    of the active `keras.distribution`, each read with `memory_stats()` (TPU,
    GPU), or the host RSS where JAX's CPU devices keep no statistics. A JAX
    allocator's peak cannot be reset between rows: a row's peak is exact where
    its run raised the device's high-water mark (smallest batch first, it
    normally does), else an upper bound (`SweepRow.peak_exact` False, `<=` in
    the table).

    Args:
        build_fn: `() -> compiled keras.Model` (build it in your strategy's
            scope for a multi-replica sweep).
        dataset_fn: `batch_size -> tf.data.Dataset` of batches of that (global)
            size (on JAX also a `keras.utils.PyDataset` of such batches, or
            arrays `(x, y)` to cut into them).
        batch_sizes: Batch sizes to try.
        steps: Training steps per batch size (>= 2).
        png_path: If given, write the throughput / peak-memory figure there.
        verbose: 1 shows a progress bar (`keras.utils.Progbar`, one unit per
            batch size, with its samples/s and peak); 0 logs one line per batch
            size instead.

    Returns:
        A `SweepResult` (`.rows`, `.largest_fitting`, `.oom_batch`, `.table()`).

    Example:

    ```python
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_tpu_mem as ktm

    x, y = np.random.rand(4096, 64).astype("float32"), np.random.randint(0, 10, 4096)

    def build():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile("adam", "sparse_categorical_crossentropy")
        return model

    result = ktm.batch_size_sweep(
        build, lambda b: tf.data.Dataset.from_tensor_slices((x, y)).batch(b, drop_remainder=True),
        [32, 128, 512], steps=5)
    print(result.table())
    ```
    """
    backend = keras.backend.backend()
    if backend not in _BACKENDS:
        raise RuntimeError(
            f"batch_size_sweep needs the Keras TensorFlow or JAX backend, but Keras is "
            f"running on {backend!r}. Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax "
            "before importing keras.")
    _check_sweep_args(build_fn, dataset_fn, batch_sizes, steps)
    if verbose not in (0, 1) or isinstance(verbose, bool):
        raise ValueError(f"`verbose` must be 0 (log lines) or 1 (progress bar), got {verbose!r}.")
    sizes = sorted(set(batch_sizes))
    rows: list[SweepRow] = []
    skipped: tuple[int, ...] = ()
    progbar = (keras.utils.Progbar(len(sizes), unit_name="batch size",
                                   stateful_metrics=["samples/s", "peak MiB"])
               if verbose else None)
    if progbar is not None:
        progbar.update(0)
    announced = False
    for i, batch in enumerate(sizes):
        model = None
        try:
            model = build_fn()
            if not isinstance(model, keras.Model) or not getattr(model, "compiled", False):
                raise TypeError("`build_fn` must return a compiled keras.Model, got "
                                f"{type(model).__name__}.")
            data = _sweep_input(dataset_fn(batch), batch, steps)
            watch = _memory_devices(model)
            if not announced and any(s == devices.SOURCE_HOST_RSS for _, s in watch):
                announced = True
                logger.info(
                    "batch_size_sweep: the CPU allocator keeps no statistics here (oneDNN "
                    "off: the default on CPUs without AVX-512, or TF_ENABLE_ONEDNN_OPTS=0); "
                    "peak memory is the host RSS of the whole process instead (%s), which "
                    "includes the data, the framework and earlier models, not HBM.",
                    devices.host_peak_method())
            marks = []  # where a peak counter cannot be reset: the peak before the run
            for name, source in watch:
                if devices.reset_peak(name, source=source) or source == devices.SOURCE_HOST_RSS:
                    marks.append(None)
                else:
                    before = devices.read_memory(name, source=source)
                    marks.append(before[1] if before else None)
            timer = _Timer()
            with _quiet_framework():
                model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0,
                          shuffle=False, callbacks=[timer])
            peaks = []
            for (name, source), mark in zip(watch, marks):
                value = devices.read_memory(name, source=source)
                if value is not None:
                    peaks.append((value[1], source, mark is None or value[1] > mark))
            peak, source, exact = max(peaks) if peaks else (None, None, None)
            exact = None if exact is None or (exact and all(m is None for m in marks)) else exact
            elapsed = (timer.t_last_end - timer.t_first_end) if timer.t_last_end else None
            sps = (timer.steps_after_first * batch / elapsed) if elapsed else None
            rows.append(SweepRow(batch, sps, peak, memory_source=source, peak_exact=exact))
            if progbar is not None:
                values = [("samples/s", sps or 0.0)]
                if peak is not None:
                    values.append(("peak MiB", peak / 2**20))
                progbar.update(i + 1, values=values)
            else:
                logger.info("batch_size_sweep: batch %d: %s samples/s, peak %s (%s)", batch,
                            f"{sps:,.0f}" if sps else "-", devices.format_bytes(peak),
                            source or "unreadable")
        except Exception as err:
            if not _is_oom(err):
                raise
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            rows.append(SweepRow(batch, None, None, "oom", message[:300]))
            skipped = tuple(sizes[i + 1:])
            if progbar is not None:
                progbar.update(i, finalize=True)  # ends the bar's line before the notice
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
