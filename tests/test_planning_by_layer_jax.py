"""`CompiledMemory.by_layer()` where only JAX goes (planning/by_layer.py through
backends/jax/compiled_layers.py): a compile over 8 devices, state split over them, the
rematerialisation lever, and the compat hook that dumps XLA's buffer assignment. What
both backends share is in test_planning_by_layer.py.

References are independent of the attribution: weight and optimizer bytes summed here
from the model's variables, the compiled total from `memory_analysis()`, sizes of
activations by hand.
"""

from __future__ import annotations

import keras
import pytest
from by_layer_cases import check_sums, encoder_layers, floor_model
from planning_models import encoder

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.planning import compiled_memory


def test_compiled_memory_itself_dumps_nothing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled_memory dumped XLA's buffer assignment")

    monkeypatch.setattr(jax_compat, "compile_with_dump", refuse)
    model = floor_model()
    result = compiled_memory(model, 64, hlo_text=False)
    assert result.total_bytes > 0
    with pytest.raises(RuntimeError, match="dumped"):
        result.by_layer()


def test_encoder_rows_per_device():
    model = encoder()
    devices = 8
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
