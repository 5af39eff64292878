"""`CompiledMemory.by_layer()` on JAX (planning/by_layer.py through
backends/jax/compiled_layers.py): every buffer of the compiled step attributed to a
Keras layer from XLA's buffer assignment and live ranges.

References are independent of the attribution: weight and optimizer bytes summed here
from the model's variables, the compiled total from `memory_analysis()`, the size of
`wide`'s ReLU output (512 x 8192 float32) by hand.
"""

from __future__ import annotations

import keras
import pytest
from by_layer_cases import check_sums, floor_model
from planning_models import encoder, nbytes

import keras_tpu_mem as ktm
from keras_tpu_mem._compat import jax as jax_compat
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
    assert table["optimizer"].optimizer == (nbytes(model.optimizer.variables)
                                            - 2 * nbytes(model.trainable_weights)) == 8
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
    assert text.splitlines()[0].startswith("Memory by layer (per device)")
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
    assert table["wide"].at_peak > 0 and table["narrow"].at_peak > 0


def test_compiled_memory_itself_dumps_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled_memory dumped XLA's buffer assignment")

    monkeypatch.setattr(jax_compat, "compile_with_dump", refuse)
    model = floor_model()
    result = compiled_memory(model, 64, hlo_text=False)
    assert result.total_bytes > 0
    with pytest.raises(RuntimeError, match="dumped"):
        result.by_layer()


def test_hand_built_compiled_memory_refuses():
    bare = CompiledMemory(batch_size=1, argument_bytes=0, data_bytes=0, temp_bytes=0,
                          live_out_bytes=0, alias_bytes=0, constant_bytes=0, weight_bytes=0,
                          optimizer_bytes=0)
    with pytest.raises(ValueError, match="compiled_memory"):
        bare.by_layer()


def encoder_layers(model):
    """The attention layer with its projections, and the two feed-forward Dense."""
    attention = next(layer for layer in model.layers
                     if isinstance(layer, keras.layers.MultiHeadAttention))
    names = [attention.name] + [f"{attention.name}/{sub.name}" for sub in (
        attention.query_dense, attention.key_dense, attention.value_dense,
        attention.output_dense)]
    dense = [layer.name for layer in model.layers
             if isinstance(layer, keras.layers.Dense) and layer.name != "head"]
    return names, dense


@pytest.mark.parametrize("devices", [1, 8])
def test_encoder_rows_per_device(devices):
    model = encoder()
    if devices == 1:
        result = compiled_memory(model, 64, hlo_text=False)
    else:
        distribution = keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()[:devices])
        with distribution.scope():
            result = compiled_memory(model, 64, hlo_text=False)
    assert result.devices == devices
    table = result.by_layer()  # outside the scope: compiled for the same devices
    check_sums(model, result, table)
    attention, (up, down) = encoder_layers(model)
    for name in attention + [up, down]:
        assert table[name].at_peak > 0, name
        assert table[name].weights > 0 or name == attention[0], name
    # The feed-forward Dense(512, gelu) keeps its input to gelu: 64 x 64 x 512 float32
    # over the devices, at least.
    assert table[up].saved_activations >= 64 * 64 * 512 * 4 // devices


@pytest.mark.slow
def test_attribution_agrees_with_rematerialising_the_feed_forward_layer():
    """A change the attribution did not make: recomputing the feed-forward Dense(512, gelu)
    in the backward pass frees what the table says it saved."""
    from keras_tpu_mem.remat import Rematerialize

    model = encoder(seq=256)
    _, (up, _) = encoder_layers(model)
    plain = compiled_memory(model, 64, hlo_text=False)
    remat = compiled_memory(model, 64, callbacks=[Rematerialize(layers=[up])], hlo_text=False)
    fall = plain.total_bytes - remat.total_bytes
    assert fall > 0
    saved_fall = plain.by_layer()[up].saved_activations - remat.by_layer()[up].saved_activations
    assert saved_fall >= 0.5 * fall
    check_sums(model, remat, remat.by_layer())


def test_floor_model_under_sharded_state_per_device():
    """State split over 8 devices (the engine's sharded step): one device's shards."""
    from keras_tpu_mem.sharding import ShardedDataParallel

    with ShardedDataParallel().scope():
        model = floor_model()
        result = compiled_memory(model, 512, hlo_text=False)
    table = result.by_layer()
    assert result.devices == 8
    at_peak = sum(r.at_peak for r in table)
    assert at_peak == table.peak_bytes
    assert table.peak_bytes + table.slack_bytes == result.total_bytes
    assert table["unattributed"].at_peak <= 0.10 * table.peak_bytes
    # wide's kernel (256 x 8192 float32) and bias (8192) split 8 ways.
    assert table["wide"].weights == (256 * 8192 + 8192) * 4 // 8
    assert sum(r.weights for r in table) == result.weight_bytes
    assert sum(r.optimizer for r in table) == result.optimizer_bytes
    assert table["wide"].saved_activations >= 64 * 8192 * 4  # its ReLU output, per device
