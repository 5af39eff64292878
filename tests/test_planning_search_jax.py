"""`plan(..., callbacks=...)` per device under a `keras.distribution` on JAX (8 host
devices, conftest). What both backends share is in test_planning_search.py."""

from __future__ import annotations

import jax
import keras
import pytest
from planning_models import encoder

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory, plan


@pytest.mark.slow
def test_data_parallel_plan_matches_compile_per_device():
    distribution = keras.distribution.DataParallel(devices=jax.devices()[:8])
    callbacks = lambda: [ktm.GradientAccumulation(4), ktm.MixedBFloat16()]  # noqa: E731
    with distribution.scope():
        model = encoder()
        planned = plan(model, 2048, device="16GiB-8", callbacks=callbacks())
        compiled = compiled_memory(model, 2048, callbacks=callbacks(), hlo_text=False)
    one = compiled_memory(encoder(), 256, callbacks=callbacks(), hlo_text=False)
    assert compiled.devices == 8 and planned.per_replica_batch == 256
    # Per device: 2048 rows over 8 devices is 256 rows each, as one device at 256.
    assert compiled.data_bytes == one.data_bytes
    assert compiled.data_bytes * 8 == compiled_memory(encoder(), 2048, hlo_text=False).data_bytes
    assert compiled.temp_bytes >= 64 * 4 * 64 * 64 * 2, compiled
    assert abs(planned.total_bytes - compiled.total_bytes) <= 0.05 * compiled.total_bytes, \
        (str(planned), compiled)
