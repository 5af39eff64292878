"""What both monitors share: argument checks, the never-break guard, the step counter."""

from __future__ import annotations

import functools
import os

import keras

from keras_tpu_mem import backends
from keras_tpu_mem._utils import logger
from keras_tpu_mem.monitoring._layout import format_table  # noqa: F401  (it lived here)
from keras_tpu_mem.monitoring._writer import _RunFiles


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
    problem = "://" in log_dir and backends.current().storage.remote_path_problem(log_dir)
    if problem:
        raise ValueError(
            f"`log_dir` {log_dir!r} is a remote path, and {problem}. Write to a local "
            "directory and copy it (e.g. `gsutil -m cp -r logs gs://bucket/`)."
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
    starts from the optimizer's `iterations`, so it continues after a resume; a call
    the engine skipped (the earlier batches of an epoch `ResumableCheckpoint` resumed
    mid-way) counts no step.
    """

    def __init__(self, model, params):
        self._model = model
        self.epoch_steps = (params or {}).get("steps") or None
        self.step: int | None = None
        #: The optimizer's step counter when this fit's first batch began: 0 for
        #: a fresh model, > 0 for a resumed or continued one (the report tells
        #: training runs in one folder apart by it).
        self.begin_step: int | None = None
        self._begin = 0
        self._skipped_before = 0
        self._engine = None

    def _start(self):
        from keras_tpu_mem.engine import Engine

        self.step = _read_iterations(self._model)
        self.begin_step = self.step
        # Looked up once, at the first batch: every `on_train_begin` (the engine's
        # install, a resume's skipping) has run by then.
        self._engine = Engine.of(self._model)

    def epoch_begin(self):
        self._begin = 0

    def _skipped_calls(self) -> int:
        return self._engine.skipped_calls if self._engine is not None else 0

    def batch_begin(self, batch):
        if self.step is None:
            self._start()
        self._begin = int(batch)
        self._skipped_before = self._skipped_calls()

    def batch_end(self, batch) -> int:
        """The steps this call ran (0 for a call the engine skipped)."""
        if self.step is None:
            self._start()
        if self._skipped_calls() != self._skipped_before:
            self._begin = int(batch) + 1
            return 0
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
