"""The memory by layer in `MemoryPlan` (planning/by_layer_text.py, issue 22 item 2), one
body per behaviour on both backends (conftest's BOTH_BACKENDS).

References are independent of the plan: the recommendation's callbacks compiled again
by `compiled_memory`, a micro-batch's activations against the whole batch's (linear
in the batch), weight bytes by hand.
"""

from __future__ import annotations

import pytest
from by_layer_views_cases import (
    BATCH,
    break_layer_rows,
    budget_for,
    count_dump_compiles,
    rows_in,
    small_model,
)
from conftest import BACKEND

import keras_tpu_mem as ktm
from keras_tpu_mem import backends
from keras_tpu_mem.devices import format_bytes
from keras_tpu_mem.planning import compiled_memory, plan
from keras_tpu_mem.planning.by_layer import LayerTable


@pytest.mark.slow
def test_search_reports_the_recommendations_table(monkeypatch):
    model = small_model()
    device = budget_for(model)
    calls = count_dump_compiles(monkeypatch)
    planned = plan(model, BATCH, device=device, search=True)
    rec = planned.recommendation
    assert rec is not None and rec.accumulation_steps > 1 and len(planned.candidates) > 2
    # One by-layer compile for the plan's table, not one per candidate; where the
    # backend has the rematerialisation lever (JAX), one more: the targeted lever
    # ranks the layers from the table of the search's first compile.
    targeted = 1 if backends.current("plan").compiled.rematerialize_lever() else 0
    assert len(calls) == 1 + targeted
    table = planned.by_layer
    assert isinstance(table, LayerTable)
    assert "the recommendation" in planned.by_layer_of and rec.describe() in planned.by_layer_of
    # The recommendation's step, compiled again from its callbacks: the same total.
    check = compiled_memory(model, BATCH, callbacks=rec.callbacks(), hlo_text=False)
    assert abs(table.total_bytes - check.total_bytes) <= 0.01 * check.total_bytes
    # A micro-batch of BATCH / k: the widest layer saves about 1/k of what the plain
    # step's does (activations are linear in the batch).
    plain = compiled_memory(model, BATCH, hlo_text=False).by_layer()
    k = rec.accumulation_steps
    saved, whole = table["dense_1"].saved_activations, plain["dense_1"].saved_activations
    assert abs(saved * k - whole) <= 0.1 * whole, (saved, whole, k)
    # The text shows the five largest rows at the peak, and says where the rest are.
    text = str(planned)
    assert "memory by layer of the recommendation" in text and "plan.by_layer" in text
    shown = rows_in(text)
    assert list(shown) == [r.name for r in table.top(5)]
    for row in table.top(5):
        assert shown[row.name][3] == format_bytes(row.at_peak)
    # The weights column by hand: Dense(128 -> 256) kernel and bias, float32.
    assert table["dense_0"].weights == (128 * 256 + 256) * 4


def test_callbacks_plan_reports_the_planned_step(monkeypatch):
    model = small_model()
    calls = count_dump_compiles(monkeypatch)
    planned = plan(model, BATCH, device="1GiB", callbacks=[ktm.GradientAccumulation(2)])
    assert len(calls) == 1
    assert planned.by_layer_of.startswith("the planned step")
    check = compiled_memory(model, BATCH, callbacks=[ktm.GradientAccumulation(2)],
                            hlo_text=False)
    assert abs(planned.by_layer.total_bytes - check.total_bytes) <= 0.01 * check.total_bytes
    assert "memory by layer of the planned step" in str(planned)


def test_a_table_that_fails_is_a_note(monkeypatch):
    break_layer_rows(monkeypatch)
    planned = plan(small_model(), BATCH, device="1GiB", callbacks=[])
    assert planned.by_layer is None
    text = str(planned)
    assert "memory by layer could not be computed (RuntimeError: no dump here)." in text
    assert "memory by layer of" not in text


def test_the_plainest_plan_has_a_table_only_of_a_step_it_compiled(monkeypatch):
    calls = count_dump_compiles(monkeypatch)
    planned = plan(small_model(), BATCH, device="1GiB")
    # TensorFlow's plainest plan extrapolates from compiles of Keras' own step at 32 and
    # 64 rows; JAX's compiles the engine's step at the batch itself.
    assert planned.extrapolated == (BACKEND == "tensorflow")
    if planned.extrapolated:
        assert planned.by_layer is None and not calls
        assert "memory by layer" not in str(planned)
    else:
        assert len(calls) == 1 and planned.by_layer is not None
        assert planned.by_layer_of.startswith("the planned step")


def test_by_layer_false_skips_the_compile(monkeypatch):
    model = small_model()
    calls = count_dump_compiles(monkeypatch)
    planned = plan(model, BATCH, device="1GiB", callbacks=[], by_layer=False)
    assert planned.by_layer is None and not calls
    assert "memory by layer" not in str(planned)
    with pytest.raises(TypeError, match="`by_layer`"):
        plan(model, BATCH, device="1GiB", callbacks=[], by_layer="yes")
