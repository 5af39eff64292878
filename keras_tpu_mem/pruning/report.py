"""`sparsity_report`: how sparse a model's prunable weights are and what sparse storage saves."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import keras
import numpy as np

from keras_tpu_mem.devices.units import tensor_bytes
from keras_tpu_mem.pruning.selection import find_prunable_weights


@dataclass
class WeightSparsity:
    """Sparsity of one prunable weight and what sparse formats would store.

    Attributes:
        path: The variable path (`layer/kernel`).
        layer: The layer name.
        shape: The weight's shape.
        size: Number of entries.
        zeros: Number of entries equal to 0.
        dense_bytes: Bytes stored densely.
        csr_bytes: Bytes as CSR over the `[prod(shape[:-1]), shape[-1]]` view:
            values + int32 column indices + int32 row pointers.
        bitmask_bytes: Bytes as the non-zero values + a 1-bit-per-entry mask.
        compressed_bytes: zlib (level 6) size of the dense bytes, when asked.
    """

    path: str
    layer: str
    shape: tuple
    size: int
    zeros: int
    dense_bytes: int
    csr_bytes: int
    bitmask_bytes: int
    compressed_bytes: int | None = None

    @property
    def sparsity(self) -> float:
        return self.zeros / self.size if self.size else 0.0

    @property
    def best_bytes(self) -> int:
        """The smallest of dense, CSR and bitmask storage."""
        return min(self.dense_bytes, self.csr_bytes, self.bitmask_bytes)


def _total(field: str, doc: str) -> property:
    """A property summing `field` over a report's weights."""
    return property(lambda report: sum(getattr(w, field) for w in report.weights), doc=doc)


@dataclass
class SparsityReport:
    """Per-weight and total sparsity of a model's prunable weights.

    Attributes:
        weights: One `WeightSparsity` per prunable weight.
        model_bytes: Bytes of all the model's weights stored densely.
    """

    weights: list[WeightSparsity] = field(default_factory=list)
    model_bytes: int = 0

    size = _total("size", "Entries of all prunable weights.")
    zeros = _total("zeros", "Entries equal to 0 over all prunable weights.")
    dense_bytes = _total("dense_bytes", "Prunable weights stored densely.")
    sparse_bytes = _total("best_bytes", "Prunable weights stored each in its smallest "
                                        "format (dense, CSR, bitmask).")

    @property
    def sparsity(self) -> float:
        """Fraction of zeros over all prunable weights."""
        return self.zeros / self.size if self.size else 0.0

    @property
    def saved_bytes(self) -> int:
        """Bytes a sparse format saves over dense storage."""
        return self.dense_bytes - self.sparse_bytes

    @property
    def compressed_bytes(self) -> int | None:
        if any(w.compressed_bytes is None for w in self.weights):
            return None
        return sum(w.compressed_bytes for w in self.weights)

    def to_dict(self) -> dict:
        return {
            "weights": [dict(vars(w), sparsity=w.sparsity, best_bytes=w.best_bytes,
                             shape=list(w.shape)) for w in self.weights],
            "size": self.size, "zeros": self.zeros, "sparsity": self.sparsity,
            "dense_bytes": self.dense_bytes, "sparse_bytes": self.sparse_bytes,
            "saved_bytes": self.saved_bytes, "compressed_bytes": self.compressed_bytes,
            "model_bytes": self.model_bytes,
        }

    def __str__(self) -> str:
        compressed = self.compressed_bytes is not None
        head = f"{'weight':<40} {'shape':>16} {'sparsity':>9} {'dense':>10} {'sparse':>10}"
        if compressed:
            head += f" {'zlib':>10}"
        lines = [head, "-" * len(head)]
        for w in self.weights:
            line = (f"{w.path[:40]:<40} {str(tuple(w.shape)):>16} {w.sparsity:>9.2%} "
                    f"{_human(w.dense_bytes):>10} {_human(w.best_bytes):>10}")
            if compressed:
                line += f" {_human(w.compressed_bytes):>10}"
            lines.append(line)
        lines.append("-" * len(head))
        total = (f"{'total':<40} {self.size:>16,} {self.sparsity:>9.2%} "
                 f"{_human(self.dense_bytes):>10} {_human(self.sparse_bytes):>10}")
        if compressed:
            total += f" {_human(self.compressed_bytes):>10}"
        lines.append(total)
        saved = self.saved_bytes
        lines.append(
            f"A sparse format saves {_human(saved)} of {_human(self.model_bytes)} of weights "
            f"({saved / self.model_bytes:.1%})." if self.model_bytes else ""
        )
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def sparsity_report(model, *, layers=None, compressed: bool = False) -> SparsityReport:
    """Per-weight and total sparsity of the weights `Pruning` prunes, and the bytes saved.

    Works on any model (pruned, stripped or loaded from disk): it reads the
    zeros in the weights.

    Args:
        model: A built `keras.Model`.
        layers: Restrict to these layers (as `Pruning(layers=...)`).
        compressed: Also measure the zlib-compressed size of each weight (reads
            and compresses every prunable weight on the host: slow for big models).

    Returns:
        A `SparsityReport`; `print()` it for a table.

    Example:

    ```python
    report = ktm.sparsity_report(model)
    print(report)                       # table per kernel, total, bytes saved
    assert report.sparsity > 0.79
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"sparsity_report expects a keras.Model, got {type(model).__name__}.")
    report = SparsityReport()
    report.model_bytes = sum(tensor_bytes(v) for v in model.weights)
    for w in find_prunable_weights(model, layers):
        value = keras.ops.convert_to_numpy(w.variable.value)
        size = int(value.size)
        itemsize = value.dtype.itemsize
        nnz = int(np.count_nonzero(value))
        rows = int(np.prod(value.shape[:-1])) if value.ndim > 1 else 1
        report.weights.append(WeightSparsity(
            path=w.path, layer=w.layer.name, shape=tuple(value.shape), size=size,
            zeros=size - nnz, dense_bytes=size * itemsize,
            csr_bytes=nnz * (itemsize + 4) + (rows + 1) * 4,
            bitmask_bytes=nnz * itemsize + math.ceil(size / 8),
            compressed_bytes=len(zlib.compress(value.tobytes(), 6)) if compressed else None,
        ))
    return report


__all__ = ["SparsityReport", "WeightSparsity", "sparsity_report"]
