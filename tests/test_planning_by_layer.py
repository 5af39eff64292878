"""`CompiledMemory.by_layer()` on TensorFlow (planning/by_layer.py through
backends/tensorflow/compiled_layers.py): every buffer of XLA's `HloProto` buffer
assignment attributed to a Keras layer; the JAX twin is test_planning_by_layer_jax.py.

References are independent of the attribution: weight and optimizer bytes summed here
from the model's variables, the compiled total from the buffer assignment's
allocations (`compiled_memory`), the size of `wide`'s ReLU output by hand.
"""

from __future__ import annotations

import keras
import pytest
from by_layer_cases import check_sums, floor_model
from planning_models import encoder, nbytes

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory
from keras_tpu_mem.planning.by_layer import LayerTable


def test_floor_model_rows_sums_and_saved_activations():
    model = floor_model()
    result = compiled_memory(model, 512, hlo_text=False)
    table = result.by_layer()
    assert isinstance(table, LayerTable)
    assert set(table.names()) == {"wide", "narrow", "head", "optimizer", "inputs",
                                  "unattributed"}
    check_sums(model, result, table)
    for layer in model.layers:
        assert table[layer.name].weights == nbytes(layer.weights)
        assert table[layer.name].optimizer == 2 * nbytes(layer.weights)
    saved = {r.name: r.saved_activations for r in table}
    assert max(saved, key=saved.get) == "wide"
    assert saved["wide"] >= 3 * saved["narrow"]
    assert saved["wide"] >= 512 * 8192 * 4  # its ReLU output
    assert str(table).startswith("Memory by layer")


@pytest.mark.parametrize("make", [lambda: ktm.GradientAccumulation(4),
                                  lambda: ktm.MixedBFloat16()],
                         ids=["accumulation", "bf16"])
def test_same_sums_with_features(make):
    model = floor_model()
    result = compiled_memory(model, 512, callbacks=[make()], hlo_text=False)
    table = result.by_layer()
    check_sums(model, result, table)
    assert table["wide"].saved_activations > table["narrow"].saved_activations


def test_encoder_rows_for_attention_and_feed_forward():
    model = encoder()
    result = compiled_memory(model, 16, hlo_text=False)
    table = result.by_layer()
    check_sums(model, result, table)
    attention = next(layer for layer in model.layers
                     if isinstance(layer, keras.layers.MultiHeadAttention))
    dense = [layer.name for layer in model.layers
             if isinstance(layer, keras.layers.Dense) and layer.name != "head"]
    for name in [attention.name] + dense:
        assert table[name].at_peak > 0, name
    # TensorFlow runs `dense` under the scope `dense_1` and `dense_1` under `dense_1_2`:
    # the feed-forward Dense(512, gelu) keeps its gelu input (16 x 64 x 512 float32).
    up, down = dense
    assert table[up].saved_activations >= 16 * 64 * 512 * 4
    assert table[up].saved_activations > 4 * table[down].saved_activations
    for sub in (attention.query_dense, attention.key_dense, attention.value_dense,
                attention.output_dense):
        assert table[f"{attention.name}/{sub.name}"].weights == nbytes(sub.weights)
