"""Tests for keras_tpu_mem.distillation.placement on TensorFlow: a teacher whose
variables live outside the student's strategy runs as a frozen copy made under it.

References: the same teacher made under the scope, the numpy reference of
test_distillation_callback.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_distillation_callback import (
    CLASSES,
    FEATURES,
    _captured_handles,
    batched,
    compile_student,
    count_traces,
    fit,
    linear,
    make_data,
    np_train,
    reference,
    teacher_np_logits,
    weights_close,
)

from keras_tpu_mem.distillation import (
    Distillation,
)


# ================================================================ a teacher from anywhere
def _replica_handles(model):
    """ids of the resource handles of the model's variables, one per replica copy."""
    handles = set()
    for variable in model.weights:
        value = variable.value
        parts = value.values if isinstance(value, tf.distribute.DistributedValues) else (value,)
        handles.update(id(part.handle) for part in parts)
    return handles


def _copy_records(records, who="Distillation"):
    return [r for r in records if r.getMessage().startswith(f"{who}: copied the teacher")]


def trained_teacher():
    """linear(7) trained a few SGD steps on the default strategy (its own data and labels)."""
    teacher = compile_student(linear(7))
    rng = np.random.default_rng(12)
    x = rng.normal(size=(64, FEATURES)).astype("float32")
    fit(teacher, batched(x, rng.integers(0, CLASSES, 64).astype("int32")), [])
    assert not np.allclose(teacher.get_weights()[0], linear(7).get_weights()[0])
    return teacher


def distil_under(strategy, teacher, x, y, callback=None, epochs=1):
    callback = callback or Distillation(teacher, temperature=2.0, alpha=0.3)
    with strategy.scope():
        student = compile_student(linear(3))
    history = fit(student, batched(x, y), [callback], epochs=epochs)
    return student, callback, history.history["loss"]


def test_teacher_trained_on_the_default_strategy_distils_like_one_under_the_scope(
        mirrored, ktm_records):
    """Floor: under MirroredStrategy(2), a teacher trained on the default strategy gives the
    loss and weights (1e-5) of the same teacher made under the student's scope, and of the
    float64 numpy reference; the first runs as a mirrored copy, the second as is."""
    x, y = make_data()
    outside = trained_teacher()
    before = [w.copy() for w in outside.get_weights()]
    with mirrored.strategy.scope():
        inside = linear(7)
        inside.set_weights(before)
    results = {}
    for name, teacher in (("outside", outside), ("inside", inside)):
        student, callback, loss = distil_under(mirrored.strategy, teacher, x, y)
        results[name] = (student.get_weights(), loss[0], callback, student)
    w_t, b_t = before
    ref_w, ref_b, ref_loss = np_train(*linear(3).get_weights(), x, y,
                                      np.float64(x) @ w_t + b_t, temperature=2.0, alpha=0.3)
    for name in results:
        weights_close(results[name][0], [ref_w, ref_b])
        np.testing.assert_allclose(results[name][1], ref_loss, rtol=1e-5)
    weights_close(results["outside"][0], results["inside"][0])
    np.testing.assert_allclose(results["outside"][1], results["inside"][1], rtol=1e-5)

    # The teacher under the scope runs as is: its own variables, on every replica.
    _, _, callback, student = results["inside"]
    assert callback.step_teacher is inside and callback.teacher is inside
    assert all(a is b for a, b in zip(callback.step_teacher.weights, inside.weights))
    assert _replica_handles(inside) <= _captured_handles(student)
    # The other runs as a frozen mirrored copy with its weights; the user's model is unchanged.
    _, _, callback, student = results["outside"]
    copy = callback.step_teacher
    assert callback.teacher is outside and copy is not outside and not copy.trainable
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in copy.weights)
    assert not {id(v) for v in copy.weights} & {id(v) for v in outside.weights}
    for mine, theirs in zip(copy.get_weights(), before):
        np.testing.assert_array_equal(mine, theirs)  # assigned, not recomputed: exact
    captured = _captured_handles(student)
    assert _replica_handles(copy) <= captured and not _replica_handles(outside) & captured
    for old, new in zip(before, outside.get_weights()):
        np.testing.assert_array_equal(old, new)
    copies = _copy_records(ktm_records)
    assert len(copies) == 1 and copies[0].levelname == "INFO"
    message = copies[0].getMessage()
    assert repr(outside.name) in message and "MirroredStrategy (2 replica(s))" in message


