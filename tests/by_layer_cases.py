"""What test_planning_by_layer.py (both backends) and test_planning_by_layer_jax.py share:
the issue's floor model, the encoder's layer names, and the sums every `LayerTable` must
meet (issue 22, item 1)."""

from __future__ import annotations

import keras
from planning_models import nbytes


def floor_model():
    """Input(256) -> Dense(8192, relu, "wide") -> Dense(256, relu, "narrow") -> Dense(10)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((256,)),
        keras.layers.Dense(8192, activation="relu", name="wide"),
        keras.layers.Dense(256, activation="relu", name="narrow"),
        keras.layers.Dense(10, name="head")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def check_sums(model, result, table):
    """The issue's sums, to 1%: `at_peak` to `peak_bytes`, `peak_bytes + slack_bytes` to
    the compiled total, the weights and optimizer columns to the model's variables;
    "unattributed" at most 10% of the peak."""
    at_peak = sum(r.at_peak for r in table)
    assert abs(at_peak - table.peak_bytes) <= 0.01 * table.peak_bytes
    assert abs(table.peak_bytes + table.slack_bytes - result.total_bytes) \
        <= 0.01 * result.total_bytes
    assert 0 < table.peak_bytes <= result.total_bytes
    assert table["unattributed"].at_peak <= 0.10 * table.peak_bytes
    weights = nbytes(model.weights)
    assert abs(sum(r.weights for r in table) - weights) <= 0.01 * weights
    optimizer = nbytes(model.optimizer.variables)
    assert abs(sum(r.optimizer for r in table) - optimizer) <= 0.01 * optimizer


def encoder_layers(model):
    """`([the attention layer, its four projections], [the two feed-forward Dense])` by
    the names `LayerTable` gives them."""
    attention = next(layer for layer in model.layers
                     if isinstance(layer, keras.layers.MultiHeadAttention))
    names = [attention.name] + [f"{attention.name}/{sub.name}" for sub in (
        attention.query_dense, attention.key_dense, attention.value_dense,
        attention.output_dense)]
    dense = [layer.name for layer in model.layers
             if isinstance(layer, keras.layers.Dense) and layer.name != "head"]
    return names, dense
