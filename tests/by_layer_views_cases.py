"""Cases shared by test_planning_by_layer_text.py (TensorFlow) and its JAX twin: the
memory by layer in `MemoryPlan` (issue 22, item 2). Imports Keras and the package only.

References are independent of the plan: the recommendation's callbacks compiled again
by `compiled_memory`, a micro-batch's activations against the whole batch's (linear
in the batch), weight bytes by hand.
"""

from __future__ import annotations

import re

from planning_models import wide_mlp

import keras_tpu_mem as ktm
from keras_tpu_mem import backends
from keras_tpu_mem.devices import format_bytes
from keras_tpu_mem.planning import compiled_memory, plan
from keras_tpu_mem.planning.by_layer import LayerTable

MIB = 1024**2
BATCH = 1024


def small_model():
    # 128 inputs -> 2 x Dense(256, relu) -> Dense(10): compiles in about a second.
    return wide_mlp(width=256, depth=2, inputs=128)


def budget_for(model) -> str:
    """A capacity the plain step does not fit (60% of its compiled total)."""
    plain = compiled_memory(model, BATCH, hlo_text=False)
    return f"{plain.total_bytes * 0.6 / MIB:.4f}MiB"


def rows_in(text: str) -> dict:
    """`{name: [weights, optimizer, saved act., at peak]}` from a table's text lines."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\s*(\S+)\s+((?:[\d.]+ (?:B|KiB|MiB|GiB)\s*){4})$", line)
        if match:
            rows[match.group(1)] = re.findall(r"[\d.]+ (?:B|KiB|MiB|GiB)", match.group(2))
    return rows


def count_dump_compiles(monkeypatch) -> list:
    """Counts the by-layer compiles (each one reads its rows once)."""
    layers = backends.current().compiled_layers
    calls = []
    original = layers.layer_rows

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(layers, "layer_rows", counted)
    return calls


def check_search_reports_the_recommendations_table(monkeypatch):
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


def check_callbacks_plan_reports_the_planned_step(monkeypatch):
    model = small_model()
    calls = count_dump_compiles(monkeypatch)
    planned = plan(model, BATCH, device="1GiB", callbacks=[ktm.GradientAccumulation(2)])
    assert len(calls) == 1
    assert planned.by_layer_of.startswith("the planned step")
    check = compiled_memory(model, BATCH, callbacks=[ktm.GradientAccumulation(2)],
                            hlo_text=False)
    assert abs(planned.by_layer.total_bytes - check.total_bytes) <= 0.01 * check.total_bytes
    assert "memory by layer of the planned step" in str(planned)


def check_a_table_that_fails_is_a_note(monkeypatch):
    layers = backends.current().compiled_layers

    def broken(*args, **kwargs):
        raise RuntimeError("no dump here")

    monkeypatch.setattr(layers, "layer_rows", broken)
    planned = plan(small_model(), BATCH, device="1GiB", callbacks=[])
    assert planned.by_layer is None
    text = str(planned)
    assert "memory by layer could not be computed (RuntimeError: no dump here)." in text
    assert "memory by layer of" not in text


_UNITS = {"B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}


def to_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


def check_oom_message_shows_the_failing_steps_rows(error):
    """The message's five rows are of the step that failed (the whole batch), not of the
    recommendation (a micro-batch of it): its largest saver keeps more than there (k
    times as much on JAX; TensorFlow's micro-batch loop keeps about twice a
    micro-batch's activations, so only "clearly more" is asserted)."""
    message = str(error)
    assert "Memory by layer of the step that failed" in message
    shown = rows_in(message.split("Smallest change")[0])
    assert len(shown) == 5
    rec = error.plan.recommendation
    k = rec.accumulation_steps
    assert k > 1 and error.plan.by_layer is not None
    name = max(shown, key=lambda n: to_bytes(shown[n][2]))
    failing = to_bytes(shown[name][2])
    micro = error.plan.by_layer[name].saved_activations
    assert failing >= 1.5 * micro, (name, micro, k, failing)
    # Beside the smallest change that fits.
    assert message.index("Memory by layer of") < message.index("Smallest change that fits")


def check_oom_raises_when_the_table_fails(monkeypatch, fit_failing):
    """`fit_failing()` runs a fit whose step raises RESOURCE_EXHAUSTED and returns the
    `StepOutOfMemoryError`; with the by-layer compile broken the error still comes,
    with one line saying so."""
    def broken(*args, **kwargs):
        raise RuntimeError("no dump here")

    monkeypatch.setattr(backends.current().compiled_layers, "layer_rows", broken)
    error = fit_failing()
    message = str(error)
    lines = [line for line in message.splitlines() if "by layer" in line.lower()]
    assert lines == ["Memory by layer could not be computed (RuntimeError: no dump here)."]
    assert "compiled total" in message  # the breakdown is still there


def check_by_layer_false_skips_the_compile(monkeypatch):
    import pytest

    model = small_model()
    calls = count_dump_compiles(monkeypatch)
    planned = plan(model, BATCH, device="1GiB", callbacks=[], by_layer=False)
    assert planned.by_layer is None and not calls
    assert "memory by layer" not in str(planned)
    with pytest.raises(TypeError, match="`by_layer`"):
        plan(model, BATCH, device="1GiB", callbacks=[], by_layer="yes")
