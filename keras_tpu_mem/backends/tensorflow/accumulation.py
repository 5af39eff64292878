"""Gradient accumulation's checks on TensorFlow, where a batch's size may be known
only at run time (arrays, whose last batch is smaller).

Contract (same in `backends/jax/accumulation.py`):

* `checked_count(per_replica_batch, divisor, count, message)`: `count` micro-
  batches, once `per_replica_batch` (not a Python int: a tensor) is checked to
  be a multiple of `divisor`, failing with `message` otherwise.
* `explain_split_error(error, message)`: where `error` is the failed split of a
  batch into micro-batches (the reshape named `MICRO_BATCH_SPLIT`), an error of
  the same kind saying `message()` first; else None.
"""

from __future__ import annotations

import tensorflow as tf

from keras_tpu_mem.backends.step import MICRO_BATCH_SPLIT


def checked_count(per_replica_batch, divisor, count, message: str):
    """`count` (a tensor) after a run-time check that the batch splits by `divisor`."""
    check = tf.debugging.assert_equal(per_replica_batch % divisor, 0, message=message)
    with tf.control_dependencies([check]):  # check before the batch is split
        return tf.identity(count)


def explain_split_error(error, message):
    """Under XLA the run-time check of `checked_count` is dropped: a batch of unknown
    size that does not split fails in XLA's compilation of the split itself, with a
    bare reshape error. This puts `message()` before it."""
    if not isinstance(error, tf.errors.InvalidArgumentError):
        return None
    if MICRO_BATCH_SPLIT not in str(error):
        return None
    return tf.errors.InvalidArgumentError(
        error.node_def, error.op, f"{message()}\n\nXLA's error: {error.message}")


__all__ = ["checked_count", "explain_split_error"]
