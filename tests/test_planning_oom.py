"""The out-of-memory explanation (planning/oom.py), one body per behaviour on both
backends (conftest's BOTH_BACKENDS): an injected RESOURCE_EXHAUSTED in a fit (the
error each backend's runtime raises) becomes `StepOutOfMemoryError` with the compiled
breakdown."""

from __future__ import annotations

import numpy as np
import pytest
from by_layer_views_cases import break_layer_rows, rows_in, to_bytes
from conftest import BACKEND
from planning_models import wide_mlp

from keras_tpu_mem.devices import format_bytes
from keras_tpu_mem.engine import EngineCallback
from keras_tpu_mem.planning import StepOutOfMemoryError, compiled_memory, set_oom_device

MIB = 1024**2


def _runtime_out_of_memory() -> Exception:
    """The error the backend's runtime raises where a step's buffers do not fit."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.errors.ResourceExhaustedError(
            None, None, "OOM when allocating tensor with shape[2048,256]")
    import jax

    return jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB.")


def check_message_shows_the_failing_steps_rows(error):
    """The message's five rows are of the step that failed (the whole batch), not of the
    recommendation (a micro-batch of it): its largest saver keeps more than there (k
    times as much on JAX; TensorFlow's micro-batch loop keeps about twice a
    micro-batch's activations, so only "clearly more" is asserted)."""
    message = str(error)
    assert "Memory by layer of the step that failed" in message
    shown = rows_in(message.split("Smallest change")[0])
    assert len(shown) == 5
    rec = error.plan.recommendation
    k = rec.accumulation_steps
    assert k > 1 and error.plan.by_layer is not None
    name = max(shown, key=lambda n: to_bytes(shown[n][2]))
    failing = to_bytes(shown[name][2])
    micro = error.plan.by_layer[name].saved_activations
    assert failing >= 1.5 * micro, (name, micro, k, failing)
    # Beside the smallest change that fits.
    assert message.index("Memory by layer of") < message.index("Smallest change that fits")


class InjectedOOM(EngineCallback):
    """Raises the runtime's out-of-memory error while the step is traced, once."""

    name = "injected_oom"
    armed = True

    def transform_loss(self, loss, ctx):
        if InjectedOOM.armed:
            InjectedOOM.armed = False  # the explanation's own compile traces it again
            raise _runtime_out_of_memory()
        return loss


@pytest.mark.slow
def test_out_of_memory_is_explained_with_the_compiled_breakdown():
    model = wide_mlp(width=256, depth=4, inputs=256)
    plain = compiled_memory(model, 2048, hlo_text=False)
    budget = int(plain.total_bytes * 0.6)
    x, y = np.zeros((2048, 256), "float32"), np.zeros((2048,), "int32")
    InjectedOOM.armed = True
    set_oom_device(f"{budget / MIB:.3f}MiB")
    try:
        with pytest.raises(StepOutOfMemoryError) as info:
            model.fit(x, y, batch_size=2048, epochs=1, verbose=0, callbacks=[InjectedOOM()])
    finally:
        set_oom_device(None)
    message = str(info.value)
    # Keras' traceback filter re-raises `from None` on JAX: the original stays the context.
    original = info.value.__cause__ or info.value.__context__
    assert isinstance(original, type(_runtime_out_of_memory()))
    assert "global batch 2048" in message
    assert format_bytes(info.value.plan.total_bytes) in message
    assert "capacity" in message and format_bytes(info.value.plan.capacity_bytes) in message
    rec = info.value.plan.recommendation
    assert rec is not None and "GradientAccumulation(" in message
    check_message_shows_the_failing_steps_rows(info.value)
    # The recommended callbacks, compiled for the same model right after the
    # error (the failed fit's features are off it), fit the budget.
    check = compiled_memory(model, 2048, callbacks=rec.callbacks(), hlo_text=False)
    assert check.total_bytes <= budget


def test_out_of_memory_still_raises_when_the_by_layer_table_fails(monkeypatch):
    model = wide_mlp(width=64, depth=2, inputs=32)
    x, y = np.zeros((256, 32), "float32"), np.zeros((256,), "int32")

    def fit_failing():
        InjectedOOM.armed = True
        with pytest.raises(StepOutOfMemoryError) as info:
            model.fit(x, y, batch_size=256, epochs=1, verbose=0, callbacks=[InjectedOOM()])
        return info.value

    # With the by-layer compile broken the error still comes, with one line saying so.
    break_layer_rows(monkeypatch)
    message = str(fit_failing())
    lines = [line for line in message.splitlines() if "by layer" in line.lower()]
    assert lines == ["Memory by layer could not be computed (RuntimeError: no dump here)."]
    assert "compiled total" in message  # the breakdown is still there


def test_out_of_memory_of_pulled_micro_batches_is_explained_by_the_applying_step():
    """A fit of micro-batches pulled from the dataset that runs out of device memory gets
    the compiled breakdown of its applying step at the micro-batch, accumulators named,
    against the capacity, and says why nothing smaller was searched for (the dataset
    splits the batch)."""
    from helpers import mlp, sparse_ce, toy_data

    from keras_tpu_mem import GradientAccumulation

    x, y = toy_data(32)
    model = mlp()
    model.compile(optimizer="adam", loss=sparse_ce())
    InjectedOOM.armed = True
    set_oom_device("4KiB")  # less than the step's compiled total (about 10 KiB)
    try:
        with pytest.raises(StepOutOfMemoryError) as info:
            model.fit(x, y, batch_size=8, verbose=0, callbacks=[
                GradientAccumulation(4, dataset_yields="micro_batches"), InjectedOOM()])
    finally:
        set_oom_device(None)
    message, plan = str(info.value), info.value.plan
    trainable = sum(4 * int(np.prod(w.shape)) for w in model.trainable_weights)
    assert plan.pulled and plan.accumulator_bytes == trainable and not plan.fits
    assert "global batch 8" in message and "vs capacity 4.00 KiB" in message
    assert "the dataset yields the micro-batches" in message

