"""A `fit` whose set-up fails leaves the model as it was (bodies in engine_rollback_cases.py,
the same on both backends)."""

from __future__ import annotations

import engine_rollback_cases as cases


def test_a_later_features_check_failing_rolls_back_mixed_bfloat16():
    cases.check_a_later_features_check_failing_rolls_back_mixed_bfloat16()


def test_the_engines_check_failing_rolls_back_every_feature():
    cases.check_the_engines_check_failing_rolls_back_every_feature()
