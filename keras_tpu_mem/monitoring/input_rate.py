"""`measure_input_rate`: how fast a dataset yields batches on its own."""

from __future__ import annotations

import dataclasses
import time

from keras_tpu_mem._compat import tensorflow as tf_compat
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
        parts = tf_compat.per_replica_parts(leaf)
        if not parts:
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
