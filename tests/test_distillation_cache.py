"""Tests for the cache of teacher logits (keras_tpu_mem.distillation.cache, .directory,
.arrays) on TensorFlow: tf.data datasets and directories, and arrays as a PyDataset.

References: the live teacher's training, the teacher's numpy logits.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

# The backend-neutral tests (the array cache as a PyDataset, the npz format)
# live in the JAX module and run here on TensorFlow.
from test_distillation_cache_jax import (  # noqa: F401  (collected here, on TensorFlow)
    test_array_cache_bad_arguments,
    test_cached_arrays_equal_predict_in_the_input_order,
    test_cached_bare_x_and_sample_weight_keep_their_structure,
    test_cached_batches_keep_their_logits_outside_the_symbolic_build,
    test_cached_top_k_values_and_indices,
    test_fit_on_cached_arrays_needs_no_prepare_student,
    test_npz_round_trip,
    test_npz_round_trip_of_dict_inputs,
)
from test_distillation_callback import (
    BATCH,
    CLASSES,
    _captured_handles,
    batched,
    cached,
    compile_student,
    fit,
    linear,
    make_data,
    teacher_np_logits,
    weights_close,
)
from test_distillation_placement import LayerTakingTeacher, _copy_records, subclassed

import keras_tpu_mem.distillation as dist
from keras_tpu_mem.distillation import (
    Distillation,
    cache_teacher_logits,
    load_teacher_logits,
    prepare_student,
)


# ================================================================ the cache
def digits_models(seed=0):
    keras.utils.set_random_seed(seed)
    teacher = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                keras.layers.Dense(10)])
    student = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                                keras.layers.Dense(10)])
    student.compile(optimizer=keras.optimizers.Adam(1e-2),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return teacher, student


def test_shuffled_cache_trains_like_live_teacher_on_digits(digits):
    """The cache is shuffled after caching (reshuffled every epoch): the logits must
    travel with their examples to reproduce the live teacher's training."""
    (x, y), _ = digits
    x, y = x[:512], y[:512]
    weights = {}
    for source in ("live", "cache", "misaligned"):
        teacher, student = digits_models()
        examples = tf.data.Dataset.from_tensor_slices((x, y))
        if source == "live":
            data, callback = examples, Distillation(teacher, temperature=3.0, alpha=0.7)
        else:
            data = cache_teacher_logits(teacher, examples.batch(100))
            if source == "misaligned":  # control: logits of other examples
                logits = np.stack([e[1][dist.LOGITS_KEY] for e in data.as_numpy_iterator()])
                data = tf.data.Dataset.from_tensor_slices(
                    ((x, y), {dist.LOGITS_KEY: np.roll(logits, 1, axis=0)}))
            callback = Distillation(temperature=3.0, alpha=0.7)
        data = data.shuffle(512, seed=11, reshuffle_each_iteration=True).batch(64)
        fit(student, data, [callback], epochs=2)
        weights[source] = student.get_weights()
    weights_close(weights["cache"], weights["live"], atol=1e-5)
    assert max(np.abs(a - b).max() for a, b in zip(weights["misaligned"], weights["live"])) > 1e-3


def test_saved_top_k_cache_round_trip(tmp_path):
    x, y = make_data()
    teacher = linear(7)
    path = tmp_path / "logits"
    returned = cache_teacher_logits(teacher, batched(x, y, 24), top_k=3, path=path)
    loaded = load_teacher_logits(str(path))
    assert loaded.cardinality().numpy() == len(x)
    t = teacher_np_logits(x)
    order = np.argsort(-t, axis=-1)[:, :3]
    for ds in (returned, loaded):
        elements = list(ds.as_numpy_iterator())
        logits = [e[1] for e in elements]
        np.testing.assert_array_equal(np.stack([e[0][0] for e in elements]), x)
        np.testing.assert_array_equal(np.stack([e[0][1] for e in elements]), y)
        np.testing.assert_array_equal(np.stack([e[dist.TOP_K_INDICES_KEY] for e in logits]), order)
        np.testing.assert_allclose(np.stack([e[dist.TOP_K_VALUES_KEY] for e in logits]),
                                   np.take_along_axis(t, order, -1), rtol=1e-5, atol=1e-5)
    # Training from the loaded top-3 cache equals the live teacher with top_k=3.
    results = []
    for data, callback in ((loaded.batch(BATCH), Distillation(top_k=None)),
                           (batched(x, y), Distillation(teacher, top_k=3))):
        student = compile_student(linear(3))
        fit(student, data, [callback])
        results.append(student.get_weights())
    weights_close(*results, atol=1e-6)