def test_teacher_copy_is_made_once_and_takes_the_teachers_current_weights(mirrored,
                                                                          ktm_records):
    """Two fits with one callback: one clone, one log line, one trace; the second fit
    distils the teacher's weights as they are then (numpy reference, epoch by epoch)."""
    x, y = make_data()
    teacher = linear(7)
    callback = Distillation(teacher, temperature=2.0, alpha=0.3)
    traces = count_traces(callback)
    with mirrored.strategy.scope():
        student = compile_student(linear(3))
    fit(student, batched(x, y), [callback])
    copy, variables = callback.step_teacher, list(callback.step_teacher.weights)
    traced = len(traces)  # MirroredStrategy traces the replica function once per replica
    changed = linear(11).get_weights()
    teacher.set_weights(changed)  # e.g. the teacher was trained further
    fit(student, batched(x, y), [callback])
    assert callback.step_teacher is copy
    assert all(a is b for a, b in zip(copy.weights, variables))
    assert len(_copy_records(ktm_records)) == 1
    assert len(traces) == traced  # the engine reused the step traced with the copy
    w, b, _ = np_train(*linear(3).get_weights(), x, y, teacher_np_logits(x), temperature=2.0,
                       alpha=0.3)
    w, b, _ = np_train(w, b, x, y, teacher_np_logits(x, seed=11), temperature=2.0, alpha=0.3)
    weights_close(student.get_weights(), [w, b])


def test_teacher_under_a_strategy_is_copied_for_a_default_strategy_student(mirrored,
                                                                           ktm_records):
    """The other direction: a mirrored teacher with a plain student gets a plain copy."""
    x, y = make_data()
    with mirrored.strategy.scope():
        teacher = linear(7)
    student, callback, loss = distil_under(tf.distribute.get_strategy(), teacher, x, y)
    assert not any(isinstance(v.value, tf.distribute.DistributedValues)
                   for v in callback.step_teacher.weights)
    ref_w, ref_b, ref_loss = reference(x, y)
    weights_close(student.get_weights(), [ref_w, ref_b])
    np.testing.assert_allclose(loss[0], ref_loss, rtol=1e-5)
    assert len(_copy_records(ktm_records)) == 1


class ConfigurableTeacher(keras.Model):
    """Subclassed, with constructor arguments that get_config can describe."""

    def __init__(self, units=CLASSES, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.head = keras.layers.Dense(units)

    def call(self, x):
        return self.head(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class LayerTakingTeacher(keras.Model):
    """Subclassed, built from a layer object: clone_model cannot rebuild it."""

    def __init__(self, layer):
        super().__init__()
        self.head = layer

    def call(self, x):
        return self.head(x)


def subclassed(model):
    model(np.zeros((2, FEATURES), "float32"))
    model.set_weights(linear(7).get_weights())
    return model


def test_subclassed_teacher_is_copied_through_its_config_or_refused(mirrored):
    x, y = make_data()
    student, callback, loss = distil_under(mirrored.strategy, subclassed(ConfigurableTeacher()),
                                           x, y)
    assert isinstance(callback.step_teacher, ConfigurableTeacher)
    ref_w, ref_b, ref_loss = reference(x, y)
    weights_close(student.get_weights(), [ref_w, ref_b])
    np.testing.assert_allclose(loss[0], ref_loss, rtol=1e-5)
    # No silent fallback to the teacher's own variables: a clear error.
    teacher = subclassed(LayerTakingTeacher(keras.layers.Dense(CLASSES)))
    with pytest.raises(ValueError, match=r"could not be copied.*clone_model failed"
                                         r".*NotImplementedError.*strategy\.scope\(\)"):
        distil_under(mirrored.strategy, teacher, x, y)
