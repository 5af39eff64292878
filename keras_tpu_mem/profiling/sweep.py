"""`batch_size_sweep`: train a few steps at each batch size, time them, read the peak.

Each batch size (smallest first) trains a fresh model on the framework's own
`fit`; samples per second are timed after the first execution (which
compiles), the peak memory is read from each replica device's allocator
(`keras_tpu_mem.devices`), or from the process's resident memory where a CPU
allocator keeps no statistics. The first out-of-memory error ends the sweep.
What differs between TensorFlow and JAX (which devices, which inputs, which
error means out of memory) is asked of `backends.current().profiler`. The
rows, their table and their figure are `sweep_result`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable, Sequence

import keras

from keras_tpu_mem import backends, devices
from keras_tpu_mem._utils import logger
from keras_tpu_mem.planning.budget import check_headroom
from keras_tpu_mem.profiling.sweep_result import SweepResult, SweepRow


def _memory_devices(model, profiler) -> list[tuple]:
    """`(device, source)` to watch: each replica's device, the host CPU once.

    The devices are the backend's (`profiler.replica_devices`): TensorFlow's
    replica device names, each CPU as `"CPU:0"`, or the `jax.Device`s of the
    active distribution. The source is the device's allocator where it keeps
    statistics, else for the host the process's resident memory
    (`devices.memory_source`); devices nothing can read are left out.
    """
    out, host = [], False
    for device in profiler.replica_devices(model, devices):
        if device in (d for d, _ in out):
            continue
        source = devices.memory_source(device)
        if source == devices.SOURCE_HOST_RSS:
            if host:
                continue  # one process: its RSS once
            host = True
        if source is not None:
            out.append((device, source))
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


def _check_build_and_sizes(build_fn, batch_sizes):
    if not callable(build_fn):
        raise TypeError("`build_fn` must be a callable returning a compiled keras.Model, got "
                        f"{type(build_fn).__name__}.")
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence) \
            or not batch_sizes:
        raise TypeError("`batch_sizes` must be a non-empty sequence of positive ints, got "
                        f"{batch_sizes!r}.")
    for b in batch_sizes:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"`batch_sizes` must hold positive ints, got {b!r}.")


def _check_sweep_args(build_fn, dataset_fn, batch_sizes, steps, sample_batch=None):
    _check_build_and_sizes(build_fn, batch_sizes)
    if sample_batch is not None:
        if dataset_fn is not None:
            raise ValueError("Pass either `dataset_fn` or `sample_batch` (trained on, tiled "
                             "to each batch size), not both.")
    elif not callable(dataset_fn):
        raise TypeError("`dataset_fn` must be a callable batch_size -> tf.data.Dataset, got "
                        f"{type(dataset_fn).__name__}.")
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


def _sweep_input(data, batch: int, steps: int, profiler):
    """What `fit` trains on for one sweep row, and a TypeError's message for bad data.

    tf.data (where TensorFlow is loaded): repeated. JAX also takes a
    `keras.utils.PyDataset` (cycled) and arrays, a tuple `(x, y)` or dict,
    cut into full batches of `batch` rows (one static shape, one compile), cycled.
    """
    from keras_tpu_mem.monitoring.input_rate import _array_batches, _dataset_kind

    kind = _dataset_kind(data)
    if kind == "tf.data":
        return data.repeat()
    profiler.check_sweep_input(kind, data)  # TensorFlow's sweep takes tf.data only
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


def _tiled(sample_batch, batch: int, steps: int):
    """`sample_batch` (a batch as fit takes it) tiled to `batch` rows, as `steps` batches."""
    import numpy as np

    def tile(array):
        array = np.asarray(array)
        if array.ndim == 0 or array.shape[0] == 0:
            raise ValueError("`sample_batch` must hold arrays with a batch axis of at least "
                             f"one row, got shape {array.shape}.")
        return np.take(array, np.arange(batch) % array.shape[0], axis=0)

    whole = keras.tree.map_structure(tile, sample_batch)
    return _Cycle(lambda index: whole, 1, steps)


def _is_oom(err: BaseException, profiler) -> bool:
    """An out-of-memory error of the framework (or Python's own MemoryError)."""
    return isinstance(err, MemoryError) or profiler.is_out_of_memory(err)


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
    dataset_fn: Callable[[int], object] | None,
    batch_sizes: Sequence[int],
    *,
    steps: int = 20,
    png_path: str | None = None,
    verbose: int = 1,
    sample_batch=None,
    device=None,
    compiler: str = "auto",
    headroom: float = 0.0,
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
            arrays `(x, y)` to cut into them); None with `sample_batch`.
        batch_sizes: Batch sizes to try.
        steps: Training steps per batch size (>= 2).
        png_path: If given, write the throughput / peak-memory figure there.
        verbose: 1 shows a progress bar (`keras.utils.Progbar`, one unit per
            batch size, with its samples/s and peak); 0 logs one line per batch
            size instead.
        sample_batch: Instead of `dataset_fn`, one batch as `fit` takes it (an
            array, a dict of arrays, `(x, y)` or `(x, y, sample_weight)`) of any
            batch size: each row trains on it tiled to the row's batch size
            (memory and throughput need shapes, not new data).
        device: Instead of training here, compile each batch's step for this
            device (`"v5e-8"`, a `TpuSlice`, a device spec; see `compiled_memory`)
            and report what the compiler holds per device, stopping at the first
            batch it refuses as too large; `dataset_fn` must be None.
        compiler: With `device`, which compiler (`compiled_memory`'s `compiler`:
            "auto", "tpu" or "host").
        headroom: With `device`, the fraction of each device's memory the compile
            leaves free (`compiled_memory`'s `headroom`; XLA:TPU schedules the step
            within the rest where it can), as `plan` reserves it: the sweep stops at
            the first batch over the rest. 0 compiles against the whole device.

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
    profiler = backends.current("batch_size_sweep").profiler
    if device is not None:
        return _compiled_sweep(build_fn, dataset_fn, batch_sizes, sample_batch, device,
                               compiler, png_path, headroom)
    if check_headroom(headroom):
        raise ValueError(f"batch_size_sweep(headroom={headroom!r}): a headroom is left free "
                         "in a compile for `device=` (e.g. device='v5e-8'); a sweep that "
                         "trains here measures what the run holds: pass headroom=0.")
    _check_sweep_args(build_fn, dataset_fn, batch_sizes, steps, sample_batch)
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
            data = (_tiled(sample_batch, batch, steps) if sample_batch is not None
                    else _sweep_input(dataset_fn(batch), batch, steps, profiler))
            watch = _memory_devices(model, profiler)
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
            if not _is_oom(err, profiler):
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


