"""The array cache of teacher logits (keras_tpu_mem.distillation.arrays, .npz,
.teacher_logits), on the active backend.

Backend-neutral tests: this module runs on JAX; `test_distillation_cache.py`
imports its tests to run the same logic on TensorFlow (it imports neither
framework at the top). References: the teacher's own `predict`, numpy sorting
for top-k.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_tpu_mem.distillation import (
    LOGITS_KEY,
    TOP_K_INDICES_KEY,
    TOP_K_VALUES_KEY,
    TeacherLogits,
    cache_teacher_logits,
    load_teacher_logits,
)

CLASSES = 7


# ------------------------------------------------------------ array cache
def _teacher(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(CLASSES)])


def _data(n=100, seed=2):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 5)).astype("float32"),
            rng.integers(0, CLASSES, n).astype("int32"),
            rng.uniform(size=n).astype("float32"))


def _concat_batches(cached, part=None):
    """All batches of a TeacherLogits joined: (data leaves, logits dict)."""
    datas, logits = zip(*(cached[i] for i in range(len(cached))))
    joined = {k: np.concatenate([b[k] for b in logits]) for k in logits[0]}
    return datas, joined


def test_cached_arrays_equal_predict_in_the_input_order():
    teacher = _teacher()
    x, y, _ = _data()
    cached = cache_teacher_logits(teacher, (x, y), batch_size=32)
    assert isinstance(cached, TeacherLogits) and isinstance(cached, keras.utils.PyDataset)
    assert len(cached) == 4 and cached.num_examples == 100 and cached.top_k is None
    datas, logits = _concat_batches(cached)
    assert [len(d[0]) for d in datas] == [32, 32, 32, 4]
    np.testing.assert_array_equal(np.concatenate([d[0] for d in datas]), x)
    np.testing.assert_array_equal(np.concatenate([d[1] for d in datas]), y)
    assert set(logits) == {LOGITS_KEY} and logits[LOGITS_KEY].dtype == np.float32
    np.testing.assert_allclose(logits[LOGITS_KEY], teacher.predict(x, verbose=0), rtol=0,
                               atol=1e-6)
    # The element structure Distillation reads: (data, {key: logits}).
    (bx, by), extras = cached[1]
    np.testing.assert_array_equal(bx, x[32:64])
    np.testing.assert_allclose(extras[LOGITS_KEY], logits[LOGITS_KEY][32:64])


def test_cached_bare_x_and_sample_weight_keep_their_structure():
    teacher = _teacher()
    x, y, sw = _data(40)
    bare = cache_teacher_logits(teacher, x, batch_size=16)
    data, _ = bare[0]
    assert isinstance(data, np.ndarray) and data.shape == (16, 5)
    weighted = cache_teacher_logits(teacher, (x, y, sw), batch_size=16)
    (bx, by, bsw), _ = weighted[2]
    np.testing.assert_array_equal(bsw, sw[32:])


def test_cached_top_k_values_and_indices():
    teacher = _teacher()
    x, y, _ = _data()
    full = teacher.predict(x, verbose=0)
    cached = cache_teacher_logits(teacher, (x, y), batch_size=32, top_k=3)
    assert cached.top_k == 3
    _, extras = _concat_batches(cached)
    values, indices = extras[TOP_K_VALUES_KEY], extras[TOP_K_INDICES_KEY]
    assert values.shape == (100, 3) and indices.dtype == np.int32
    np.testing.assert_array_equal(indices, np.argsort(-full, axis=-1, kind="stable")[:, :3])
    np.testing.assert_allclose(values, np.take_along_axis(full, indices, -1), atol=1e-6)
    assert np.all(np.diff(values, axis=-1) <= 0)


@pytest.mark.parametrize("top_k", [None, 2])
def test_npz_round_trip(tmp_path, top_k):
    teacher = _teacher()
    x, y, sw = _data(50)
    path = tmp_path / "logits.npz"
    returned = cache_teacher_logits(teacher, (x, y, sw), batch_size=16, top_k=top_k,
                                    path=path)
    loaded = load_teacher_logits(path)
    assert len(loaded) == len(returned) == 4 and loaded.batch_size == 16
    for i in range(len(returned)):
        (a, b) = returned[i], loaded[i]
        for u, v in zip(keras.tree.flatten(a), keras.tree.flatten(b)):
            np.testing.assert_array_equal(u, v)
    rebatched = load_teacher_logits(path, batch_size=25)
    assert len(rebatched) == 2
    # The documented format: plain arrays and a JSON metadata string.
    with np.load(path, allow_pickle=False) as f:
        names = set(f.files)
        metadata = json.loads(str(f["metadata"]))
    expected = {"x", "y", "sample_weight", "metadata"} | (
        {"logits"} if top_k is None else {"top_k_values", "top_k_indices"})
    assert names == expected
    assert metadata["format"] == "keras_tpu_mem.teacher_logits.npz"
    assert metadata["num_examples"] == 50 and metadata["top_k"] == top_k


def test_npz_round_trip_of_dict_inputs(tmp_path):
    inputs = {"a": keras.Input((3,), name="a"), "b": keras.Input((2,), name="b")}
    merged = keras.layers.Concatenate()([inputs["a"], inputs["b"]])
    teacher = keras.Model(inputs, keras.layers.Dense(CLASSES)(merged))
    rng = np.random.default_rng(3)
    x = {"a": rng.normal(size=(20, 3)).astype("float32"),
         "b": rng.normal(size=(20, 2)).astype("float32")}
    path = tmp_path / "dict.npz"
    cache_teacher_logits(teacher, (x, np.zeros(20, "int32")), batch_size=8, path=path)
    (bx, _), extras = load_teacher_logits(path)[2]
    np.testing.assert_array_equal(bx["b"], x["b"][16:])
    np.testing.assert_allclose(extras[LOGITS_KEY], teacher.predict(x, verbose=0)[16:],
                               atol=1e-6)


def test_array_cache_bad_arguments(tmp_path):
    teacher = _teacher()
    x, y, _ = _data(20)
    with pytest.raises(ValueError, match="same number of examples"):
        cache_teacher_logits(teacher, (x, y[:5]))
    with pytest.raises(ValueError, match=r"x, \(x,\), \(x, y\)"):
        cache_teacher_logits(teacher, (x, y, y, y))
    with pytest.raises(TypeError, match="leading example axis"):
        cache_teacher_logits(teacher, (np.float32(1.0), y))
    with pytest.raises(ValueError, match="batch_size"):
        cache_teacher_logits(teacher, (x, y), batch_size=0)
    with pytest.raises(ValueError, match="ending in '.npz'"):
        cache_teacher_logits(teacher, (x, y), path=tmp_path / "logits")
    (tmp_path / "taken.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="already exists"):
        cache_teacher_logits(teacher, (x, y), path=tmp_path / "taken.npz")
    with pytest.raises(ValueError, match="larger than the number of classes"):
        cache_teacher_logits(teacher, (x, y), top_k=CLASSES + 1)
    np.savez(tmp_path / "other.npz", x=x)
    with pytest.raises(ValueError, match="not a keras_tpu_mem teacher-logit cache"):
        load_teacher_logits(tmp_path / "other.npz")


def _student(seed=4):
    keras.utils.set_random_seed(seed)
    student = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                                keras.layers.Dense(CLASSES)])
    student.compile(optimizer=keras.optimizers.SGD(0.1),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    return student


@pytest.mark.parametrize("with_sample_weight", [False, True])
def test_fit_on_cached_arrays_needs_no_prepare_student(with_sample_weight):
    """The user code a newcomer writes (no `prepare_student`) trains as the prepared student
    does, and as the live teacher does. Keras builds the loss from the first batch before
    any callback (always on JAX): without the logits, that build took them for labels."""
    from keras_tpu_mem.distillation import Distillation, prepare_student

    teacher = _teacher()
    x, y, sw = _data(64)
    data = (x, y, sw) if with_sample_weight else (x, y)
    weights, losses = [], []
    for how in ("plain", "prepared", "live"):
        student = _student()
        cached = cache_teacher_logits(teacher, data, batch_size=16)
        if how == "prepared":
            prepare_student(student, cached)
        distillation = Distillation(teacher if how == "live" else None, temperature=2.0,
                                    alpha=0.5)
        if how == "live":
            history = student.fit(*data[:2], sample_weight=data[2] if with_sample_weight
                                  else None, batch_size=16, epochs=2, verbose=0,
                                  shuffle=False, callbacks=[distillation])
        else:
            history = student.fit(cached, epochs=2, verbose=0, shuffle=False,
                                  callbacks=[distillation])
        weights.append([np.asarray(w) for w in student.get_weights()])
        losses.append(history.history["loss"])
    for other in weights[1:]:
        for a, b in zip(weights[0], other):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    np.testing.assert_allclose(losses[0], losses[2], rtol=1e-4)
    untrained = [np.asarray(w) for w in _student().get_weights()]
    assert max(np.abs(a - b).max() for a, b in zip(weights[0], untrained)) > 1e-3


def test_cached_batches_keep_their_logits_outside_the_symbolic_build():
    """Only Keras' build sees a batch without logits; indexing, iterating and training
    steps get `(data, logits)`."""
    cached = cache_teacher_logits(_teacher(), _data(20)[:2], batch_size=8)
    assert all(isinstance(cached[i], tuple) and len(cached[i]) == 2
               and set(cached[i][1]) == {LOGITS_KEY} for i in range(len(cached)))


def test_cache_under_data_parallel_equals_plain_predict():
    if keras.backend.backend() != "jax":
        pytest.skip("keras.distribution is the JAX backend's")
    import jax

    x, y, _ = _data()
    reference = _teacher().predict(x, verbose=0)
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    try:
        with distribution.scope():
            teacher = _teacher()
            cached = cache_teacher_logits(teacher, (x, y), batch_size=32)
    finally:
        keras.distribution.set_distribution(None)
    _, logits = _concat_batches(cached)
    np.testing.assert_allclose(logits[LOGITS_KEY], reference, rtol=0, atol=1e-6)


#: Run in a subprocess on JAX: caching a tf.data.Dataset, printing the refusal.
CACHE_A_TF_DATASET = """\
import numpy as np, keras, tensorflow as tf, keras_tpu_mem as ktm
teacher = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
data = tf.data.Dataset.from_tensor_slices(np.zeros((8, 4), "float32")).batch(4)
try:
    ktm.cache_teacher_logits(teacher, data)
except ValueError as error:
    print("REFUSED", error)
"""


def test_a_tf_data_cache_on_jax_says_to_cache_arrays():
    """JAX with TensorFlow installed: a tf.data.Dataset to cache is refused with advice (its
    teacher would run under tf.distribute, which a JAX model lacks); in a subprocess, so
    that this process never loads TensorFlow."""
    if keras.backend.backend() != "jax":
        pytest.skip("the JAX backend's answer")
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("no TensorFlow: a tf.data.Dataset cannot exist")
    proc = subprocess.run([sys.executable, "-c", CACHE_A_TF_DATASET], capture_output=True,
                          text=True, env={**os.environ, "KERAS_BACKEND": "jax"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED" in proc.stdout and "Keras TensorFlow backend" in proc.stdout
    assert "cache_teacher_logits(teacher, (x, y)" in proc.stdout
