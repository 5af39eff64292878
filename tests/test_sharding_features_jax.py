"""Every feature at once under `ShardedDataParallel()` (issue 21's floor), on digits:
Pruning + Distillation (a live teacher, laid out by the same distribution) +
MixedBFloat16 + GradientAccumulation train to the accuracy a plain fit reaches, each
kernel ends at its target sparsity, and the masks are split like their kernels.
Accuracy is a numpy forward pass of the float32 weights; sparsity is counted."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_tpu_mem.accumulation import GradientAccumulation
from keras_tpu_mem.distillation import Distillation
from keras_tpu_mem.precision import MixedBFloat16
from keras_tpu_mem.pruning import ConstantSparsity, Pruning
from keras_tpu_mem.sharding import ShardedDataParallel, sharded_dim

pytestmark = pytest.mark.slow  # two fits of tens of epochs on 8 host devices


def _mlp(hidden, seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(hidden, activation="relu", name="hidden"),
                              keras.layers.Dense(16, name="logits")])
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _accuracy(model, x, y):
    h = np.maximum(x @ np.asarray(model.layers[0].kernel) + np.asarray(model.layers[0].bias), 0)
    logits = h @ np.asarray(model.layers[1].kernel) + np.asarray(model.layers[1].bias)
    return float(np.mean(np.argmax(logits, 1) == y))


def test_pruning_distillation_bf16_and_accumulation_together(digits):
    (x, y), (xv, yv) = digits
    n = len(x) // 64 * 64
    x, y = x[:n], y[:n]
    distribution = ShardedDataParallel()
    with distribution.scope():
        teacher = _mlp(256, seed=1)
        teacher.fit(x, y, batch_size=64, epochs=10, verbose=0)
        student = _mlp(128, seed=2)
        pruning = Pruning(ConstantSparsity(0.5, begin_step=20, frequency=10))
        student.fit(x, y, batch_size=64, epochs=25, verbose=0, shuffle=False, callbacks=[
            pruning, Distillation(teacher, temperature=2.0, alpha=0.5), MixedBFloat16(),
            GradientAccumulation(2)])
    assert _accuracy(teacher, xv, yv) >= 0.9
    assert _accuracy(student, xv, yv) >= 0.85
    for layer in student.layers:
        zeros = float(np.mean(np.asarray(layer.kernel) == 0))
        assert abs(zeros - 0.5) <= 0.01, (layer.name, zeros)
        assert sharded_dim(layer.kernel) is not None, layer.name  # the state stays split
    for weight in pruning._weights:
        assert weight.mask.value.sharding == weight.variable.value.sharding, weight.path
    assert sharded_dim(teacher.layers[0].kernel) is not None
