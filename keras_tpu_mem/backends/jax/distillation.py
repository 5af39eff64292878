"""Distillation on JAX: no tf.distribute, and tf.data only as TensorFlow's own object.

Contract: as `backends/tensorflow/distillation.py`. On JAX variables are laid
out by the active `keras.distribution`, not by a strategy: `model_strategy`,
`variable_owner` and `active_strategy` answer None, so a teacher always runs
as it is. A `tf.data.Dataset` can only exist where TensorFlow is already
loaded: `is_dataset` recognises one without importing TensorFlow, and the
functions that read or write such datasets (and directory caches) are
TensorFlow's own, loaded only when one is asked for. Caching logits from a
tf.data.Dataset runs the teacher under tf.distribute, which a JAX model does
not have: `replica_runner` refuses (cache arrays instead).
"""

from __future__ import annotations

import sys

#: The functions on tf.data objects: TensorFlow's half serves them.
_TF_DATA = frozenset(("is_infinite", "to_numpy", "examples_dataset", "save_examples",
                      "load_examples", "directory_in_use", "drop_logits", "first_element"))


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


def __getattr__(name):
    if name in _TF_DATA:
        from keras_tpu_mem.backends.tensorflow import distillation

        return getattr(distillation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
