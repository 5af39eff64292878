"""Shared test helpers: tiny models and comparisons, on either backend.

`batched` gives a tf.data pipeline on TensorFlow and the same batches as a
`keras.utils.PyDataset` on JAX (no TensorFlow imported there).
"""

from __future__ import annotations

import keras
import numpy as np


def mlp(inputs=16, hidden=32, classes=5, seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(classes),
    ])


def sparse_ce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def toy_data(n=160, inputs=16, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, inputs)).astype("float32")
    y = rng.integers(0, classes, n).astype("int32")
    return x, y


def batched(x, y, batch, sample_weight=None):
    """`(x, y[, sample_weight])` in batches of `batch`, the last partial one dropped."""
    parts = (x, y) if sample_weight is None else (x, y, sample_weight)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(parts).batch(batch, drop_remainder=True)
    return _Batches(parts, batch)


class _Batches(keras.utils.PyDataset):
    """tf.data's `.batch(batch, drop_remainder=True)` of numpy arrays, in order."""

    def __init__(self, parts, batch):
        super().__init__()
        self.parts, self.batch = parts, batch

    def __len__(self):
        return len(self.parts[0]) // self.batch

    def __getitem__(self, index):
        window = slice(index * self.batch, (index + 1) * self.batch)
        return tuple(part[window] for part in self.parts)


def max_abs_diff(weights_a, weights_b) -> float:
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(weights_a, weights_b, strict=True))


class RaiseAtEpoch(keras.callbacks.Callback):
    """Simulates an interruption (preemption) at the start of an epoch."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"interrupted at epoch {epoch}")
