"""tf.data as user input, on either Keras backend.

A `tf.data.Dataset` can exist only where TensorFlow is loaded, whichever
backend Keras runs: `is_dataset` recognises one without importing TensorFlow,
and `functions()` is TensorFlow's module that reads and writes them
(`backends/tensorflow/data.py`: `is_infinite`, `to_numpy`, `first_element`,
`examples_dataset`, `save_examples`, `load_examples`, `directory_in_use`,
`drop_logits`).
"""

from __future__ import annotations

import sys

from keras_tpu_mem import backends


def is_dataset(value) -> bool:
    """Whether `value` is a `tf.data.Dataset` (never imports TensorFlow)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(value, tf.data.Dataset)


def is_training_dataset(value) -> bool:
    """Whether `value` is a `tf.data.Dataset` and Keras runs a backend that trains on
    one (TensorFlow or JAX)."""
    return is_dataset(value) and backends.running() is not None


def functions():
    """TensorFlow's functions on tf.data objects (call only with a dataset in hand)."""
    return backends.get("tensorflow").data


__all__ = ["functions", "is_dataset", "is_training_dataset"]
