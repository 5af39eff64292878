"""Distillation on JAX: no tf.distribute, and tf.data only as TensorFlow's own object.

Contract: as `backends/tensorflow/distillation.py`. On JAX variables are laid
out by the active `keras.distribution`, not by a strategy: `model_strategy`,
`variable_owner` and `active_strategy` answer None, so a teacher always runs
as it is. A `tf.data.Dataset` can only exist where TensorFlow is already
loaded: `is_dataset` recognises one without importing TensorFlow, and the
functions that read or write such datasets are TensorFlow's own. Caching
logits from a tf.data.Dataset runs the teacher under tf.distribute, which a
JAX model does not have: `replica_runner` refuses (cache arrays instead).
"""

from __future__ import annotations

import sys


def model_strategy(model):
    return None


def variable_owner(variable):
    return None


def active_strategy():
    return None


def replica_runner(fn, strategy):
    raise ValueError(
        "cache_teacher_logits runs the teacher on a tf.data.Dataset under tf.distribute, "
        "which needs the Keras TensorFlow backend. On JAX pass arrays instead, "
        "cache_teacher_logits(teacher, (x, y), batch_size=...), which returns a "
        "ktm.TeacherLogits PyDataset (saved with path='....npz').")


def is_dataset(value) -> bool:
    # Without importing TensorFlow: a tf.data.Dataset can only exist if it is loaded.
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(value, tf.data.Dataset)


def _tensorflow_half():
    """TensorFlow's functions, for the tf.data objects a user hands in (TF is loaded)."""
    from keras_tpu_mem.backends.tensorflow import distillation

    return distillation


def is_infinite(dataset) -> bool:
    return _tensorflow_half().is_infinite(dataset)


def to_numpy(element):
    return _tensorflow_half().to_numpy(element)


def examples_dataset(examples):
    return _tensorflow_half().examples_dataset(examples)


def save_examples(examples, path):
    _tensorflow_half().save_examples(examples, path)


def load_examples(paths, num_examples):
    return _tensorflow_half().load_examples(paths, num_examples)


def directory_in_use(path) -> bool:
    return _tensorflow_half().directory_in_use(path)


def drop_logits(dataset):
    return _tensorflow_half().drop_logits(dataset)


def first_element(dataset):
    return _tensorflow_half().first_element(dataset)
