"""One meaning of the batch under a `keras.distribution` on JAX (issue 22, item 4; 8 host
devices, conftest): `batch_size` as the global batch, `plan`'s replicas from the
distribution. What both backends share is in test_planning_sample_batch.py."""

from __future__ import annotations

import keras
import numpy as np
import planning_models
import pytest
from planning_models import wide_mlp

from keras_tpu_mem.planning import compiled_memory, plan

LENGTH, VOCAB, CLASSES = 12, 100, 5


def data_parallel(devices=8):
    return keras.distribution.DataParallel(devices=keras.distribution.list_devices()[:devices])


@pytest.fixture(scope="module")
def mlp():
    return wide_mlp(width=256, depth=2, inputs=128)


def test_plan_takes_a_sample_batch_under_a_distribution():
    model = planning_models.sequence_model(vocab=VOCAB, classes=CLASSES)
    rng = np.random.default_rng(0)
    sample = rng.integers(0, VOCAB, (2, LENGTH)), rng.integers(0, CLASSES, (2,))
    with data_parallel().scope():
        sharded = plan(model, 64, device="3145728B", sample_batch=sample)
    assert sharded.device.replicas == 8 and sharded.per_replica_batch == 8


def test_global_batch_under_data_parallel(mlp):
    reference = compiled_memory(mlp, 128, hlo_text=False)  # one device's rows, no distribution
    with data_parallel().scope():
        result = compiled_memory(mlp, 1024, hlo_text=False)
        with pytest.raises(ValueError, match=r"1020.*8 replicas"):
            compiled_memory(mlp, 1020)
        with pytest.warns(DeprecationWarning, match="per_replica_batch_size"):
            old = compiled_memory(mlp, per_replica_batch_size=128, hlo_text=False)
    assert (result.batch_size, result.replicas, result.devices) == (1024, 8, 8)
    assert result.data_bytes == reference.data_bytes  # 128 rows on each device
    assert "global batch 1024, 128 per device" in str(result).splitlines()[0]
    assert (old.batch_size, old.total_bytes) == (1024, result.total_bytes)


def test_plan_takes_the_replicas_from_the_distribution(mlp):
    """On the host's compiler (XLA:TPU lays the model out on the named slice instead:
    test_planning_target_jax)."""
    with data_parallel().scope():
        with pytest.raises(ValueError, match=r"'v5e-4'.*4 replica.*8 devices"):
            plan(mlp, 1024, device="v5e-4", compiler="host")
        with pytest.raises(ValueError, match="8 devices"):
            plan(mlp, 1024, device="16GiB-2", callbacks=[])
        matching = plan(mlp, 1024, device="v5e-8", compiler="host")
        sized = plan(mlp, 1024, device="16000000000B")  # no count: the distribution's
    assert matching.device.replicas == sized.device.replicas == 8
    assert matching.per_replica_batch == sized.per_replica_batch == 128
    assert matching.total_bytes == sized.total_bytes
    # Outside the distribution a count is the device's: one compile of 256 rows.
    assert plan(mlp, 1024, device="v5e-4", compiler="host").per_replica_batch == 256
