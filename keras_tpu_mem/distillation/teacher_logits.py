"""`TeacherLogits`: cached examples and logits as a `keras.utils.PyDataset`.

What `cache_teacher_logits` returns for arrays and `load_teacher_logits` for a
`.npz` file: batches in order, on every Keras backend, saved in the format of
`npz`.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.distillation.checks import check_batch_size
from keras_tpu_mem.distillation.elements import KEYS, TOP_K_VALUES_KEY
from keras_tpu_mem.distillation.npz import write as write_npz


class TeacherLogits(keras.utils.PyDataset):
    """Examples with the teacher's logits, as batches in order: what `fit` takes.

    Made by `cache_teacher_logits(teacher, (x, y), batch_size=...)` or
    `load_teacher_logits("cache.npz")`; works with every Keras backend. Batch
    `i` holds examples `[i * batch_size, (i + 1) * batch_size)` (the last batch
    may be smaller) as `(data, logits)`: `data` is `x`, `(x,)`, `(x, y)` or
    `(x, y, sample_weight)` as given, and `logits` a dict
    `{"ktm_teacher_logits": [b, classes]}` or
    `{"ktm_teacher_top_k_values": [b, k], "ktm_teacher_top_k_indices": [b, k]}`
    (float32 values, int32 indices): the structure `Distillation()` reads.
    `fit`'s default `shuffle=True` shuffles the order of the batches (each
    batch's examples stay together); shuffle the arrays before caching to mix
    them, `shuffle=False` keeps the order. Keras' build of the student from
    the first batch (before any callback) gets that batch without the logits,
    so no `prepare_student` is needed (with one worker, the default).

    Args:
        data: The examples, `x` or a tuple `(x[, y[, sample_weight]])` of numpy arrays.
        logits: The dict of per-example teacher arrays (see above).
        batch_size: Examples per batch (int >= 1).
        **kwargs: `keras.utils.PyDataset` arguments (`workers`, ...).

    Example:

    ```python
    cached = ktm.cache_teacher_logits(teacher, (x, y), batch_size=64)
    (x0, y0), logits0 = cached[0]         # the first 64 examples and their logits
    student.fit(cached, epochs=2, callbacks=[ktm.Distillation(temperature=2.0)])
    ```
    """

    def __init__(self, data, logits, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.batch_size = check_batch_size(batch_size)
        if not isinstance(logits, dict) or not logits or not set(logits) <= KEYS:
            raise ValueError(f"`logits` must be a dict with keys among {sorted(KEYS)}.")
        self.data = data
        self.logits = {k: np.asarray(v) for k, v in logits.items()}
        self.num_examples = len(next(iter(self.logits.values())))
        for leaf in keras.tree.flatten(data):
            if len(leaf) != self.num_examples:
                raise ValueError(
                    f"Every array must hold {self.num_examples} examples (as the logits); "
                    f"got one of shape {tuple(np.shape(leaf))}.")

    @property
    def top_k(self) -> int | None:
        """The k of a top-k cache, None when all logits are kept."""
        values = self.logits.get(TOP_K_VALUES_KEY)
        return None if values is None else int(values.shape[-1])

    def __len__(self):
        return -(-self.num_examples // self.batch_size)

    def _slice(self, index):
        if not -len(self) <= index < len(self):
            raise IndexError(f"batch {index} out of range for {len(self)} batches")
        index %= len(self)
        return slice(index * self.batch_size, (index + 1) * self.batch_size)

    def __getitem__(self, index):
        part = self._slice(index)
        data = keras.tree.map_structure(lambda a: a[part], self.data)
        if keras_compat.in_symbolic_build():
            # Keras builds the student's compiled loss and metrics from the first
            # batch before any callback runs (`fit` on JAX), and would take the
            # logits for labels: that build gets the batch without them, as
            # `prepare_student` gives it. Training steps get the logits.
            return data
        return data, {k: v[part] for k, v in self.logits.items()}

    def without_logits(self):
        """A PyDataset of the same batches without the logits (the original `data`)."""
        return _Batches(self)

    def save(self, path):
        """Writes the examples and logits to the `.npz` file `path` (see docs/distillation.md)."""
        write_npz(path, self.data, self.logits, batch_size=self.batch_size, top_k=self.top_k)


class _Batches(keras.utils.PyDataset):
    """The batches of a `TeacherLogits` without the logits."""

    def __init__(self, cached):
        super().__init__()
        self._cached = cached

    def __len__(self):
        return len(self._cached)

    def __getitem__(self, index):
        part = self._cached._slice(index)
        return keras.tree.map_structure(lambda a: a[part], self._cached.data)


__all__ = ["TeacherLogits"]
