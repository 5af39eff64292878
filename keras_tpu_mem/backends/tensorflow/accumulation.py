"""Gradient accumulation's error on TensorFlow, where a batch's size may be known
only at run time (arrays, whose last batch is smaller): the trainer checks there
that the batch splits into micro-batches (an assertion named `MICRO_BATCH_SPLIT`),
and XLA, which drops that assertion, fails in the split itself (the reshape of
the same name).

TensorFlow's own concern (JAX knows every batch size when the step is traced,
so the feature refuses a batch that does not split before; callers ask
`Backend.has("accumulation")`):

* `explain_split_error(error, message)`: where `error` is the failed check or
  split of a batch into micro-batches, an error of the same kind saying
  `message()` first; else None.
"""

from __future__ import annotations

import tensorflow as tf

from keras_tpu_mem.backends.step import MICRO_BATCH_SPLIT


def explain_split_error(error, message):
    """The trainer's run-time check, or under XLA (which drops it) the compilation of
    the split itself, fails with a bare error naming `MICRO_BATCH_SPLIT`. This puts
    `message()` before it."""
    if not isinstance(error, tf.errors.InvalidArgumentError):
        return None
    if MICRO_BATCH_SPLIT not in str(error):
        return None
    return tf.errors.InvalidArgumentError(
        error.node_def, error.op, f"{message()}\n\nXLA's error: {error.message}")


__all__ = ["explain_split_error"]
