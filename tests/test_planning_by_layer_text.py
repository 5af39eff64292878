"""The memory by layer in `MemoryPlan` on TensorFlow (planning/by_layer_text.py, issue 22
item 2); the cases are shared with the JAX twin (by_layer_views_cases.py)."""

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


def test_an_estimate_has_no_table(monkeypatch):
    calls = cases.count_dump_compiles(monkeypatch)
    planned = plan(cases.small_model(), cases.BATCH, device="1GiB")
    assert planned.by_layer is None and not calls
    assert "memory by layer" not in str(planned)


def test_by_layer_false_skips_the_compile(monkeypatch):
    cases.check_by_layer_false_skips_the_compile(monkeypatch)
