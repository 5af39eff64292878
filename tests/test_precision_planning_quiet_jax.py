"""MixedBFloat16's plan line while planning, on JAX: `test_precision_planning_quiet.py`
holds the backend-neutral test; importing it here collects it on the JAX backend."""

from __future__ import annotations

from test_precision_planning_quiet import (  # noqa: F401  (collected here, on JAX)
    test_mixed_bfloat16_logs_its_plan_in_fit_not_while_planning,
)
