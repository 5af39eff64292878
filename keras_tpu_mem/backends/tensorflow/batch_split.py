"""A batch split into micro-batches that failed while the step ran, on TensorFlow.

TensorFlow only (contract: `keras_tpu_mem.backends.contracts.BatchSplit`): a
TensorFlow step can get a batch whose size only the run knows (arrays, whose last
batch is smaller), so the split of a batch into micro-batches can fail inside the
running step (`context.splits_batches_at_run_time()` is True). JAX traces every
batch size as a Python int, and refuses a batch that does not split before any step
runs: no error of its step is a split's.
"""

from __future__ import annotations

import tensorflow as tf

from keras_tpu_mem.backends.step import MICRO_BATCH_SPLIT


def explain_split_error(error, message):
    """Where `error` is the failed split of a batch into micro-batches, an error of
    the same kind saying `message()` first; else None.

    A batch whose size only the run knows (arrays, whose last batch is smaller)
    fails the trainer's check (an assertion named `MICRO_BATCH_SPLIT`), or under
    XLA, which drops that assertion, the split itself (the reshape of that name).
    """
    if not isinstance(error, tf.errors.InvalidArgumentError):
        return None
    if MICRO_BATCH_SPLIT not in str(error):
        return None
    return tf.errors.InvalidArgumentError(
        error.node_def, error.op, f"{message()}\n\nXLA's error: {error.message}")
