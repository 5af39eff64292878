"""`compiled_memory` (planning/compiled.py, memory.py, specs.py) on TensorFlow: XLA's buffer
assignment of Keras' step and of the engine's step for feature callbacks, data specs.

References are independent of the code under test: weight bytes are summed
here from `model.weights`, the engine's step against Keras' own at the micro-batch.
"""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from planning_models import digits_mlp, encoder, nbytes, wide_mlp

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory, plan
from keras_tpu_mem.planning.specs import infer_data_specs

MIB = 1024**2


@pytest.fixture(scope="module")
def mlp():
    """One digits MLP shared by the tests that only plan it: its compiles are cached."""
    return digits_mlp()


@pytest.fixture(scope="module")
def big_mlp():
    return wide_mlp()


@pytest.fixture(scope="module")
def small_encoder():
    return encoder()


def test_compiled_memory_grows_with_batch_and_changes_nothing():
    model = digits_mlp()
    before = [np.array(v) for v in model.weights]
    results = [compiled_memory(model, b) for b in (8, 32, 128)]
    temps = [r.temp_bytes for r in results]
    assert temps[0] < temps[1] < temps[2], temps
    weight_bytes = nbytes(model.weights)  # 64*128 + 128 + 128*10 + 10 floats
    assert weight_bytes == 4 * (64 * 128 + 128 + 128 * 10 + 10)
    for r in results:
        assert r.argument_bytes >= weight_bytes
        # Arguments hold the weights, Adam's two slots, and the batch itself.
        data = r.batch_size * (64 * 4 + 4)
        assert r.argument_bytes >= weight_bytes + nbytes(model.optimizer.variables) + data
        assert r.data_bytes == data
        assert r.total_bytes >= r.argument_bytes + r.temp_bytes - r.alias_bytes
        assert "temporaries" in str(r)
        # XLA:TPU's layout is read from XLA:TPU's compile only.
        assert r.laid_out_bytes == 0 and "laid out" not in str(r)
    # Nothing ran: same weights, no optimizer step, but the slots now exist.
    assert model.optimizer.built
    assert int(model.optimizer.iterations.numpy()) == 0
    for old, new in zip(before, model.weights):
        np.testing.assert_array_equal(old, np.array(new))


def test_compiled_memory_same_for_every_strategy_case(strategy_case, mlp):
    with strategy_case.strategy.scope():
        model = digits_mlp(**strategy_case.compile_kwargs())
    reference = compiled_memory(mlp, 32)
    before = [np.array(v) for v in model.weights]
    # `batch_size` is the global batch: 32 per replica under any strategy.
    result = compiled_memory(model, 32 * model.distribute_strategy.num_replicas_in_sync)
    # One replica's step is the same program whatever the strategy: a model
    # built under MirroredStrategy is compiled on a host copy.
    assert result.temp_bytes == reference.temp_bytes
    assert result.argument_bytes == reference.argument_bytes
    for old, new in zip(before, model.weights):
        np.testing.assert_array_equal(old, np.array(new))


def test_specs_for_dict_inputs_and_non_sparse_losses():
    a = keras.Input((6,), name="a")
    b = keras.Input((3,), name="b", dtype="int32")
    x = keras.layers.Concatenate()([a, keras.layers.Embedding(10, 2)(b)[:, 0, :]])
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(5)(x))
    model.compile(optimizer="sgd", loss="mse")
    xs, ys = infer_data_specs(model, 7)
    assert xs["a"].shape == (7, 6) and xs["b"].shape == (7, 3) and xs["b"].dtype == tf.int32
    assert ys.shape == (7, 5) and ys.dtype == tf.float32
    assert compiled_memory(model, 7).data_bytes == 7 * (6 * 4 + 3 * 4 + 5 * 4)


def test_subclassed_model_needs_specs_and_accepts_them():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    model = Net()
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="x_spec"):
        compiled_memory(model, 4)
    result = compiled_memory(model, 4, x_spec=tf.TensorSpec((None, 5)),
                             y_spec=tf.TensorSpec((None, 3)))
    assert result.data_bytes == 4 * (5 + 3) * 4
    assert result.argument_bytes >= nbytes(model.weights)


@pytest.mark.parametrize("batch, error", [(0, ValueError), (-3, ValueError),
                                          (2.5, TypeError), (True, TypeError)])
def test_compiled_memory_rejects_bad_batch(batch, error):
    with pytest.raises(error, match="batch_size"):
        compiled_memory(digits_mlp(), batch)


