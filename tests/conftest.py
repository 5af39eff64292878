"""Test harness: two logical CPUs and the strategy matrix of ARCHITECTURE.md.

TensorFlow's device layout can only be set before it initialises, so it is
set here, at import time of the first conftest, for the whole session: the
default strategy sees CPU:0, MirroredStrategy gets CPU:0 and CPU:1.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_tpu_mem.strategy import mirrored_logical_cpus  # noqa: E402

# One MirroredStrategy for the whole session (see strategy._STRATEGIES for why).
MIRRORED = mirrored_logical_cpus(2)

# The matrix every feature passes on CPU (see ARCHITECTURE.md):
#   default  - default strategy, jit_compile=False
#   jit      - default strategy, jit_compile=True (XLA, as on TPU)
#   mirrored - MirroredStrategy over 2 logical CPUs (replica semantics)
STRATEGY_CASES = ("default", "jit", "mirrored")


class StrategyCase:
    """One cell of the matrix: a strategy and the compile arguments that go with it."""

    def __init__(self, name: str):
        self.name = name
        if name == "mirrored":
            self.strategy = MIRRORED
        else:
            self.strategy = tf.distribute.get_strategy()
        self.jit_compile = name == "jit"

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    def compile_kwargs(self, **extra):
        kwargs = {"jit_compile": self.jit_compile}
        kwargs.update(extra)
        return kwargs

    def __repr__(self) -> str:
        return f"StrategyCase({self.name})"


@pytest.fixture(params=STRATEGY_CASES)
def strategy_case(request) -> StrategyCase:
    """Parametrises a test over default, jit and mirrored."""
    return StrategyCase(request.param)


@pytest.fixture
def mirrored() -> StrategyCase:
    return StrategyCase("mirrored")


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled digits (no download), scaled, split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    """Every test starts from the same seed and a clean Keras session."""
    import keras

    keras.utils.set_random_seed(0)
    yield
    keras.config.set_dtype_policy("float32")


@pytest.fixture
def ktm_records():
    """Records logged by the package logger "keras_tpu_mem" during the test."""
    import logging

    records = []

    class _Collect(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = _Collect(level=logging.DEBUG)
    logger = logging.getLogger("keras_tpu_mem")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
