"""Models, data and helpers of the profiling tests, one definition for their modules.

Imports only Keras and NumPy (no TensorFlow, no JAX), so the window, summary
and sweep tests of both backends share them.
"""

from __future__ import annotations

import glob
import os

import keras
import numpy as np


def digits_model(jit_compile=True, steps_per_execution=1):
    """The TensorFlow tests' MLP on the 64 digits features."""
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile, steps_per_execution=steps_per_execution)
    return model


def small_model(steps_per_execution=1, units=32, classes=10):
    """The JAX tests' MLP on 64 features (every JAX step is XLA-compiled)."""
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(units, activation="relu"),
                              keras.layers.Dense(classes)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


def random_data(n=320):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 64)).astype("float32"), rng.integers(0, 10, n).astype("int32")


def xplanes(log_dir):
    """Every `*.xplane.pb` under `log_dir`, sorted."""
    return sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))


def messages(records):
    """The messages of the `ktm_records` fixture's records."""
    return [r.getMessage() for r in records]


def capture_twice(profiler, log_dir, work):
    """Runs a backend's profiler through its contract: a capture into `log_dir`, a second
    start while it runs, one step marker around `work()`, then two stops.

    Returns the four answers (first start, second start, first stop, second stop) and
    the `*.xplane.pb` files written.
    """
    started = profiler.start(str(log_dir))
    try:
        again = profiler.start(str(log_dir / "other"))  # one capture at a time
        with profiler.step("ktm_step", 0):
            work()
    finally:
        stopped = profiler.stop()
    return (started, again, stopped, profiler.stop()), xplanes(str(log_dir))
