"""Files on TensorFlow: `tf.io.gfile`, which reads and writes local paths and
TensorFlow's file systems (`gs://` natively).

Contract (same in `backends/jax/storage.py`):
- `gfile`: a module with `GFile(path, mode)`, `exists`, `makedirs`,
  `rename(src, dst, overwrite=)`.
- `remote_path_problem(path) -> str | None`: why a remote path (`scheme://...`)
  cannot be written here, or None.
"""

from tensorflow.io import gfile


def remote_path_problem(path: str) -> str | None:
    # TensorFlow's file systems answer for themselves at the first write.
    return None


__all__ = ["gfile", "remote_path_problem"]
