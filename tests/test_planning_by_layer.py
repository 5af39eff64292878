"""`CompiledMemory.by_layer()` (planning/by_layer.py through each backend's
compiled_layers.py), one body per behaviour on both backends (conftest's
BOTH_BACKENDS): every buffer of XLA's buffer assignment attributed to a Keras layer.
What only JAX has (8 devices, split state, the rematerialisation lever, its dump's
compat hook) is in test_planning_by_layer_jax.py.

References are independent of the attribution: weight and optimizer bytes summed here
from the model's variables, the compiled total from the buffer assignment's
allocations (`compiled_memory`), the size of `wide`'s ReLU output (512 x 8192 float32)
by hand.
"""

from __future__ import annotations

import keras
import pytest
from by_layer_cases import check_sums, encoder_layers, floor_model
from planning_models import encoder, nbytes

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory
from keras_tpu_mem.planning.by_layer import LayerMemory, LayerTable
from keras_tpu_mem.planning.memory import CompiledMemory

ROWS = ("optimizer", "inputs", "unattributed")


@pytest.fixture(scope="module")
def floor():
    model = floor_model()
    result = compiled_memory(model, 512, hlo_text=False)
    return model, result, result.by_layer()


def test_floor_model_rows_and_sums(floor):
    model, result, table = floor
    assert isinstance(table, LayerTable)
    assert set(table.names()) == {"wide", "narrow", "head", *ROWS}
    check_sums(model, result, table)
    # Each layer's weights and its Adam slots (two per weight) at rest.
    for layer in model.layers:
        assert table[layer.name].weights == nbytes(layer.weights)
        assert table[layer.name].optimizer == 2 * nbytes(layer.weights)
    # Its own state: the iteration count and the learning rate.
    own = nbytes(model.optimizer.variables) - 2 * nbytes(model.trainable_weights)
    assert table["optimizer"].optimizer == own > 0
    assert table["inputs"].at_peak > 0


def test_floor_model_saved_activations(floor):
    _, _, table = floor
    saved = {r.name: r.saved_activations for r in table}
    assert max(saved, key=saved.get) == "wide"
    assert saved["wide"] >= 3 * saved["narrow"]
    # At least wide's ReLU output, which narrow's kernel gradient reads.
    assert saved["wide"] >= 512 * 8192 * 4


def test_table_order_top_and_text(floor):
    _, _, table = floor
    peaks = [r.at_peak for r in table]
    assert peaks == sorted(peaks, reverse=True)
    assert table.top(2) == table.rows[:2] and isinstance(table.top(1)[0], LayerMemory)
    text = str(table)
    assert text.splitlines()[0].startswith("Memory by layer")
    assert all(name in text for name in table.names())
    with pytest.raises(ValueError, match="`n`"):
        table.top(-1)
    with pytest.raises(KeyError, match="no row 'nope'"):
        table["nope"]


@pytest.mark.parametrize("make", [lambda: ktm.GradientAccumulation(4),
                                  lambda: ktm.MixedBFloat16()],
                         ids=["accumulation", "bf16"])
def test_same_sums_with_features(make):
    model = floor_model()
    result = compiled_memory(model, 512, callbacks=[make()], hlo_text=False)
    table = result.by_layer()
    check_sums(model, result, table)
    assert table["wide"].saved_activations > table["narrow"].saved_activations
    assert table["wide"].at_peak > 0 and table["narrow"].at_peak > 0


def test_pulled_micro_batches_attribute_the_accumulators_to_their_layers():
    """The step that applies an update of micro-batches pulled from the dataset holds
    one accumulator per trainable weight (arguments, written over with zeros): each
    counts at the peak to its weight's layer, not "unattributed", and the rows stay
    within the compiled total (XLA:CPU's live ranges list an in-place instruction's
    operand and result both: summed as listed, JAX's peak exceeded the total)."""
    model = floor_model()
    result = compiled_memory(model, 512, callbacks=[
        ktm.GradientAccumulation(4, dataset_yields="micro_batches")], hlo_text=False)
    assert result.pulled
    table = result.by_layer()
    check_sums(model, result, table)
    assert table["unattributed"].at_peak <= 1024
    for layer in model.layers:  # its weights, two Adam slots and its accumulator
        assert table[layer.name].at_peak >= 4 * nbytes(layer.weights)


def test_hand_built_compiled_memory_refuses():
    bare = CompiledMemory(batch_size=1, argument_bytes=0, data_bytes=0, temp_bytes=0,
                          live_out_bytes=0, alias_bytes=0, constant_bytes=0, weight_bytes=0,
                          optimizer_bytes=0)
    with pytest.raises(ValueError, match="compiled_memory"):
        bare.by_layer()


def test_encoder_rows_for_attention_and_feed_forward():
    model = encoder()
    result = compiled_memory(model, 16, hlo_text=False)
    table = result.by_layer()
    check_sums(model, result, table)
    attention, (up, down) = encoder_layers(model)
    for name in attention + [up, down]:
        assert table[name].at_peak > 0, name
    # TensorFlow runs `dense` under the scope `dense_1` and `dense_1` under `dense_1_2`:
    # the rows still go to the right layers. The feed-forward Dense(512, gelu) keeps its
    # gelu input (16 x 64 x 512 float32).
    assert table[up].saved_activations >= 16 * 64 * 512 * 4
    assert table[up].saved_activations > 4 * table[down].saved_activations
    layer = next(layer for layer in model.layers
                 if isinstance(layer, keras.layers.MultiHeadAttention))
    for sub in (layer.query_dense, layer.key_dense, layer.value_dense, layer.output_dense):
        assert table[f"{layer.name}/{sub.name}"].weights == nbytes(sub.weights)
