"""Pruning on the JAX engine (issue 15 B): the floors under keras.distribution.

References are independent: the sparsity is counted from the weights, the
accuracy is a numpy forward pass, the dense run is a plain Keras fit.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from helpers import make_distribution, scope, sparse_ce

from keras_tpu_mem import PolynomialDecay, Pruning, strip_pruning
from keras_tpu_mem.engine import Engine
from keras_tpu_mem.pruning.schedules import ConstantSparsity

BATCH = 32
EPOCHS = 12
STEPS = 43  # whole batches per epoch (divide by 8 devices)
TOTAL = EPOCHS * STEPS
END = round(0.6 * TOTAL)


def _digits_mlp(distribution=None):
    keras.utils.set_random_seed(0)
    with scope(distribution):
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu", name="dense_1"),
            keras.layers.Dense(256, activation="relu", name="dense_2"),
            keras.layers.Dense(16, name="dense_out"),
        ])
        model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=sparse_ce())
    return model


def _numpy_accuracy(model, x, y):
    h = np.asarray(x, np.float64)
    layers = model.layers
    for i, layer in enumerate(layers):
        h = h @ np.asarray(layer.kernel, np.float64) + np.asarray(layer.bias, np.float64)
        if i < len(layers) - 1:
            h = np.maximum(h, 0.0)
    return float(np.mean(np.argmax(h, axis=1) == y))


def _data(digits):
    (x, y), (xv, yv) = digits
    return (x[:STEPS * BATCH], y[:STEPS * BATCH]), (xv, yv)


@pytest.fixture(scope="module")
def dense_accuracy(digits):
    (x, y), (xv, yv) = _data(digits)
    model = _digits_mlp()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
    return _numpy_accuracy(model, xv, yv)


def test_floor_polynomial_decay_on_digits_under_model_parallel(digits, dense_accuracy):
    """Under ModelParallel (2 x 4) the masks must lie like their kernels. The
    DataParallel(8) floor (spe 1 and 4) is test_pruning_callback.py's, collected on
    JAX too."""
    (x, y), (xv, yv) = _data(digits)
    distribution = make_distribution("mp2x4")
    model = _digits_mlp(distribution)
    schedule = PolynomialDecay(0.0, 0.8, begin_step=0, end_step=END, frequency=20)
    pruning = Pruning(schedule)
    with scope(distribution):
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
                  callbacks=[pruning])
    assert int(np.asarray(model.optimizer.iterations.value)) == TOTAL
    kernels = [layer.kernel for layer in model.layers]
    masks = Engine.of(model).feature_state(pruning).masks
    for kernel, mask in zip(kernels, masks, strict=True):
        value = np.asarray(kernel.value)
        assert np.mean(value == 0) == pytest.approx(0.80, abs=0.01), kernel.path
        # The mask travelled with the step and covers exactly the zeros.
        np.testing.assert_array_equal(np.asarray(mask), value != 0)
        assert mask.sharding.is_equivalent_to(kernel.value.sharding, 2)
    assert dense_accuracy > 0.9
    accuracy = _numpy_accuracy(model, xv, yv)
    assert accuracy >= dense_accuracy - 0.02, (accuracy, dense_accuracy)


def test_two_by_four_and_strip_pruning(digits):
    (x, y), (xv, _) = _data(digits)
    distribution = make_distribution("dp8")
    model = _digits_mlp(distribution)
    pruning = Pruning(ConstantSparsity(0.5, begin_step=0, frequency=10), m_by_n=(2, 4))
    with scope(distribution):
        model.fit(x[:8 * BATCH], y[:8 * BATCH], batch_size=BATCH, epochs=2, verbose=0,
                  shuffle=False, callbacks=[pruning])
    for layer in model.layers:
        kernel = np.asarray(layer.kernel.value)
        groups = kernel.reshape(kernel.shape[0] // 4, 4, kernel.shape[1])
        assert np.all(np.sum(groups == 0, axis=1) >= 2), layer.name
    stripped = strip_pruning(model)
    probe = xv[:64]
    np.testing.assert_allclose(np.asarray(stripped.predict(probe, verbose=0)),
                               np.asarray(model.predict(probe, batch_size=64, verbose=0)),
                               atol=1e-5)
    assert jax.devices()  # 8 host devices from conftest

