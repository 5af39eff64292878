"""Plans for sequence models and one meaning of the batch on JAX (issue 22, item 4):
`sample_batch=` in `compiled_memory` and `plan`, `batch_size` as the global batch under a
`keras.distribution` (8 host devices, conftest), `plan`'s replicas from the distribution,
and `plan` in every mode.

References are independent of `sample_batch`: the same step compiled from hand-written
`jax.ShapeDtypeStruct`s, and data bytes summed here from shapes and dtypes."""

from __future__ import annotations

import jax
import keras
import numpy as np
import planning_models
import pytest
from planning_models import wide_mlp

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory, plan

LENGTH, VOCAB, CLASSES = 12, 100, 5


def sequence_model():
    return planning_models.sequence_model(vocab=VOCAB, classes=CLASSES)


def sample(rows=3):
    rng = np.random.default_rng(0)
    # NumPy's default int64, as a user's token ids come: JAX (no x64) trains on int32.
    return rng.integers(0, VOCAB, (rows, LENGTH)), rng.integers(0, CLASSES, (rows,))


def data_parallel(devices=8):
    return keras.distribution.DataParallel(devices=keras.distribution.list_devices()[:devices])


@pytest.fixture(scope="module")
def model():
    return sequence_model()


@pytest.fixture(scope="module")
def mlp():
    return wide_mlp(width=256, depth=2, inputs=128)


def test_sample_batch_defines_the_specs_of_a_sequence_model(model):
    x, y = sample(3)
    result = compiled_memory(model, 8, sample_batch=(x, y), hlo_text=False)
    by_hand = compiled_memory(model, 8, x_spec=jax.ShapeDtypeStruct((1, LENGTH), np.int32),
                              y_spec=jax.ShapeDtypeStruct((1,), np.int32), hlo_text=False)
    assert result.batch_size == 8
    assert result.data_bytes == 8 * (LENGTH * 4 + 4)  # int32, as fit feeds it
    assert (result.temp_bytes, result.argument_bytes) == (by_hand.temp_bytes,
                                                          by_hand.argument_bytes)
    assert compiled_memory(model, 8, sample_batch=x, hlo_text=False).data_bytes == \
        result.data_bytes


def test_plan_takes_a_sample_batch_in_every_mode(model):
    x, y = sample(2)
    plain = plan(model, 64, device="3145728B", sample_batch=(x, y))
    assert plain.per_replica_batch == 64 and plain.fits
    assert plain.total_bytes == compiled_memory(model, 64, sample_batch=(x, y),
                                                hlo_text=False).total_bytes
    searched = plan(model, 64, device="3145728B", sample_batch=(x, y), search=True)
    assert searched.recommendation is not None
    with data_parallel().scope():
        sharded = plan(model, 64, device="3145728B", sample_batch=(x, y))
    assert sharded.device.replicas == 8 and sharded.per_replica_batch == 8


def test_unknown_dimensions_without_sample_batch_name_it_without_tf(model):
    with pytest.raises(ValueError, match="sample_batch") as info:
        compiled_memory(model, 8)
    message = str(info.value)
    assert "jax.ShapeDtypeStruct" in message and "keras.KerasTensor" in message
    assert "tf." not in message
    with pytest.raises(ValueError, match="sample_batch") as info:
        plan(model, 1024, device="v5e-1")
    assert "tf." not in str(info.value)


def test_sample_batch_with_specs_is_an_error(model):
    x, y = sample()
    spec = jax.ShapeDtypeStruct((1, LENGTH), np.int32)
    with pytest.raises(ValueError, match="sample_batch.*x_spec"):
        compiled_memory(model, 8, sample_batch=(x, y), x_spec=spec)


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


@pytest.mark.parametrize("kwargs", [
    {}, dict(callbacks=[]), dict(search=True), dict(accumulation_steps=2),
    dict(precision="bf16"), dict(callbacks=[ktm.GradientAccumulation(2)]),
], ids=["plain", "callbacks-empty", "search", "accumulation", "precision", "callbacks"])
def test_plan_in_every_mode(mlp, kwargs):
    """`plan(model, 1024, device="v5e-1")` and its modes, as on TensorFlow."""
    planned = plan(mlp, 1024, device="v5e-1", **kwargs)
    assert planned.fits and planned.total_bytes > 0 and planned.per_replica_batch == 1024
    assert "v5e-1" in str(planned)


def test_batch_size_sweep_trains_on_a_sample_batch():
    from keras_tpu_mem.profiling import batch_size_sweep

    x, y = sample(3)
    result = batch_size_sweep(sequence_model, None, [4, 8], steps=2, verbose=0,
                              sample_batch=(x, y))
    assert [row.batch_size for row in result.rows] == [4, 8]
    assert all(row.samples_per_sec for row in result.rows)
    with pytest.raises(ValueError, match="dataset_fn.*sample_batch"):
        batch_size_sweep(sequence_model, lambda b: None, [4], sample_batch=(x, y))
