"""`compiled_memory` / `plan` on JAX (issue 16): the engine's step through
`jit(...).lower(...).compile().memory_analysis()`, per device under a
`keras.distribution`, and the OOM explanation (8 host devices, conftest)."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from helpers_jax import collectives_in_loop_bodies

import keras_tpu_mem as ktm
from keras_tpu_mem.devices import format_bytes
from keras_tpu_mem.engine import EngineCallback
from keras_tpu_mem.planning import StepOutOfMemoryError, compiled_memory, plan, set_oom_device

MIB = 1024**2


def wide_mlp(width=512, depth=8, inputs=512, classes=10):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((inputs,))]
        + [keras.layers.Dense(width, activation="relu", name=f"dense_{i}") for i in range(depth)]
        + [keras.layers.Dense(classes, name="dense_out")])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


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


@pytest.mark.parametrize("cap", [8192, 4096])
def test_plan_with_callbacks_matches_the_compile(cap):
    model = wide_mlp()
    compiled = compiled_memory(model, 8192, callbacks=[ktm.GradientAccumulation(8)],
                               hlo_text=False)
    planned = plan(model, 8192, device="16GiB", callbacks=[ktm.GradientAccumulation(8)],
                   max_compile_batch=cap)
    assert planned.extrapolated == (cap < 8192)
    assert abs(planned.total_bytes - compiled.total_bytes) <= 0.05 * compiled.total_bytes


class InjectedOOM(EngineCallback):
    """Raises JAX's RESOURCE_EXHAUSTED error while the step is traced, once."""

    name = "injected_oom"
    backends = ("tensorflow", "jax")
    armed = True

    def transform_loss(self, loss, ctx):
        if InjectedOOM.armed:
            InjectedOOM.armed = False  # the explanation's own compile traces it again
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB.")
        return loss


def test_out_of_memory_is_explained_with_the_compiled_breakdown():
    model = wide_mlp(width=256, depth=4, inputs=256)
    plain = compiled_memory(model, 2048, hlo_text=False)
    budget = int(plain.total_bytes * 0.6)
    x = np.zeros((2048, 256), "float32")
    y = np.zeros((2048,), "int32")
    InjectedOOM.armed = True
    set_oom_device(f"{budget / MIB:.3f}MiB")
    try:
        with pytest.raises(StepOutOfMemoryError) as info:
            model.fit(x, y, batch_size=2048, epochs=1, verbose=0, callbacks=[InjectedOOM()])
    finally:
        set_oom_device(None)
    message = str(info.value)
    # Keras' traceback filter re-raises `from None`: the original stays the context.
    original = info.value.__cause__ or info.value.__context__
    assert isinstance(original, jax.errors.JaxRuntimeError)
    assert "global batch 2048" in message
    assert format_bytes(info.value.plan.total_bytes) in message
    assert "capacity" in message and format_bytes(info.value.plan.capacity_bytes) in message
    rec = info.value.plan.recommendation
    assert rec is not None and "GradientAccumulation(" in message
    # The recommended callbacks, compiled independently, fit the budget.
    # (On a twin: the failed fit never reached on_train_end, so the model's
    # engine still holds that fit's features.)
    twin = wide_mlp(width=256, depth=4, inputs=256)
    check = compiled_memory(twin, 2048, callbacks=rec.callbacks(), hlo_text=False)
    assert check.total_bytes <= budget
