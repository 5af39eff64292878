"""Pruning schedules on JAX: tfmot's formulas, evaluated in numpy, at every step.

On TensorFlow `test_pruning_schedules.py` checks the schedules bit for bit against tfmot
itself (in a subprocess); here, without TensorFlow, against the closed forms of
tfmot's schedules: the predicate exactly, the sparsity against the same float32
formula in numpy to 4 float32 epsilons absolute (XLA may contract the
multiply-add into an FMA and rounds `pow` its own way; near sparsity 0 that is
cancellation, so ulps would be the wrong measure) and against float64 (1e-6).
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

from keras_tpu_mem.pruning.schedules import (
    ConstantSparsity,
    PolynomialDecay,
    check_schedule,
)

STEPS = np.arange(0, 2001, dtype=np.int32)

CASES = [
    ConstantSparsity(0.5, begin_step=0),
    ConstantSparsity(0.9, begin_step=37, end_step=1500, frequency=7),
    PolynomialDecay(0.0, 0.8, begin_step=0, end_step=1000),
    PolynomialDecay(0.2, 0.95, begin_step=150, end_step=1750, power=2, frequency=13),
    PolynomialDecay(0.5, 0.1, begin_step=3, end_step=997, power=1.5, frequency=1),
]


def np_should(step, begin, end, frequency):
    in_range = (step >= begin) & ((step <= end) | (end < 0))
    return in_range & (np.mod(step - begin, frequency) == 0)


def np_sparsity(schedule, step, dtype):
    if isinstance(schedule, ConstantSparsity):
        return np.full(step.shape, schedule.target_sparsity, dtype)
    f = dtype.type
    p = np.minimum(f(1), np.maximum(f(0), (step - schedule.begin_step).astype(dtype)
                                    / f(schedule.end_step - schedule.begin_step)))
    return (f(schedule.initial_sparsity - schedule.final_sparsity)
            * np.power(f(1) - p, f(schedule.power)) + f(schedule.final_sparsity))


@pytest.mark.parametrize("schedule", CASES, ids=repr)
def test_schedule_equals_tfmot_formulas_at_every_step_under_jit(schedule):
    should, sparsity = jax.jit(jax.vmap(schedule))(STEPS)
    should, sparsity = np.asarray(should), np.asarray(sparsity)
    assert should.dtype == bool and sparsity.dtype == np.float32
    np.testing.assert_array_equal(
        should, np_should(STEPS, schedule.begin_step, schedule.end_step, schedule.frequency))
    assert should.sum() > 0
    np.testing.assert_allclose(sparsity, np_sparsity(schedule, STEPS, np.dtype("float32")),
                               rtol=0, atol=4 * np.finfo(np.float32).eps)
    np.testing.assert_allclose(sparsity, np_sparsity(schedule, STEPS, np.dtype("float64")),
                               rtol=0, atol=1e-6)


def test_schedule_eager_with_python_ints():
    poly = PolynomialDecay(0.1, 0.9, begin_step=100, end_step=500, power=2, frequency=50)
    for step in (0, 99, 100, 150, 300, 499, 500, 900):
        should, sparsity = poly(step)
        assert bool(should) == (100 <= step <= 500 and (step - 100) % 50 == 0)
        p = min(1.0, max(0.0, (step - 100) / 400))
        assert float(sparsity) == pytest.approx(0.9 + (0.1 - 0.9) * (1 - p) ** 2, abs=1e-6)


def test_check_schedule_accepts_ours_and_keras_ops_callables():
    poly = PolynomialDecay(0.0, 0.5, 0, 100)
    assert check_schedule(poly) is poly

    def every_tenth(step):
        return keras.ops.equal(keras.ops.mod(step, 10), 0), keras.ops.cast(0.5, "float32")

    assert check_schedule(every_tenth) is every_tenth


def test_check_schedule_refuses_bad_returns():
    with pytest.raises(TypeError, match="two scalars"):
        check_schedule(lambda step: (keras.ops.ones((2,), "bool"), keras.ops.ones((2,))))
    with pytest.raises(TypeError, match=r"\(bool, float\)"):
        check_schedule(lambda step: (step, keras.ops.cast(0.5, "float32")))
    with pytest.raises(TypeError, match="should_prune, sparsity"):
        check_schedule(lambda step: 0.5)


def test_tfmot_schedule_objects_are_refused_on_jax_with_the_replacement():
    # A stand-in with tfmot's module name (tfmot itself needs TensorFlow).
    Fake = type("PolynomialDecay", (), {
        "__module__": "tensorflow_model_optimization.python.core.sparsity.keras."
                      "pruning_schedule",
        "__call__": lambda self, step: (True, 0.5)})
    with pytest.raises(TypeError, match="TensorFlow backend only.*ktm.PolynomialDecay"):
        check_schedule(Fake())
