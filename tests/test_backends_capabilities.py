"""Capabilities a caller asks the backend for, instead of the other backend carrying a
stub that cannot fail (issue 29, defect 5). `Backend.has` looks modules up without
importing them, so both backends are checked from this TensorFlow process."""

from __future__ import annotations

import importlib.util

import pytest

from keras_tpu_mem import backends
from keras_tpu_mem.backends.contracts import ShardedStateUnavailable
from keras_tpu_mem.backends.tensorflow import sharding as tf_sharding

JAX, TF = backends.get("jax"), backends.get("tensorflow")


def test_only_tensorflow_explains_a_run_time_split():
    # On JAX every batch size is a Python int when the step is traced: its step
    # context has no split to explain (no stub that answers None).
    from keras_tpu_mem.backends.tensorflow import context as tf_context

    assert tf_context.splits_batches_at_run_time()
    jax_source = _source("jax.context")
    assert "def splits_batches_at_run_time() -> bool:" in jax_source
    assert "def explain_split_error" not in jax_source
    assert TF.has("trainer") and JAX.has("trainer")


def test_only_jax_shards_model_state():
    from keras_tpu_mem.sharding.distribution import sharding_concern

    assert JAX.shards_state() and not TF.shards_state()
    with pytest.raises(RuntimeError, match=r"reshard needs the JAX backend"):
        sharding_concern("reshard")
    with pytest.raises(ShardedStateUnavailable, match=r"ShardedDataParallel needs the JAX"):
        tf_sharding.resolve_devices(["cpu:0"])


def _source(module: str) -> str:
    spec = importlib.util.find_spec(f"keras_tpu_mem.backends.{module}")
    with open(spec.origin) as file:
        return file.read()


def test_no_stub_is_left_for_the_other_backend():
    assert "def check_available" not in _source("jax.sharding")
    assert "def check_available" not in _source("tensorflow.sharding")
    assert "def mirrored_logical_cpus" not in _source("jax.strategy")
    assert not JAX.has("cluster")  # TensorFlow's own concern, still used
    assert callable(TF.cluster.mirrored_logical_cpus)
    assert "def refuse" not in _source("tensorflow.sharding")


def test_capabilities_are_functions_of_the_contract():
    from keras_tpu_mem.backends.tensorflow import compiled as tf_compiled
    from keras_tpu_mem.backends.tensorflow import devices as tf_devices

    assert not tf_compiled.rematerialize_lever() and not tf_compiled.sharding_lever()
    assert tf_compiled.estimates() and tf_compiled.unit() == "replica"
    assert tf_devices.peak_resettable() is None and tf_devices.host_allocator_shared()
    jax_compiled, jax_devices = _source("jax.compiled"), _source("jax.devices")
    assert "def rematerialize_lever() -> bool:\n" in jax_compiled
    assert "def peak_resettable() -> bool | None:\n" in jax_devices
