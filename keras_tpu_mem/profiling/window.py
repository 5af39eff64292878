"""`ProfileWindow`: an XProf capture of a window of training steps, or the profiler server.

The capture is the framework's own profiler (`backends.current().profiler`:
`tf.profiler.experimental` on TensorFlow, `jax.profiler` on JAX, the same
`plugins/profile/<run>/*.xplane.pb` files either way), started before the
execution that holds the window's first step and stopped after the one that
holds its last; each traced execution is marked as a step for XProf's
overview page. After a local capture the summary is read back with
`summary.summarize_profile`.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import socket
import time

import keras

from keras_tpu_mem import backends
from keras_tpu_mem._utils import logger
from keras_tpu_mem.profiling.summary import ProfileSummary, summarize_profile

_MODES = ("local", "server")
# Profiler servers started in this process, by port: neither TensorFlow nor JAX
# can run two, and a second start on the same port would fail.
_SERVERS: dict[int, bool] = {}


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
        self._backend = backends.current("ProfileWindow")
        self._profiler = self._backend.profiler
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
        # (None where reading the counter would cost: JAX.)
        now = self._profiler.counter_after_execution(self._iterations) if self._tracing else None
        if now is not None:
            last = now - self._base - 1
        elif self._epoch_steps:
            # Keras' index of the execution's last step, clamped to the
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
        if not self._profiler.start(self.log_dir):
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
        if not self._profiler.stop():
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
            self._backend.label, self.port, self.log_dir, self.port,
            self._profiler.capture_hint(self.port, self.log_dir))
