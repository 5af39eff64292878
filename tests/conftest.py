"""Test harness: two logical CPUs and the strategy matrix of docs/testing.md.

TensorFlow's device layout can only be set before it initialises, so it is
set here, at import time of the first conftest, for the whole session: the
default strategy sees CPU:0, MirroredStrategy gets CPU:0 and CPU:1.
"""

from __future__ import annotations

import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Forced, not defaulted: TensorFlow's CPU allocator keeps statistics (what the
# in-process memory tests read) only with oneDNN on, and TensorFlow turns
# oneDNN on by default only on CPUs with AVX-512 (Intel here; AMD EPYC with
# AVX2 defaults it off). The oneDNN-off fallback (host RSS) is tested in
# subprocesses that set TF_ENABLE_ONEDNN_OPTS=0 themselves.
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"

# KERAS_BACKEND is read once, when Keras is imported, so one pytest process
# tests one backend: `python tests/run_backends.py` runs one per backend. JAX
# modules are named `*_jax.py`; every other module is TensorFlow's unless it is
# listed in BOTH_BACKENDS: then its tests are one body per behaviour, collected on
# both, and a test in it that needs TensorFlow (tf.distribute values, tfmot,
# tf.data, tf.function graphs) carries `@pytest.mark.tensorflow_only("why")` and is
# deselected on JAX (see `pytest_collection_modifyitems`).
BACKEND = os.environ["KERAS_BACKEND"]
BOTH_BACKENDS: tuple[str, ...] = (
    "test_accumulation.py",
    "test_precision_callback.py",
    "test_pruning_callback.py",
    "test_distillation_callback.py",
    "test_pruning_export.py",
    "test_pruning_masks.py",
    "test_pruning_report.py",
    "test_pruning_selection.py",
    "test_precision_convert.py",
    "test_precision_notice.py",
    "test_precision_planning_quiet.py",
    "test_precision_report.py",
    "test_resume.py",
    "test_feature_state.py",
    "test_planning_by_layer.py",
    "test_planning_by_layer_text.py",
    "test_monitoring_host_rss.py",
    "test_monitoring_resume.py",
    "test_planning_oom.py",
    "test_planning_sample_batch.py",
    "test_planning_search.py",
    "test_shapes.py",
)
if BACKEND == "jax":
    # Before JAX starts: 8 host CPU devices stand in for a TPU slice, and XLA's
    # CPU thread pool gets 16 threads. With more virtual devices than pool
    # threads (8 devices on a 2-core machine), XLA:CPU's in-process all-reduce
    # deadlocks intermittently ("Expected 8 threads to join the rendezvous";
    # 2 of 6 DataParallel fits hung, 7 of 7 passed with NPROC=16; see
    # docs/testing.md). Set, not defaulted: the JAX tests count on 8 devices.
    _flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
              if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*_flags, "--xla_force_host_platform_device_count=8"])
    os.environ["NPROC"] = "16"
    collect_ignore = sorted(
        path.name for path in pathlib.Path(__file__).parent.glob("test_*.py")
        if not path.stem.endswith("_jax") and path.name not in BOTH_BACKENDS)
else:
    collect_ignore_glob = ["*_jax.py"]

import numpy as np  # noqa: E402
import pytest  # noqa: E402

if BACKEND == "tensorflow":
    import tensorflow as tf  # noqa: E402

    from keras_tpu_mem.backends.tensorflow.cluster import mirrored_logical_cpus  # noqa: E402

    # One MirroredStrategy for the whole session (backends/tensorflow/cluster.py,
    # `_STRATEGIES`, says why).
    MIRRORED = mirrored_logical_cpus(2)

    def default_strategy():
        """The strategy a plain fit runs under (TensorFlow's default strategy)."""
        return tf.distribute.get_strategy()
else:
    import contextlib  # noqa: E402

    import jax  # noqa: E402
    import keras  # noqa: E402

    class _NoDistribution:
        """JAX's plain fit: no `keras.distribution`, one replica."""

        num_replicas_in_sync = 1

        def scope(self):
            return contextlib.nullcontext()

    class _DataParallel(keras.distribution.DataParallel):
        """JAX's counterpart of MirroredStrategy: DataParallel over the 8 host CPU
        devices set above, with MirroredStrategy's replica count attribute."""

        @property
        def num_replicas_in_sync(self) -> int:
            return len(jax.devices()[:8])

    MIRRORED = _DataParallel(devices=jax.devices()[:8])

    def default_strategy():
        """The strategy a plain fit runs under (no distribution on JAX)."""
        return _NoDistribution()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "tensorflow_only(why): the test needs TensorFlow itself (the reason "
        "says what: tf.distribute values, tfmot, tf.data, tf.function graphs); "
        "deselected on JAX")


def _repeats_default_on_jax(item) -> bool:
    """A matrix cell named "jit" (the `strategy_case` fixture's, or a `case`,
    `case_name` or `name` parameter): on JAX it is the "default" cell again, every
    step being jitted there."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(params.get(key) == "jit"
               for key in ("strategy_case", "case", "case_name", "name"))


def pytest_collection_modifyitems(config, items):
    """On JAX, tests marked `tensorflow_only` (in a BOTH_BACKENDS module) are not
    collected: they are TensorFlow's, and say why in the marker; nor are the "jit"
    cells of the matrix, which repeat the "default" ones there."""
    if BACKEND != "jax":
        return
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("tensorflow_only")
        if marker is not None and not marker.args:
            raise pytest.UsageError(f"{item.nodeid}: tensorflow_only needs a reason")
        drop = marker is not None or _repeats_default_on_jax(item)
        (dropped if drop else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept

# The matrix every feature passes on CPU (docs/testing.md):
#   default  - default strategy, jit_compile=False
#   jit      - default strategy, jit_compile=True (XLA, as on TPU)
#   mirrored - MirroredStrategy over 2 logical CPUs (replica semantics)
# On JAX the same names, every step under jax.jit (TensorFlow's jit_compile=False
# still compiles a graph; JAX's unjitted step is op by op, run_eagerly's path):
# mirrored is keras.distribution.DataParallel over 8 devices.
STRATEGY_CASES = ("default", "jit", "mirrored")


class StrategyCase:
    """One cell of the matrix: a strategy and the compile arguments that go with it."""

    def __init__(self, name: str):
        self.name = name
        if name == "mirrored":
            self.strategy = MIRRORED
        else:
            self.strategy = default_strategy()
        self.jit_compile = name == "jit" or BACKEND == "jax"

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