def _variable_handles(model):
    return {id(v.value.handle) for v in model.weights}


def test_cached_train_step_captures_no_teacher_variable():
    x, y = make_data()
    student, teacher = compile_student(linear(3)), linear(7)
    fit(student, batched(x, y), [Distillation(teacher)])
    live = _captured_handles(student)
    # Control: with the live teacher, the step does capture the teacher's variables.
    assert _variable_handles(teacher) <= live
    student = compile_student(linear(3))
    fit(student, cached(teacher, x, y), [Distillation()])
    captured = _captured_handles(student)
    assert _variable_handles(student) <= captured
    assert not _variable_handles(teacher) & captured


def test_cache_under_a_scope_copies_a_teacher_from_elsewhere(mirrored, ktm_records):
    """cache_teacher_logits inside strategy.scope() with a teacher made outside it runs a
    copy under that strategy (logged); the logits equal numpy; no copy where none is needed."""
    x, y = make_data()
    teacher = linear(7)
    with mirrored.strategy.scope():
        data = cache_teacher_logits(teacher, batched(x, y, 24))
        inside = linear(7)
        cache_teacher_logits(inside, batched(x, y, 24))
    cache_teacher_logits(teacher, batched(x, y, 24))  # no scope: the teacher's own strategy
    copies = _copy_records(ktm_records, "cache_teacher_logits")
    assert len(copies) == 1 and "MirroredStrategy" in copies[0].getMessage()
    logits = np.stack([e[1][dist.LOGITS_KEY] for e in data.as_numpy_iterator()])
    np.testing.assert_allclose(logits, teacher_np_logits(x), rtol=1e-5, atol=1e-5)
    uncloneable = subclassed(LayerTakingTeacher(keras.layers.Dense(CLASSES)))
    with mirrored.strategy.scope():
        with pytest.raises(ValueError, match="could not be copied.*outside the strategy scope"):
            cache_teacher_logits(uncloneable, batched(x, y, 24))


def test_bad_cache_arguments(tmp_path):
    x, y = make_data()
    teacher = linear(7)
    with pytest.raises(TypeError, match="tf.data.Dataset or arrays"):
        cache_teacher_logits(teacher, ("not", "arrays"))
    with pytest.raises(ValueError, match="infinite"):
        cache_teacher_logits(teacher, batched(x, y).repeat())
    with pytest.raises(ValueError, match="larger than the number of classes"):
        cache_teacher_logits(teacher, batched(x, y), top_k=CLASSES + 1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        cache_teacher_logits(teacher, batched(x, y), path=tmp_path / "taken")
    with pytest.raises(ValueError, match="no teacher-logit cache"):
        load_teacher_logits(tmp_path / "taken")
    with pytest.raises(ValueError, match="carries no cached teacher logits|cached teacher logits"):
        prepare_student(compile_student(linear(3)), batched(x, y))


@pytest.mark.parametrize("top_k", [None, CLASSES])
def test_array_cache_pydataset_trains_like_the_live_teacher(tmp_path, top_k):
    """Arrays in, PyDataset out, fed to fit as returned (and after an npz round trip)."""
    x, y = make_data()
    teacher = linear(7)
    live = compile_student(linear(3))
    fit(live, batched(x, y), [Distillation(teacher, temperature=2.0, alpha=0.7)])
    path = tmp_path / "logits.npz"
    cached = cache_teacher_logits(teacher, (x, y), batch_size=BATCH, top_k=top_k, path=path)
    for data in (cached, load_teacher_logits(path)):
        student = compile_student(linear(3))
        fit(student, data, [Distillation(temperature=2.0, alpha=0.7)])
        weights_close(student.get_weights(), live.get_weights())
