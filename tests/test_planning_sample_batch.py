"""Plans for sequence models and one meaning of the batch (issue 22, item 4), one body per
behaviour on both backends (conftest's BOTH_BACKENDS): `sample_batch=` in
`compiled_memory` and `plan` (planning/specs.py, compiled.py, planner.py), `batch_size`
as the global batch, `plan` in every mode. What only a `keras.distribution` shows (8
host devices) is in test_planning_sample_batch_jax.py.

References are independent of `sample_batch`: the same step compiled from hand-written
specs of the backend (`tf.TensorSpec`, `jax.ShapeDtypeStruct`), and data bytes summed
here from shapes and dtypes."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import planning_models
import pytest
from conftest import BACKEND
from planning_models import digits_mlp

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory, plan

LENGTH, VOCAB, CLASSES = 12, 100, 5
#: The backend's own spec class, as the error messages name it.
SPEC_NAME = "tf.TensorSpec" if BACKEND == "tensorflow" else "jax.ShapeDtypeStruct"


def backend_spec(shape, dtype):
    """A hand-written spec of the backend's own class (the batch dimension is replaced)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.TensorSpec((None, *shape[1:]), dtype)
    import jax

    return jax.ShapeDtypeStruct(shape, dtype)


def sequence_model():
    return planning_models.sequence_model(vocab=VOCAB, classes=CLASSES)


def sample(rows=3, dtype="int32"):
    rng = np.random.default_rng(0)
    return (rng.integers(0, VOCAB, (rows, LENGTH)).astype(dtype),
            rng.integers(0, CLASSES, (rows,)).astype(dtype))


@pytest.fixture(scope="module")
def model():
    return sequence_model()


def test_sample_batch_defines_the_specs_of_a_sequence_model(model):
    x, y = sample(3)  # any batch size: 3 rows plan a batch of 8
    result = compiled_memory(model, 8, sample_batch=(x, y), hlo_text=False)
    by_hand = compiled_memory(model, 8, x_spec=backend_spec((1, LENGTH), "int32"),
                              y_spec=backend_spec((1,), "int32"), hlo_text=False)
    assert result.batch_size == 8
    assert result.data_bytes == 8 * (LENGTH * 4 + 4)
    assert (result.temp_bytes, result.argument_bytes) == (by_hand.temp_bytes,
                                                          by_hand.argument_bytes)
    # x alone: the labels come from the loss (int32 class ids); a sample weight is accepted.
    assert compiled_memory(model, 8, sample_batch=x, hlo_text=False).data_bytes == \
        result.data_bytes
    weighted = compiled_memory(model, 8, sample_batch=(x, y, np.ones(3, "float32")),
                               hlo_text=False)
    assert weighted.temp_bytes == result.temp_bytes
    # NumPy's default int64, as a user's token ids come, is planned as fit feeds it:
    # int32 on JAX (no x64), int64 on TensorFlow.
    fed = 4 if BACKEND == "jax" else 8
    assert compiled_memory(model, 8, sample_batch=sample(3, "int64"),
                           hlo_text=False).data_bytes == 8 * (LENGTH + 1) * fed


def test_plan_takes_a_sample_batch_in_every_mode(model):
    x, y = sample(2)
    plain = plan(model, 64, device="3145728B", sample_batch=(x, y))
    assert plain.per_replica_batch == 64 and plain.fits
    compiled = plan(model, 64, device="3145728B", sample_batch=(x, y), callbacks=[])
    assert compiled.total_bytes == compiled_memory(model, 64, sample_batch=(x, y),
                                                   hlo_text=False).total_bytes
    searched = plan(model, 64, device="3145728B", sample_batch=(x, y), search=True)
    assert searched.recommendation is not None


def test_unknown_dimensions_without_sample_batch_name_it(model):
    with pytest.raises(ValueError, match="sample_batch") as info:
        compiled_memory(model, 8)
    message = str(info.value)
    assert SPEC_NAME in message and "keras.KerasTensor" in message
    assert "None, None" in message  # the model's input shape
    if BACKEND == "jax":  # no TensorFlow named where it may not be installed
        assert "tf." not in message
    with pytest.raises(ValueError, match="sample_batch") as info:
        plan(model, 64, device="v5e-1")
    assert BACKEND == "tensorflow" or "tf." not in str(info.value)


def test_sample_batch_with_specs_is_an_error(model):
    x, y = sample()
    spec = backend_spec((1, LENGTH), "int32")
    with pytest.raises(ValueError, match="sample_batch.*x_spec"):
        compiled_memory(model, 8, sample_batch=(x, y), x_spec=spec)
    with pytest.raises(ValueError, match="sample_batch.*x_spec"):
        plan(model, 64, device="v5e-1", sample_batch=(x, y), y_spec=spec)


def test_dict_sample_batch_for_a_dict_model():
    a = keras.Input((None,), name="a", dtype="int32")
    b = keras.Input((3,), name="b")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 4)(a))
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([pooled, b]))
    model = keras.Model({"a": a, "b": b}, out)
    model.compile(optimizer="sgd", loss="mse")
    batch = ({"a": np.zeros((5, 7), "int32"), "b": np.zeros((5, 3), "float32")},
             np.zeros((5, 2), "float32"))
    assert compiled_memory(model, 4, sample_batch=batch, hlo_text=False).data_bytes == \
        4 * (7 * 4 + 3 * 4 + 2 * 4)


@pytest.mark.tensorflow_only("MirroredStrategy's replicas; JAX's DataParallel: "
                             "test_planning_sample_batch_jax.py")
def test_batch_size_is_global_under_a_strategy(mirrored):
    """`compiled_memory(model, 64)` under 2 replicas compiles 32 per replica, the step of
    the same model without a strategy at 32."""
    with mirrored.strategy.scope():
        model = digits_mlp(**mirrored.compile_kwargs())
    replicas = model.distribute_strategy.num_replicas_in_sync
    assert replicas == 2
    reference = compiled_memory(digits_mlp(), 32, hlo_text=False)
    result = compiled_memory(model, 64, hlo_text=False)
    assert (result.batch_size, result.replicas) == (64, 2)
    assert result.temp_bytes == reference.temp_bytes
    assert result.data_bytes == reference.data_bytes
    assert "global batch 64, 32 per replica" in str(result)
    with pytest.raises(ValueError, match=r"33.*2 replicas"):
        compiled_memory(model, 33)
    # The old per-replica call keeps working, with a deprecation warning.
    with pytest.warns(DeprecationWarning, match="per_replica_batch_size"):
        old = compiled_memory(model, per_replica_batch_size=32, hlo_text=False)
    assert (old.batch_size, old.temp_bytes) == (64, reference.temp_bytes)
    with pytest.raises(ValueError, match="not both"):
        compiled_memory(model, 64, per_replica_batch_size=32)


def test_batch_size_without_a_strategy_is_unchanged_and_warns_nothing():
    model = digits_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        result = compiled_memory(model, 32, hlo_text=False)
    assert result.batch_size == 32 and result.replicas == 1
    assert "XLA buffer assignment of one train step, batch 32" in str(result)


@pytest.mark.parametrize("kwargs", [
    {}, dict(callbacks=[]), dict(search=True), dict(accumulation_steps=2),
    dict(precision="bf16"), dict(callbacks=[ktm.GradientAccumulation(2)]),
], ids=["plain", "callbacks-empty", "search", "accumulation", "precision", "callbacks"])
def test_plan_in_every_mode(kwargs):
    """`plan(model, 1024, device="v5e-1")` and its modes."""
    planned = plan(digits_mlp(), 1024, device="v5e-1", **kwargs)
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
