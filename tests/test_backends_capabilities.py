"""Capabilities a caller asks the backend for, instead of the other backend carrying a
stub that cannot fail (issue 29, defect 5). `Backend.has` looks modules up without
importing them, so both backends are checked from this TensorFlow process."""

from __future__ import annotations

import importlib.util

import pytest

from keras_tpu_mem import backends
from keras_tpu_mem.backends.tensorflow import sharding as tf_sharding
from keras_tpu_mem.backends.tensorflow import strategy as tf_strategy

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
    assert JAX.shards_state() and not TF.shards_state()
    with pytest.raises(RuntimeError, match=r"reshard needs the JAX backend"):
        tf_sharding.refuse("reshard")


def _source(module: str) -> str:
    spec = importlib.util.find_spec(f"keras_tpu_mem.backends.{module}")
    with open(spec.origin) as file:
        return file.read()


def test_no_stub_is_left_for_the_other_backend():
    assert "def check_available" not in _source("jax.sharding")
    assert "def check_available" not in _source("tensorflow.sharding")
    assert "def mirrored_logical_cpus" not in _source("jax.strategy")
    assert callable(tf_strategy.mirrored_logical_cpus)  # TensorFlow's own, still used
