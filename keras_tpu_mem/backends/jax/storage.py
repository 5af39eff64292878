"""Files on JAX: TensorBoard's TensorFlow-free `gfile`, never TensorFlow's.

TensorBoard's `tensorboard.compat.tf` loads the real TensorFlow whenever it is
installed (seconds of start-up, hundreds of MiB, and on a GPU machine its CUDA
libraries, inside a JAX run); its stub `gfile` reads and writes local paths and
every fsspec file system (`gs://` with gcsfs installed) without it.

Contract: as `backends/tensorflow/storage.py`.
"""

from tensorboard.compat.tensorflow_stub.io import gfile

__all__ = ["gfile"]
