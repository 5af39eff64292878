"""`measure_input_rate`: how fast a dataset yields batches on its own."""

from __future__ import annotations

import dataclasses
import sys
import time

from keras_tpu_mem.backends.structure import flatten_structure as _flatten
from keras_tpu_mem.backends.structure import leading_dim as _leading_dim
from keras_tpu_mem.monitoring._base import _check_int


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


def _is_tf_dataset(dataset) -> bool:
    """A tf.data or distributed dataset. Only where TensorFlow is already loaded
    (such an object cannot exist otherwise): this never imports TensorFlow."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return False
    try:
        kinds = (tf.data.Dataset, tf.distribute.DistributedDataset)
    except AttributeError:  # a TensorFlow still importing
        return False
    return isinstance(dataset, kinds)


def _array_length(dataset) -> int | None:
    """The common length of arrays / a tuple, list or dict of arrays, else None."""
    if isinstance(dataset, (str, bytes)):
        return None
    try:
        leaves = _flatten(dataset)
    except Exception:
        return None
    lengths = set()
    for leaf in leaves:
        shape = getattr(leaf, "shape", None)
        if not isinstance(shape, tuple) or not shape or not hasattr(leaf, "__getitem__"):
            return None
        lengths.add(int(shape[0]))
    return lengths.pop() if len(lengths) == 1 else None


def _dataset_kind(dataset) -> str | None:
    """`"tf.data"`, `"PyDataset"`, `"arrays"`, or None for anything else."""
    if dataset is None:
        return None
    if _is_tf_dataset(dataset):
        return "tf.data"
    import keras

    if isinstance(dataset, keras.utils.PyDataset):
        return "PyDataset"
    if _array_length(dataset) is not None:
        return "arrays"
    return None


def _check_dataset(dataset, name="dataset"):
    if dataset is None:
        return None
    if _dataset_kind(dataset) is None:
        raise TypeError(
            f"`{name}` must be None, the batched tf.data.Dataset given to fit (or its "
            "distributed form; where TensorFlow is installed), a keras.utils.PyDataset, or "
            "in-memory arrays (an array, or a tuple or dict of arrays of one length, with "
            f"batch_size=); got {type(dataset).__name__}."
        )
    return dataset


def _dataset_batch_size(dataset) -> int | None:
    """The static batch dimension of a tf.data dataset; None for other inputs (a
    PyDataset's batches need not share one size; arrays take `batch_size`)."""
    if _dataset_kind(dataset) == "tf.data":
        return _leading_dim(dataset.element_spec)
    return None


def _array_batches(data, batch_size: int):
    """Yields the batches `fit(x, batch_size=...)` cuts from arrays: consecutive
    slices, each copied (as a data adapter gathers them), the last one shorter."""
    import keras
    import numpy as np

    length = _array_length(data)

    def cut(leaf, start, stop):
        part = leaf[start:stop]
        return part.copy() if isinstance(part, np.ndarray) else part

    for start in range(0, length, batch_size):
        stop = min(start + batch_size, length)
        yield keras.tree.map_structure(lambda leaf, a=start, b=stop: cut(leaf, a, b), data)


def measure_input_rate(dataset, *, batches=20, warmup_batches=2, max_seconds=10.0,
                       batch_size=None) -> InputRate:
    """Times a dataset alone: how many batches per second it can deliver.

    Iterates a fresh iterator over `dataset`, drops `warmup_batches` (pipeline
    start-up, shuffle buffers), then times up to `batches` batches or
    `max_seconds`, whichever ends first. Compare `batches_per_sec` with the
    training steps per second: if they are close, the input pipeline, not the
    model, sets the pace.

    Works with what either backend's `fit` takes: a batched `tf.data.Dataset`
    (where TensorFlow is installed; nothing here imports it), a
    `keras.utils.PyDataset` (its batches in order, in this thread), or
    in-memory arrays with `batch_size` (consecutive slices, each copied, as
    `fit(x, y, batch_size=...)` cuts them).

    Limits: the pipeline runs here without the training step competing for the
    host CPU, so on a CPU-only machine it reads faster than it can during
    training (on a TPU or GPU host, where the step runs on the accelerator, the
    two agree better); Python iteration adds about 0.1 ms per batch; a
    `.cache()` that training already filled is read from the cache; a
    `PyDataset` is read in this one thread, so `workers=` / `use_multiprocessing`
    are not used; for arrays, copying a batch to the devices (which `fit`
    also does) is not timed.

    Args:
        dataset: A batched `tf.data.Dataset` (or a distributed dataset), a
            `keras.utils.PyDataset`, or arrays (an array, or a tuple or dict
            of arrays of one length).
        batches: Batches to time, >= 1.
        warmup_batches: Batches to drop before timing, >= 0.
        max_seconds: Stop timing after this many seconds (> 0).
        batch_size: Rows per batch, for arrays only (>= 1).

    Returns:
        An `InputRate`.

    Raises:
        TypeError / ValueError: for arguments of the wrong type or range
            (arrays without `batch_size` are a TypeError naming both).
        ValueError: if the dataset ends before any batch could be timed.

    Example:

    ```python
    import numpy as np
    import keras_tpu_mem as ktm

    x = np.random.rand(10_000, 64).astype("float32")
    rate = ktm.measure_input_rate(x, batch_size=128, batches=20)
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
    kind = _dataset_kind(dataset)
    if kind == "arrays":
        if batch_size is None:
            raise TypeError(
                "`dataset` holds in-memory arrays, which have no batches of their own: "
                "pass `batch_size=` (the batch size given to fit).")
        _check_int(batch_size, "batch_size", 1)
        iterator = _array_batches(dataset, batch_size)
    else:
        if batch_size is not None:
            raise ValueError(
                f"`batch_size` applies to arrays only; a {kind} yields its own batches "
                f"(got batch_size={batch_size!r}).")
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


#: What to try when the input pipeline is the bottleneck, per kind of dataset.
_INPUT_FIXES = {
    "tf.data": ("Try .cache() after expensive maps, map(..., num_parallel_calls="
                "tf.data.AUTOTUNE), .prefetch(tf.data.AUTOTUNE), or moving preprocessing "
                "into the model."),
    "PyDataset": ("Try PyDataset(workers=N, use_multiprocessing=True, max_queue_size=...), "
                  "a lighter __getitem__ (load once, cache decoded data), or moving "
                  "preprocessing into the model."),
    "arrays": ("Slicing in-memory arrays is rarely the limit: look at the host (another "
               "process on its CPUs?) or pass the arrays through "
               "TPUStrategyWrapper.distribute, which cuts static global batches."),
}


def input_verdict(train_steps_per_sec: float, input_batches_per_sec: float,
                  kind: str | None = "tf.data") -> tuple[str, str]:
    """Names the bottleneck from the two rates: `("input" | "balanced" | "compute", sentence)`.

    `kind` (`"tf.data"`, `"PyDataset"`, `"arrays"`) picks the fixes the
    "input" sentence suggests.
    """
    ratio = input_batches_per_sec / train_steps_per_sec
    rates = (f"the input pipeline alone delivers {input_batches_per_sec:,.1f} batches/s; "
             f"training ran at {train_steps_per_sec:,.1f} steps/s ({ratio:.2f}x)")
    if ratio < 1.2:
        return "input", (
            f"bottleneck: input pipeline. {rates[0].upper() + rates[1:]}, so the step "
            f"waits for data. {_INPUT_FIXES.get(kind, _INPUT_FIXES['tf.data'])}"
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
