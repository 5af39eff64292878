"""Pruning cases written once and run on each backend (test_pruning_callback*.py)."""

from __future__ import annotations

import warnings

import keras
import numpy as np

from keras_tpu_mem.pruning import Pruning
from keras_tpu_mem.pruning.schedules import ConstantSparsity, PolynomialDecay


def _fit(schedule):
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(5)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 16)).astype("float32")
    y = rng.integers(0, 5, 256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                  callbacks=[Pruning(schedule)])
    never = [str(w.message) for w in caught if "nothing was pruned" in str(w.message)]
    kernel = np.asarray(model.layers[0].kernel)
    return never, int(np.asarray(model.optimizer.iterations)), float((kernel == 0).mean())


def check_a_schedule_that_never_pruned_warns_once():
    """tfmot's default frequency=100 on a short fine-tune: 64 updates, first pruning
    step 100 (begin_step=0 is turn 0, before the first update); then a schedule that
    prunes at step 10, which must not warn; then PolynomialDecay from 0, whose first
    turn prunes nothing (sparsity 0) and whose second is the one to name."""
    never, updates, zeros = _fit(ConstantSparsity(0.5, begin_step=0))
    assert updates == 64 and zeros == 0.0
    assert len(never) == 1, never
    assert "first pruning step is 100" in never[0] and "64 optimizer updates" in never[0]

    never, _, zeros = _fit(ConstantSparsity(0.5, begin_step=0, frequency=10))
    assert never == [] and abs(zeros - 0.5) < 0.01

    never, _, _ = _fit(PolynomialDecay(0.0, 0.5, begin_step=70, end_step=400,
                                                  frequency=50))
    assert len(never) == 1 and "first pruning step is 120" in never[0], never
