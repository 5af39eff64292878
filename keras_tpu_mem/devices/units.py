"""Byte units, how the package prints a byte count, and the bytes of a tensor.

No framework is imported here (numpy only when a dtype is measured): a dtype is
anything with a `name` (a numpy, Keras or backend dtype) or its name.
"""

from __future__ import annotations

import math

GIB = 1024**3
GB = 1000**3


def format_bytes(num: int | float | None) -> str:
    """Formats a byte count as `"1.50 GiB"`; `None` becomes `"unknown"`."""
    if num is None:
        return "unknown"
    num = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    return f"{num:.2f} TiB"  # pragma: no cover


def dtype_bytes(dtype) -> int:
    """Bytes of one element of `dtype` (bfloat16: 2, which numpy does not know)."""
    import numpy as np

    name = str(getattr(dtype, "name", dtype))
    if name == "bfloat16":
        return 2
    return int(np.dtype(name).itemsize)


def tensor_bytes(tensor) -> int:
    """Bytes of the whole of `tensor` (anything with `shape` and `dtype`: a variable, an
    array, a `keras.KerasTensor`, a `jax.ShapeDtypeStruct`), on one device."""
    return int(math.prod(int(d) for d in tensor.shape)) * dtype_bytes(tensor.dtype)
