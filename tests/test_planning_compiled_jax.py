"""`compiled_memory` on JAX (planning/compiled.py through backends/jax/compiled.py): the
engine's step through `jit(...).lower(...).compile().memory_analysis()`, per device under a
`keras.distribution` (8 host devices, conftest)."""

from __future__ import annotations

import re

import jax
import keras
import numpy as np
import pytest
from helpers import collectives_in_loop_bodies
from planning_models import encoder, wide_mlp

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory

MIB = 1024**2


@pytest.fixture(scope="module")
def small_encoder():
    return encoder()


def test_accumulation_step_holds_one_micro_batch():
    model = wide_mlp()
    plain = compiled_memory(model, 8192, hlo_text=False)
    micro = compiled_memory(model, 1024, hlo_text=False)
    accumulated = compiled_memory(model, 8192, callbacks=[ktm.GradientAccumulation(8)],
                                  hlo_text=False)
    assert accumulated.backend == "jax" and accumulated.micro_batches == 8
    assert accumulated.temp_bytes <= 0.25 * plain.temp_bytes
    assert accumulated.temp_bytes <= micro.temp_bytes + 16 * MIB
    # Independent reference: the engine's jitted step compiled directly.
    weights = [w.numpy() for w in model.weights]
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(weights, model.weights))


def test_data_parallel_accumulation_has_no_all_reduce_in_the_loop():
    model = wide_mlp()
    distribution = keras.distribution.DataParallel(devices=jax.devices()[:8])
    with distribution.scope():
        plain = compiled_memory(model, 8192, hlo_text=False)
        accumulated = compiled_memory(model, 8192, callbacks=[ktm.GradientAccumulation(8)])
    assert accumulated.devices == 8
    # Per device: 1024 rows each, then 8 micro-batches of 128.
    assert accumulated.data_bytes * 8 == compiled_memory(model, 8192,
                                                         hlo_text=False).data_bytes
    # Per device the plain step holds 1024 rows; the 8 MiB of accumulators
    # dominate at micro-batch 128, so the 0.25x floor is one device's (above).
    assert accumulated.temp_bytes < plain.temp_bytes
    loops = collectives_in_loop_bodies(accumulated.hlo_text)
    assert loops, "no while loop in the accumulation step"
    assert all(count == 0 for count in loops.values()), loops
    assert "all-reduce" in accumulated.hlo_text  # the one reduction after the loop


def test_model_parallel_shards_the_arguments():
    model = wide_mlp(width=1024, depth=4, inputs=1024, classes=64)  # 64: splits over 8
    one = compiled_memory(model, 64, hlo_text=False)
    mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"], jax.devices()[:8])
    layout = keras.distribution.LayoutMap(mesh)
    layout[".*dense.*kernel"] = (None, "model")
    # As keras.distribution asks: the model (and so its optimizer slots) made in the scope.
    with keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch").scope():
        sharded = compiled_memory(wide_mlp(width=1024, depth=4, inputs=1024, classes=64), 64,
                                  hlo_text=False)
    assert sharded.devices == 8
    assert sharded.argument_bytes <= 0.2 * one.argument_bytes, (sharded, one)


def test_bf16_engine_step_holds_fewer_temporaries(small_encoder):
    f32 = compiled_memory(small_encoder, 256, hlo_text=True)
    bf16 = compiled_memory(small_encoder, 256, callbacks=[ktm.MixedBFloat16()])
    assert bf16.features == ("MixedBFloat16",) and bf16.backend == "jax"
    # What was compiled is the bf16 step: bfloat16 buffers, and matrix products
    # on bfloat16 operands (XLA:CPU writes their results in float32, as
    # `algorithm=dot_bf16_bf16_f32` says); the float32 step has neither.
    assert "bf16[" not in f32.hlo_text and "bf16[" in bf16.hlo_text
    assert re.search(r"= bf16\[[^\]]*\]\S* dot\(|algorithm=dot_bf16_bf16_f32",
                     bf16.hlo_text), "no bf16 products in the HLO"
    # Small compiles are checked, not trusted (JAX's CPU compile has reported
    # 0 temporaries at small batches): a real activation footprint, i.e. at
    # least the float32 attention scores of the batch, 256 x 4 heads x 64 x 64.
    scores = 256 * 4 * 64 * 64 * 4
    assert f32.temp_bytes >= scores, f32
    assert bf16.temp_bytes >= scores // 2, bf16
    assert bf16.temp_bytes < f32.temp_bytes, (bf16, f32)
    # The model itself is untouched: still float32 everywhere.
    assert all(layer.dtype_policy.name == "float32" for layer in small_encoder.layers)
