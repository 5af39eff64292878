"""The memory by layer in `MemoryPlan` on JAX (planning/by_layer_text.py, issue 22 item 2);
the cases are shared with the TensorFlow twin (by_layer_views_cases.py)."""

from __future__ import annotations

import by_layer_views_cases as cases
import pytest

from keras_tpu_mem.planning import plan


@pytest.mark.slow
def test_search_reports_the_recommendations_table(monkeypatch):
    cases.check_search_reports_the_recommendations_table(monkeypatch)


def test_callbacks_plan_reports_the_planned_step(monkeypatch):
    cases.check_callbacks_plan_reports_the_planned_step(monkeypatch)


def test_a_table_that_fails_is_a_note(monkeypatch):
    cases.check_a_table_that_fails_is_a_note(monkeypatch)


def test_the_plainest_plan_compiles_and_has_a_table(monkeypatch):
    # No estimate on JAX: the plan compiles the step, so it has the table.
    calls = cases.count_dump_compiles(monkeypatch)
    planned = plan(cases.small_model(), cases.BATCH, device="1GiB")
    assert len(calls) == 1 and planned.by_layer is not None
    assert planned.by_layer_of.startswith("the planned step")


def test_by_layer_false_skips_the_compile(monkeypatch):
    cases.check_by_layer_false_skips_the_compile(monkeypatch)
