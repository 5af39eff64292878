"""Files on TensorFlow: `tf.io.gfile`, which reads and writes local paths and
TensorFlow's file systems (`gs://` natively).

Contract (same in `backends/jax/storage.py`): `gfile`, a module with
`GFile(path, mode)`, `exists`, `makedirs`, `rename(src, dst, overwrite=)`.
"""

from tensorflow.io import gfile

__all__ = ["gfile"]