def _compiled_sweep(build_fn, dataset_fn, batch_sizes, sample_batch, device, compiler,
                    png_path, headroom) -> SweepResult:
    """`batch_size_sweep(..., device=...)`: one compile per batch for the device, smallest
    first, stopping at the first the compiler refuses as too large."""
    from keras_tpu_mem.planning.compiled import compiled_memory

    if dataset_fn is not None:
        raise ValueError("batch_size_sweep(device=...) compiles instead of training: pass "
                         "dataset_fn=None (and sample_batch where the model cannot tell its "
                         "input shapes).")
    _check_build_and_sizes(build_fn, batch_sizes)
    sizes = sorted(set(batch_sizes))
    model = build_fn()
    if not isinstance(model, keras.Model) or not getattr(model, "compiled", False):
        raise TypeError("`build_fn` must return a compiled keras.Model, got "
                        f"{type(model).__name__}.")
    rows: list[SweepRow] = []
    skipped: tuple[int, ...] = ()
    for i, batch in enumerate(sizes):
        memory = compiled_memory(model, batch, device=device, compiler=compiler,
                                 sample_batch=sample_batch, hlo_text=False,
                                 headroom=headroom)
        source = memory.compiler.split(" (")[0] + " compile"
        if not memory.fits_reserve:
            # Refused by XLA, or compiled over what the headroom leaves (XLA:TPU
            # schedules a step within it where it can, and compiles it anyway).
            usable = memory.capacity_bytes - memory.reserved_bytes
            error = memory.refused[:300] or (
                f"{devices.format_bytes(memory.total_bytes)} per device is over the "
                f"{devices.format_bytes(usable)} the headroom ({headroom:g}) leaves of "
                f"{devices.format_bytes(memory.capacity_bytes)}")
            rows.append(SweepRow(batch, None, None if memory.refused else memory.total_bytes,
                                 "oom", error, memory_source=source,
                                 peak_exact=not memory.refused))
            skipped = tuple(sizes[i + 1:])
            break
        rows.append(SweepRow(batch, None, memory.total_bytes, memory_source=source,
                             peak_exact=True))
        logger.info("batch_size_sweep: batch %d: %s per device (%s)", batch,
                    devices.format_bytes(memory.total_bytes), memory.compiler)
    result = SweepResult(tuple(rows), skipped)
    if png_path is not None:
        result = dataclasses.replace(result, png_path=result.plot(os.fspath(png_path)))
    return result