def test_a_headroom_needs_xla_tpus_compile():
    """`headroom=` reserves HBM in XLA:TPU's compile: TensorFlow's compile is the host's
    (XLA:TPU plans come from plan(compiler='tpu')), so a headroom is refused by name,
    also with a TPU `device`, rather than dropped (the JAX side: test_planning_target_jax)."""
    model = digits_mlp()
    for device in (None, "v5e-8"):
        with pytest.raises(ValueError, match=r"`headroom` \(0.1\) reserves HBM in XLA:TPU.*"
                                             r"runs on the JAX backend.*the TensorFlow backend"):
            compiled_memory(model, 8, device=device, headroom=0.1)
    assert compiled_memory(model, 8, headroom=0.0).reserved_bytes == 0


def test_uncompiled_model_is_a_clear_error():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="compile the model first"):
        compiled_memory(model, 8)
    with pytest.raises(TypeError, match="keras.Model"):
        plan("not a model", 8)


def test_engine_accumulation_step_holds_one_micro_batch(big_mlp):
    plain = compiled_memory(big_mlp, 8192, hlo_text=False)
    micro = compiled_memory(big_mlp, 1024, hlo_text=False)
    accumulated = compiled_memory(big_mlp, 8192, callbacks=[ktm.GradientAccumulation(8)])
    assert accumulated.temp_bytes <= 0.25 * plain.temp_bytes, (accumulated, plain)
    assert accumulated.temp_bytes <= micro.temp_bytes + 16 * MIB, (accumulated, micro)
    assert accumulated.micro_batches == 8
    assert accumulated.features == ("GradientAccumulation",)
    assert accumulated.accumulator_bytes == nbytes(big_mlp.trainable_weights)
    assert "accumulators" in str(accumulated)
    # The micro-batch loop is a while loop of the optimized HLO; the plain step has none.
    assert " while(" in accumulated.hlo_text
    assert plain.hlo_text == ""


def test_compiled_memory_with_callbacks_changes_nothing_and_the_callbacks_still_fit():
    keras.utils.set_random_seed(3)
    model = digits_mlp()
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    twin.compile(optimizer="adam",
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                 metrics=["accuracy"])
    weights = [np.array(v) for v in model.weights]
    policies = [layer.dtype_policy.name for layer in model.layers]
    callbacks = [ktm.MixedBFloat16(keep_after_fit=True), ktm.GradientAccumulation(2)]
    result = compiled_memory(model, 32, callbacks=callbacks)
    assert result.features == ("GradientAccumulation", "MixedBFloat16")  # engine order
    assert [np.array(v) for v in model.weights[:len(weights)]] and all(
        np.array_equal(a, np.array(b)) for a, b in zip(weights, model.weights))
    assert [layer.dtype_policy.name for layer in model.layers] == policies
    assert int(model.optimizer.iterations.numpy()) == 0
    assert all(cb.model is None for cb in callbacks)
    # The same callback objects train as fresh ones do on a twin (independent
    # reference: same weights, same data, new callbacks).
    x = np.random.default_rng(0).normal(size=(64, 64)).astype("float32")
    y = (np.arange(64) % 10).astype("int32")
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    twin.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
             callbacks=[ktm.MixedBFloat16(keep_after_fit=True), ktm.GradientAccumulation(2)])
    for a, b in zip(model.weights, twin.weights):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-6)


def test_bf16_engine_step_holds_fewer_temporaries(small_encoder):
    f32 = compiled_memory(small_encoder, 256, hlo_text=False)
    bf16 = compiled_memory(small_encoder, 256, callbacks=[ktm.MixedBFloat16()])
    # What was compiled is the bf16 step: its matrix products are bf16 ones.
    assert re.search(r"bf16\[[^\]]*\]\S* (dot|convolution|custom-call)", bf16.hlo_text) or (
        "bf16" in bf16.hlo_text and " dot(" in bf16.hlo_text), "no bf16 products in the HLO"
    assert all(layer.dtype_policy.name == "float32" for layer in small_encoder.layers)
    # The saving itself depends on XLA:CPU's version: TensorFlow 2.21's holds 214 vs 242 MiB
    # for this encoder; 2.19's computes bf16 products in float32 and keeps the float32
    # copies alive (354 vs 307 MiB, docs/planning.md), so there it is not a property of ours.
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 21):
        assert bf16.temp_bytes < f32.temp_bytes, (bf16, f32)


def test_compiled_memory_rejects_bad_callbacks(big_mlp):
    with pytest.raises(TypeError, match="callbacks"):
        compiled_memory(big_mlp, 8, callbacks=ktm.GradientAccumulation(2))
    with pytest.raises(TypeError, match=r"callbacks\[1\]"):
        compiled_memory(big_mlp, 8, callbacks=[ktm.GradientAccumulation(2), "bf16"])
    with pytest.raises(ValueError, match="more than one"):
        compiled_memory(big_mlp, 8, callbacks=[ktm.GradientAccumulation(2),
                                                ktm.GradientAccumulation(4)])
    with pytest.raises(ValueError, match="steps=3"):
        compiled_memory(big_mlp, 8, callbacks=[ktm.GradientAccumulation(3)])
