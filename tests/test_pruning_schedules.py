"""Pruning schedules on TensorFlow: against tfmot itself, bit for bit, and by hand.

tfmot is only ever imported in a subprocess (`tfmot_reference`): importing it
sets TF_USE_LEGACY_KERAS=1 and turns `tf.keras` into tf_keras for the whole
process. The same subprocess also checks the masks against tfmot's
`pruning_impl` and a fit with a tfmot schedule object.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import pytest
import tensorflow as tf
from test_pruning_callback import _expected_zeros, _poly

from keras_tpu_mem.pruning import ConstantSparsity, PolynomialDecay
from keras_tpu_mem.pruning.schedules import PruningSchedule, pruning_turn

# ------------------------------------------------------- tfmot (subprocess)

_TFMOT_SCRIPT = textwrap.dedent('''
    import json, os
    import numpy as np
    import tensorflow as tf
    import keras
    from keras_tpu_mem import pruning as ours
    import tensorflow_model_optimization as tfmot  # sets TF_USE_LEGACY_KERAS=1
    from tensorflow_model_optimization.python.core.sparsity.keras import pruning_impl

    S = tfmot.sparsity.keras
    out = {"schedules": [], "masks": []}
    CASES = [
        ("ConstantSparsity", dict(target_sparsity=0.5, begin_step=0)),
        ("ConstantSparsity", dict(target_sparsity=0.9, begin_step=37, end_step=1500,
                                  frequency=7)),
        ("PolynomialDecay", dict(initial_sparsity=0.0, final_sparsity=0.8, begin_step=0,
                                 end_step=1000)),
        ("PolynomialDecay", dict(initial_sparsity=0.2, final_sparsity=0.95, begin_step=150,
                                 end_step=1750, power=2, frequency=13)),
        ("PolynomialDecay", dict(initial_sparsity=0.5, final_sparsity=0.1, begin_step=3,
                                 end_step=997, power=1.5, frequency=1)),
    ]
    steps = tf.range(0, 2001, dtype=tf.int64)

    @tf.function
    def evaluate(schedule):
        # One scalar call per step (tf.map_fn), as during training.
        return tf.map_fn(schedule, steps, fn_output_signature=(tf.bool, tf.float32))

    for name, kwargs in CASES:
        ref, mine = getattr(S, name)(**kwargs), getattr(ours, name)(**kwargs)
        (rs, rv), (ms, mv) = evaluate(ref), evaluate(mine)
        rs, rv, ms, mv = rs.numpy(), rv.numpy(), ms.numpy(), mv.numpy()
        bad = np.flatnonzero((rs != ms) | (rv.view(np.int32) != mv.view(np.int32)))
        mismatches = [[int(i), bool(rs[i]), bool(ms[i]), float(rv[i]), float(mv[i])]
                      for i in bad[:5]]
        # And eagerly, one step at a time, at a sample of steps.
        for step in range(0, 2001, 97):
            t = tf.constant(step, tf.int64)
            (es, ev), (fs, fv) = ref(t), mine(t)
            if bool(es) != bool(fs) or np.float32(ev) != np.float32(fv):
                mismatches.append([step, bool(es), bool(fs), float(ev), float(fv)])
        out["schedules"].append({"name": name, "mismatches": mismatches,
                                 "pruning_steps": int(rs.sum()),
                                 "distinct_sparsities": len(set(rv[rs].tolist()))})

    rng = np.random.default_rng(0)
    for shape, block, pooling, m_by_n, sparsity in [
        ((64, 32), (1, 1), "AVG", None, 0.7),
        ((64, 32), (2, 2), "AVG", None, 0.6),
        ((64, 32), (4, 1), "MAX", None, 0.5),
        ((48, 40), (1, 8), "AVG", None, 0.75),
        ((64, 32), (1, 1), "AVG", (2, 4), 0.5),
        ((3, 3, 16, 8), (1, 1), "AVG", (2, 4), 0.5),
        ((64, 10), (1, 1), "AVG", (1, 4), 0.25),
    ]:
        w = tf.constant(rng.standard_normal(shape).astype("float32"))
        impl = pruning_impl.Pruning(lambda: tf.constant(1, tf.int64), [],
                                    S.ConstantSparsity(sparsity, 0), block, pooling,
                                    sparsity_m_by_n=m_by_n)
        ref_mask = impl._maybe_update_block_mask(w)[1].numpy() > 0
        if m_by_n:
            mask = ours.m_by_n_mask(w, m_by_n, len(shape) - 2)
        elif block != (1, 1):
            mask = ours.block_mask(w, tf.constant(sparsity), block, pooling)[0]
        else:
            mask = ours.magnitude_mask(tf.abs(w), tf.constant(sparsity))[0]
        mask = mask.numpy()
        out["masks"].append({"case": [shape, block, pooling, m_by_n],
                             "differ": int(np.sum(mask != ref_mask)),
                             "kept": int(mask.sum())})

    # A tfmot schedule object passed as is to ktm.Pruning (duck-typed), and its
    # config mapped onto ours.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
    model.compile("adam", "mse")
    schedule = S.PolynomialDecay(0.0, 0.6, begin_step=0, end_step=8, frequency=4)
    x = np.random.default_rng(1).normal(size=(64, 8)).astype("float32")
    model.fit(x, x[:, :2], batch_size=8, epochs=1, verbose=0,
              callbacks=[ours.Pruning(schedule)])
    out["fit_zeros"] = [int(np.sum(layer.kernel.numpy() == 0)) for layer in model.layers]
    out["config"] = ours.Pruning(schedule).get_config()["schedule"]
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def tfmot_reference():
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_USE_LEGACY_KERAS", None)
    proc = subprocess.run([sys.executable, "-c", _TFMOT_SCRIPT], capture_output=True,
                          text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_schedules_match_tfmot_at_every_step(tfmot_reference):
    schedules = tfmot_reference["schedules"]
    assert len(schedules) == 5
    for entry in schedules:
        assert entry["mismatches"] == [], entry
        assert entry["pruning_steps"] > 0  # the comparison covered pruning steps


def test_masks_match_tfmot(tfmot_reference):
    for entry in tfmot_reference["masks"]:
        assert entry["differ"] == 0, entry
        assert 0 < entry["kept"]


def test_tfmot_schedule_object_is_accepted(tfmot_reference):
    # PolynomialDecay(0, 0.6, 0, 8, frequency=4): steps 4 and 8 prune, 8 at 0.6.
    assert tfmot_reference["fit_zeros"] == [_expected_zeros(8 * 16, 0.6),
                                            _expected_zeros(16 * 2, 0.6)]
    config = tfmot_reference["config"]
    assert config["class_name"] == "PolynomialDecay"
    assert config["config"]["final_sparsity"] == 0.6


# ----------------------------------------------------------- schedules


def test_schedule_values_by_hand():
    poly = PolynomialDecay(0.1, 0.9, begin_step=100, end_step=500, power=2, frequency=50)
    for step in (0, 99, 100, 150, 300, 499, 500, 900):
        should, sparsity = poly(tf.constant(step, tf.int64))
        assert bool(should) == (100 <= step <= 500 and (step - 100) % 50 == 0)
        assert float(sparsity) == pytest.approx(_poly(step, 0.1, 0.9, 100, 500, 2), abs=1e-6)
    const = ConstantSparsity(0.3, begin_step=10, end_step=-1, frequency=5)
    assert [bool(const(s)[0]) for s in (9, 10, 12, 15, 10**6)] == [False, True, False, True,
                                                                    True]
    assert float(const(3)[1]) == pytest.approx(0.3)


@pytest.mark.parametrize("make, match", [
    (lambda: ConstantSparsity(1.0, 0), "target_sparsity"),
    (lambda: ConstantSparsity(-0.1, 0), "target_sparsity"),
    (lambda: ConstantSparsity(0.5, -1), "begin_step"),
    (lambda: ConstantSparsity(0.5, 10, end_step=5), "end_step"),
    (lambda: ConstantSparsity(0.5, 0, end_step=-2), "end_step"),
    (lambda: ConstantSparsity(0.5, 0, frequency=0), "frequency"),
    (lambda: ConstantSparsity(0.5, 0, frequency=2.5), "frequency"),
    (lambda: ConstantSparsity("0.5", 0), "target_sparsity"),
    (lambda: PolynomialDecay(0.0, 1.0, 0, 100), "final_sparsity"),
    (lambda: PolynomialDecay(1.5, 0.5, 0, 100), "initial_sparsity"),
    (lambda: PolynomialDecay(0.0, 0.5, 100, 50), "end_step"),
    (lambda: PolynomialDecay(0.0, 0.5, 100, 100), "end_step"),
    (lambda: PolynomialDecay(0.0, 0.5, 0, -1), "end_step"),
    (lambda: PolynomialDecay(0.0, 0.5, 0, 100, power=0), "power"),
    (lambda: PolynomialDecay(0.0, 0.5, 0, 100, frequency=-3), "frequency"),
])
def test_schedule_bad_arguments(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_schedule_serialises():
    poly = PolynomialDecay(0.0, 0.8, begin_step=0, end_step=1000, power=2, frequency=10)
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(poly))
    assert restored == poly and restored is not poly


@pytest.mark.parametrize("schedule", [
    ConstantSparsity(0.5, begin_step=0, frequency=1),
    ConstantSparsity(0.5, begin_step=3, end_step=20, frequency=4),
    PolynomialDecay(0.0, 0.8, begin_step=0, end_step=30, frequency=7),
    PolynomialDecay(0.2, 0.8, begin_step=5, end_step=26, frequency=3),
], ids=repr)
def test_pruning_turn_is_the_schedules_should_prune(schedule):
    """The host's `pruning_turn` (what the JAX engine's quiet step is chosen by) agrees
    with the schedule's own `should_prune` at every step."""
    for step in range(0, 45):
        assert pruning_turn(schedule, step) is bool(schedule(step)[0]), step


def test_pruning_turn_of_a_schedule_it_does_not_know_is_none():
    class EveryOtherStep(PruningSchedule):
        def __call__(self, step):
            return keras.ops.equal(keras.ops.mod(step, 2), 0), 0.5

    assert pruning_turn(EveryOtherStep(), 4) is None
