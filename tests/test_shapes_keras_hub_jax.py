"""A model nobody here wrote, built shapes-only (issue 28 item 4): a keras-hub task, whose
`__init__` compiles, and its backbone with `enable_lora`, planned without values, and the
same figures as the model built with them (the compile sees shapes and layouts only);
`fit`, `evaluate` and `predict` of such a task before `materialize` refused naming the task.

keras-hub is installed on CI's JAX-only line (`.ci/run`: `--no-deps` and the packages its
import needs); elsewhere these tests are skipped for want of it."""

from __future__ import annotations

import numpy as np
import pytest

import keras_tpu_mem as ktm

keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed")


def _gemma(lora_rank=None):
    """A two-block Gemma (keras-hub's own classes, a small config, random weights)."""
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=256, num_layers=2, num_query_heads=4, num_key_value_heads=1,
        hidden_dim=64, intermediate_dim=128, head_dim=16)
    task = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    if lora_rank is not None:
        backbone.enable_lora(lora_rank)
    return task


def _batch(rows=2, length=32):
    x = {"token_ids": np.zeros((rows, length), "int32"),
         "padding_mask": np.ones((rows, length), "bool")}
    return x, np.zeros((rows, length), "int32"), np.ones((rows, length), "float32")


@pytest.mark.parametrize("lora_rank", [None, 4], ids=["full", "lora"])
def test_a_keras_hub_task_plans_shapes_only_as_built_with_values(lora_rank):
    with ktm.shapes_only():
        task = _gemma(lora_rank)
    assert ktm.is_shapes_only(task) and task.compiled  # keras-hub compiles in __init__
    planned = ktm.plan(task, 8, device="1GiB", sample_batch=_batch(), by_layer=False)
    reference = ktm.plan(_gemma(lora_rank), 8, device="1GiB", sample_batch=_batch(),
                         by_layer=False)
    assert planned.compiler.startswith("XLA:CPU")
    assert planned.total_bytes == reference.total_bytes
    assert planned.optimizer_bytes == reference.optimizer_bytes
    if lora_rank is not None:
        full = ktm.plan(_gemma(), 8, device="1GiB", sample_batch=_batch(), by_layer=False)
        # Adam's slots only for the adapters.
        assert planned.optimizer_bytes < 0.2 * full.optimizer_bytes


def test_a_materialized_keras_hub_task_trains():
    with ktm.shapes_only():
        task = _gemma()
    ktm.materialize(task)
    assert not ktm.is_shapes_only(task)
    x, y, weights = _batch()
    history = task.fit(x, y, sample_weight=weights, batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])


def test_a_keras_hub_backbone_builds_deferred():
    """Another keras-hub architecture (BERT), a backbone alone (nothing compiled)."""
    with ktm.shapes_only():
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=128, num_layers=2, num_heads=2, hidden_dim=16,
            intermediate_dim=32, max_sequence_length=16)
    assert backbone.variables and ktm.is_shapes_only(backbone)
    ktm.materialize(backbone)
    assert not ktm.is_shapes_only(backbone)


def test_running_a_shapes_only_keras_hub_task_is_refused_naming_the_model():
    with ktm.shapes_only():
        task = _gemma(lora_rank=4)
    x, y, weights = _batch()
    runs = {"fit": lambda: task.fit(x, y, sample_weight=weights, batch_size=2, verbose=0),
            "evaluate": lambda: task.evaluate(x, y, sample_weight=weights, batch_size=2,
                                              verbose=0),
            "predict": lambda: task.predict(x, batch_size=2, verbose=0)}
    for method, run in runs.items():
        # Refused before keras-hub's task runs a layer: the model is named, not a
        # variable deep inside a layer call ("Exception encountered when calling ...").
        with pytest.raises(ValueError) as refused:
            run()
        message = str(refused.value)
        assert message.startswith(f"GemmaCausalLM '{task.name}' was built in ktm.shapes_only()"), \
            (method, message)
        assert f"no values to {method} with" in message and "ktm.materialize(model)" in message
    assert ktm.is_shapes_only(task)
    ktm.materialize(task)  # nothing the refusals did is in the way
    history = task.fit(x, y, sample_weight=weights, batch_size=2, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
