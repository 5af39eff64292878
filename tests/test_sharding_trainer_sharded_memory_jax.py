"""Per-device compiled memory of the engine's sharded step (issue 21's floors).

The issue's MLP (512 inputs, 4 x Dense(1024, relu), a 16-way head, Adam), global
batch 1024 on 8 host devices, compiled by `compiled_memory` under plain
`DataParallel` and under the test-local sharded distribution (weights and
slots, or slots only). Compiles only; nothing runs.
"""

from __future__ import annotations

import re

import jax
import keras
import pytest
from sharding_step_models import Sharded, big_mlp, lay_out_optimizer

from keras_tpu_mem.accumulation import GradientAccumulation
from keras_tpu_mem.planning.compiled import compiled_memory

pytestmark = pytest.mark.skipif(len(jax.devices()) != 8, reason="needs 8 host devices")


def _compile(mode, steps=1):
    distribution = (keras.distribution.DataParallel(devices=jax.devices()) if mode == "dp"
                    else Sharded(mode))
    with distribution.scope():
        model = big_mlp()
        if mode == "optimizer":
            lay_out_optimizer(model, distribution)
        else:
            model.optimizer.build(model.trainable_variables)
        callbacks = [GradientAccumulation(steps)] if steps > 1 else None
        return compiled_memory(model, 1024, callbacks=callbacks, hlo_text=True)


@pytest.fixture(scope="module")
def data_parallel():
    return _compile("dp")


@pytest.fixture(scope="module")
def fully_sharded():
    return _compile("all")


def test_fully_sharded_step_total_and_state(data_parallel, fully_sharded):
    assert fully_sharded.total_bytes <= 0.35 * data_parallel.total_bytes
    assert fully_sharded.state_bytes <= 0.15 * data_parallel.state_bytes


def _all_reduce_shapes(hlo):
    """Result shapes of every all-reduce in the optimized HLO."""
    return [m.group(1) for m in re.finditer(r"= (.+?) all-reduce(?:-start)?\(", hlo)]


def test_sharded_gradients_are_reduce_scattered(fully_sharded):
    hlo = fully_sharded.hlo_text
    # 10 weights (5 kernels, 5 biases), each split over the 8 devices: one
    # reduce-scatter of its gradient; every all-reduce left is scalars (metrics).
    assert hlo.count(" reduce-scatter(") == 10
    assert hlo.count(" all-gather(") == 10
    for shape in _all_reduce_shapes(hlo):
        assert not re.search(r"\[\d", shape), shape


def test_data_parallel_all_reduces_whole_gradients(data_parallel):
    hlo = data_parallel.hlo_text
    assert " reduce-scatter(" not in hlo
    assert any(re.search(r"f32\[1024,1024\]", s) for s in _all_reduce_shapes(hlo))


def test_fully_sharded_with_accumulation(data_parallel):
    accumulated = _compile("all", steps=4)
    assert accumulated.micro_batches == 4
    assert accumulated.total_bytes <= 0.40 * data_parallel.total_bytes
    assert accumulated.hlo_text.count(" reduce-scatter(") == 10


def test_optimizer_sharded_state(data_parallel):
    optimizer_only = _compile("optimizer")
    assert optimizer_only.state_bytes <= 0.45 * data_parallel.state_bytes
    assert optimizer_only.total_bytes < data_parallel.total_bytes
