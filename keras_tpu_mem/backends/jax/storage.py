"""Files on JAX: TensorBoard's TensorFlow-free `gfile`, never TensorFlow's.

TensorBoard's `tensorboard.compat.tf` loads the real TensorFlow whenever it is
installed (seconds of start-up, hundreds of MiB, and on a GPU machine its CUDA
libraries, inside a JAX run); its stub `gfile` reads and writes local paths and
every fsspec file system (`gs://` with gcsfs installed) without it. It has no
`rename` nor `rmtree`: `gfile()` here is the stub with both added, through fsspec for
remote paths.

Contract: `keras_tpu_mem.backends.contracts.Storage`.
"""

from __future__ import annotations

import os
import shutil
import types

from tensorboard.compat.tensorflow_stub.io import gfile as _stub


def _rename(src: str, dst: str, overwrite: bool = False) -> None:
    if not overwrite and _stub.exists(dst):
        raise FileExistsError(dst)
    if "://" not in src:
        os.replace(src, dst)
        return
    import fsspec

    fs, src_path = fsspec.core.url_to_fs(src)
    fs.mv(src_path, fsspec.core.url_to_fs(dst)[1])


def _rmtree(path: str) -> None:
    if "://" not in path:
        shutil.rmtree(path)
        return
    import fsspec

    fs, fs_path = fsspec.core.url_to_fs(path)
    fs.rm(fs_path, recursive=True)


_GFILE = types.SimpleNamespace(GFile=_stub.GFile, exists=_stub.exists, isdir=_stub.isdir,
                               listdir=_stub.listdir, makedirs=_stub.makedirs,
                               walk=_stub.walk, stat=_stub.stat,
                               rename=_rename, rmtree=_rmtree)


def gfile():
    """TensorBoard's stub `gfile` with `rename` and `rmtree` added."""
    return _GFILE


def remote_path_problem(path: str) -> str | None:
    scheme = path.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:
        return ("remote paths are written through fsspec here (no TensorFlow on JAX), and "
                "fsspec is not installed: pip install fsspec (and gcsfs for gs://)")
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as err:
        return f"fsspec cannot write {scheme}:// paths here ({err})"
    return None


__all__ = ["gfile", "remote_path_problem"]
