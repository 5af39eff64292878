"""Files on TensorFlow: `tf.io.gfile`, which reads and writes local paths and
TensorFlow's file systems (`gs://` natively).

Contract: `keras_tpu_mem.backends.contracts.Storage`.
"""

from __future__ import annotations

from tensorflow.io import gfile as _gfile


def gfile():
    """`tf.io.gfile`."""
    return _gfile


def remote_path_problem(path: str) -> str | None:
    # TensorFlow's file systems answer for themselves at the first write.
    return None


__all__ = ["gfile", "remote_path_problem"]
