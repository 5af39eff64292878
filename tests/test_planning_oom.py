"""The out-of-memory explanation (planning/oom.py) on TensorFlow: an injected
RESOURCE_EXHAUSTED in a fit becomes `StepOutOfMemoryError` with the compiled breakdown."""

from __future__ import annotations

import by_layer_views_cases
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory

MIB = 1024**2


class _InjectedOOM(ktm.engine.EngineCallback):
    """Raises TensorFlow's ResourceExhaustedError while the step is traced, once."""

    name = "injected_oom"
    armed = True

    def transform_loss(self, loss, ctx):
        if _InjectedOOM.armed:
            _InjectedOOM.armed = False  # the explanation's own compile traces it again
            raise tf.errors.ResourceExhaustedError(
                None, None, "OOM when allocating tensor with shape[2048,256]")
        return loss


def _oom_mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((256,))]
                             + [keras.layers.Dense(256, activation="relu") for _ in range(4)]
                             + [keras.layers.Dense(10)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.slow
def test_out_of_memory_is_explained_with_the_compiled_breakdown():
    from keras_tpu_mem.devices import format_bytes
    from keras_tpu_mem.planning import StepOutOfMemoryError, set_oom_device

    model = _oom_mlp()
    plain = compiled_memory(model, 2048, hlo_text=False)
    budget = int(plain.total_bytes * 0.6)
    x, y = np.zeros((2048, 256), "float32"), np.zeros((2048,), "int32")
    _InjectedOOM.armed = True
    set_oom_device(f"{budget / MIB:.3f}MiB")
    try:
        with pytest.raises(StepOutOfMemoryError) as info:
            model.fit(x, y, batch_size=2048, epochs=1, verbose=0, callbacks=[_InjectedOOM()])
    finally:
        set_oom_device(None)
    message = str(info.value)
    original = info.value.__cause__ or info.value.__context__
    assert isinstance(original, tf.errors.ResourceExhaustedError)
    assert "global batch 2048" in message
    assert format_bytes(info.value.plan.total_bytes) in message
    assert "capacity" in message and format_bytes(info.value.plan.capacity_bytes) in message
    rec = info.value.plan.recommendation
    assert rec is not None and "GradientAccumulation(" in message
    by_layer_views_cases.check_oom_message_shows_the_failing_steps_rows(info.value)
    # The recommended callbacks, compiled for the same model right after the
    # error (the failed fit's features are off it), fit the budget.
    check = compiled_memory(model, 2048, callbacks=rec.callbacks(), hlo_text=False)
    assert check.total_bytes <= budget


def test_out_of_memory_still_raises_when_the_by_layer_table_fails(monkeypatch):
    from keras_tpu_mem.planning import StepOutOfMemoryError

    model = _oom_mlp()
    x, y = np.zeros((256, 256), "float32"), np.zeros((256,), "int32")

    def fit_failing():
        _InjectedOOM.armed = True
        with pytest.raises(StepOutOfMemoryError) as info:
            model.fit(x, y, batch_size=256, epochs=1, verbose=0, callbacks=[_InjectedOOM()])
        return info.value

    by_layer_views_cases.check_oom_raises_when_the_table_fails(monkeypatch, fit_failing)
