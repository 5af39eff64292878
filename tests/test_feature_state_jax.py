"""The features' variables carried between jitted calls on JAX
(`keras_tpu_mem/backends/jax/feature_state.py`): a callback's write between
calls reaches the next step, and the variables hold the step's values where
something reads them (a callback's `model`, the end of an epoch and of `fit`)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_tpu_mem import PolynomialDecay, Pruning
from keras_tpu_mem.pruning.schedules import ConstantSparsity

BATCH, STEPS = 16, 12


def _model(spe):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)),
                              keras.layers.Dense(24, activation="relu", name="hidden"),
                              keras.layers.Dense(4, name="out")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 12)).astype("float32")
    return x, rng.integers(0, 4, size=BATCH * STEPS)


class _ZeroMaskAt(keras.callbacks.Callback):
    """Zeroes the hidden layer's pruning mask before the call that starts at
    step `at`, and records the hidden kernel seen after every call."""

    def __init__(self, pruning, at):
        super().__init__()
        self.pruning, self.at, self.seen = pruning, at, {}

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            mask = self.pruning._weights[0].mask
            mask.assign(np.zeros(mask.shape, mask.dtype))

    def on_train_batch_end(self, batch, logs=None):
        kernel = self.model.layers[0].kernel  # `model` syncs Keras' state
        self.seen[batch] = np.asarray(kernel.value).copy()


@pytest.mark.parametrize("spe", [1, 4])
def test_a_mask_written_between_calls_prunes_the_next_step(spe):
    x, y = _data()
    model = _model(spe)
    # Never prunes by schedule (begin_step past the fit): the masks stay all
    # ones unless written.
    pruning = Pruning(ConstantSparsity(0.5, begin_step=10 * STEPS, frequency=1))
    probe = _ZeroMaskAt(pruning, at=spe)  # the second call
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[pruning, probe])
    first, second = 0 + spe - 1, 2 * spe - 1  # the last step of each call
    assert np.count_nonzero(probe.seen[first]) == probe.seen[first].size
    # The written mask took effect at the very next step, and stays.
    assert not np.any(probe.seen[second])
    assert not np.any(np.asarray(model.layers[0].kernel.value))
    assert not np.any(np.asarray(pruning._weights[0].mask.value))
    assert np.count_nonzero(np.asarray(model.layers[1].kernel.value)) == 24 * 4
    np.testing.assert_array_equal(np.asarray(pruning._weights[1].mask.value), 1)


class _MasksSeen(keras.callbacks.Callback):
    """Reads the masks through a callback's `model` (as checkpoints do) after
    every call: they must be this call's, covering the kernels' zeros."""

    def __init__(self, pruning):
        super().__init__()
        self.pruning, self.checked = pruning, 0

    def on_train_batch_end(self, batch, logs=None):
        for layer, w in zip(self.model.layers, self.pruning._weights):
            np.testing.assert_array_equal(np.asarray(w.mask.value),
                                          np.asarray(layer.kernel.value) != 0)
        self.checked += 1


@pytest.mark.parametrize("spe", [1, 4])
def test_after_fit_the_variables_hold_the_steps_final_values(spe):
    x, y = _data()
    model = _model(spe)
    pruning = Pruning(PolynomialDecay(0.0, 0.75, begin_step=0, end_step=2 * STEPS,
                                      frequency=2))
    seen = _MasksSeen(pruning)
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
              callbacks=[pruning, seen])
    assert seen.checked == 3 * STEPS // spe
    for layer, w in zip(model.layers, pruning._weights):
        kernel = np.asarray(layer.kernel.value)
        assert np.mean(kernel == 0) == pytest.approx(0.75, abs=0.01)
        np.testing.assert_array_equal(np.asarray(w.mask.value), kernel != 0)
    # The same masks whatever the number of steps per call.
    reference = _model(1)
    ref_pruning = Pruning(PolynomialDecay(0.0, 0.75, begin_step=0, end_step=2 * STEPS,
                                          frequency=2))
    reference.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                  callbacks=[ref_pruning])
    for w, r in zip(pruning._weights, ref_pruning._weights):
        np.testing.assert_array_equal(np.asarray(w.mask.value), np.asarray(r.mask.value))
