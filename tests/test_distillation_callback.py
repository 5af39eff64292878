"""Tests for keras_tpu_mem.distillation.callback (Distillation), on both backends
(conftest's BOTH_BACKENDS): one body per behaviour; "mirrored" is MirroredStrategy
on TensorFlow and DataParallel over 8 devices on JAX, the cache is a tf.data
dataset on TensorFlow and the array cache (a PyDataset) on JAX.

References are independent of the engine: a numpy float64 re-implementation of
SGD on a linear student with the distillation loss, hand-computed T^2 * KL,
and plain training with a live teacher. The helpers here (a linear student,
its data, the numpy reference) serve the cache and placement tests too.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from conftest import BACKEND
from helpers import RaiseAtEpoch
from helpers import batched as _array_batches

import keras_tpu_mem.distillation as dist
from keras_tpu_mem.accumulation import GradientAccumulation
from keras_tpu_mem.distillation import (
    Distillation,
    cache_teacher_logits,
    distillation_kl,
    prepare_student,
)
from keras_tpu_mem.engine import Engine, StepContext

FEATURES, CLASSES, BATCH, STEPS, LR = 6, 5, 16, 5, 0.5


# --------------------------------------------------------------- references
def np_log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def np_kl(student, teacher, temperature, top_k=None):
    """Per-example KL(softmax(t/T) || softmax(s/T)) in float64."""
    log_q = np_log_softmax(np.float64(student) / temperature)
    t = np.float64(teacher) / temperature
    if top_k is not None:
        idx = np.argsort(-t, axis=-1)[..., :top_k]
        log_p = np_log_softmax(np.take_along_axis(t, idx, -1))
        return (np.exp(log_p) * (log_p - np.take_along_axis(log_q, idx, -1))).sum(-1)
    log_p = np_log_softmax(t)
    return (np.exp(log_p) * (log_p - log_q)).sum(-1)


def np_train(w, b, x, y, teacher_logits, *, temperature, alpha, steps=STEPS, batch=BATCH,
             lr=LR, sample_weight=None, l2=0.0):
    """SGD on a linear student with (1-a) CE + a T^2 KL, in float64.

    Returns the weights after `steps` batches and the mean logged loss.
    """
    w, b = np.float64(w).copy(), np.float64(b).copy()
    losses = []
    for step in range(steps):
        sl = slice(step * batch, (step + 1) * batch)
        xb, yb, tb = np.float64(x[sl]), y[sl], np.float64(teacher_logits[sl])
        sw = np.ones(len(xb)) if sample_weight is None else np.float64(sample_weight[sl])
        s = xb @ w + b
        log_q1 = np_log_softmax(s)
        ce = -log_q1[np.arange(len(yb)), yb]
        kl = np_kl(s, tb, temperature)
        losses.append((1 - alpha) * (sw * ce).mean() + alpha * temperature**2 * (sw * kl).mean()
                      + l2 * (w**2).sum())
        onehot = np.eye(CLASSES)[yb]
        p_t = np.exp(np_log_softmax(tb / temperature))
        q_t = np.exp(np_log_softmax(s / temperature))
        grad_s = ((1 - alpha) * (np.exp(log_q1) - onehot)
                  + alpha * temperature * (q_t - p_t)) * sw[:, None] / len(xb)
        w -= lr * (xb.T @ grad_s + 2 * l2 * w)
        b -= lr * grad_s.sum(0)
    return w, b, float(np.mean(losses))


# --------------------------------------------------------------- fixtures
def make_data(n=BATCH * STEPS, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=n).astype("int32")
    return x, y


def linear(seed, name=None, dtype=None):
    rng = np.random.default_rng(seed)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(CLASSES, dtype=dtype)], name=name)
    model.set_weights([rng.normal(size=(FEATURES, CLASSES)).astype("float32"),
                       rng.normal(size=(CLASSES,)).astype("float32") * 0.1])
    return model


def compile_student(model, case=None, **kwargs):
    kwargs = case.compile_kwargs(**kwargs) if case is not None else kwargs
    model.compile(optimizer=keras.optimizers.SGD(LR),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


def teacher_np_logits(x, seed=7):
    t = linear(seed)
    w, b = t.get_weights()
    return np.float64(x) @ w + b


def fit(model, data, callbacks, epochs=1, **kwargs):
    return model.fit(data, epochs=epochs, callbacks=callbacks, verbose=0, shuffle=False,
                     **kwargs)


def batched(x, y, batch=BATCH, sample_weight=None):
    """tf.data on TensorFlow; the same batches as a PyDataset on JAX (whole batches:
    every data set here is a multiple of the batch)."""
    if BACKEND != "tensorflow":
        return _array_batches(x, y, batch, sample_weight)
    import tensorflow as tf

    parts = (x, y) if sample_weight is None else (x, y, sample_weight)
    return tf.data.Dataset.from_tensor_slices(parts).batch(batch)


def cached(teacher, x, y, batch=BATCH, top_k=None, path=None, student=None, **kwargs):
    """The cached dataset, re-batched; prepares a strategy-scoped student. On JAX the
    array cache (a PyDataset of `batch`), which needs no prepare_student."""
    if BACKEND != "tensorflow":
        sample_weight = kwargs.pop("sample_weight", None)
        parts = (x, y) if sample_weight is None else (x, y, sample_weight)
        return cache_teacher_logits(teacher, parts, batch_size=batch, top_k=top_k,
                                    path=path, **kwargs)
    data = cache_teacher_logits(teacher, batched(x, y, 32, **kwargs), top_k=top_k,
                                path=path).batch(batch)
    if student is not None:
        prepare_student(student, data)
    return data


def weights_close(a, b, atol=1e-5):
    for u, v in zip(a, b):
        np.testing.assert_allclose(u, v, rtol=0, atol=atol)


# ================================================================ the term
@pytest.mark.parametrize("temperature", [1.0, 2.5, 7.0])
@pytest.mark.parametrize("top_k", [None, 2])
def test_added_term_equals_numpy_t2_kl(temperature, top_k):
    rng = np.random.default_rng(3)
    student_logits = rng.normal(scale=3.0, size=(12, CLASSES)).astype("float32")
    teacher_logits = rng.normal(scale=3.0, size=(12, CLASSES)).astype("float32")
    sample_weight = rng.uniform(0.0, 2.0, size=12).astype("float32")
    student = linear(3)
    callback = Distillation(temperature=temperature, alpha=0.3, top_k=top_k)
    callback.set_model(student)
    callback.install(student)
    tensor = keras.ops.convert_to_tensor
    extras = {dist.LOGITS_KEY: tensor(teacher_logits)}
    ctx = StepContext(student, None, None, tensor(sample_weight), tensor(student_logits),
                      extras, state=callback.init_state(StepContext.outside(student)))
    base = tensor(1.25)
    total = float(callback.transform_loss(base, ctx))
    kl = np_kl(student_logits, teacher_logits, temperature, top_k)
    expected = 0.7 * 1.25 + 0.3 * temperature**2 * np.mean(np.float64(sample_weight) * kl)
    np.testing.assert_allclose(total, expected, rtol=1e-5)
    # The per-example KL itself, in float32 against float64:
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(distillation_kl(student_logits, temperature,
                                                   teacher_logits)),
        np_kl(student_logits, teacher_logits, temperature), rtol=1e-5, atol=1e-7)


# ================================================================ the matrix
def setup_case(case, **compile_kwargs):
    with case.strategy.scope():
        student = compile_student(linear(3), case, **compile_kwargs)
        teacher = linear(7)
    return student, teacher


def reference(x, y, **kwargs):
    w0, b0 = linear(3).get_weights()
    kwargs.setdefault("temperature", 2.0)
    kwargs.setdefault("alpha", 0.3)
    return np_train(w0, b0, x, y, teacher_np_logits(x), **kwargs)


def fit_against_reference(case, source, **setup):
    """Distils with a live teacher or its cache; weights and loss must equal float64 numpy."""
    x, y = make_data()
    student, teacher = setup_case(case, **setup)
    if source == "live":
        data, callback = batched(x, y), Distillation(teacher, temperature=2.0, alpha=0.3)
    else:
        data = cached(teacher, x, y, student=student)
        callback = Distillation(temperature=2.0, alpha=0.3)
    history = fit(student, data, [callback])
    ref_w, ref_b, ref_loss = reference(x, y)
    weights_close(student.get_weights(), [ref_w, ref_b])
    np.testing.assert_allclose(history.history["loss"][0], ref_loss, rtol=1e-5)
    return student


@pytest.mark.parametrize("source", ["live", "cache"])
def test_fit_equals_numpy_reference(strategy_case, source):
    """5 SGD steps: weights and logged loss equal float64 numpy, on 1 or 2 replicas."""
    fit_against_reference(strategy_case, source)


@pytest.mark.parametrize("case_name, source", [("default", "live"), ("mirrored", "cache"),
                                               ("mirrored", "live")])
def test_steps_per_execution(case_name, source):
    """steps_per_execution=2 over 5 steps (2 + 2 + 1) equals the reference."""
    from conftest import StrategyCase

    student = fit_against_reference(StrategyCase(case_name), source, steps_per_execution=2)
    assert int(student.optimizer.iterations.numpy()) == STEPS


def test_sample_weight_weights_the_distillation_term():
    x, y = make_data()
    sw = np.random.default_rng(9).uniform(0, 2, size=len(x)).astype("float32")
    sw[::4] = 0.0
    student, teacher = compile_student(linear(3)), linear(7)
    fit(student, batched(x, y, sample_weight=sw), [Distillation(teacher, temperature=2.0,
                                                                alpha=0.3)])
    ref_w, ref_b, _ = reference(x, y, sample_weight=sw)
    weights_close(student.get_weights(), [ref_w, ref_b])


def test_regularization_keeps_its_full_weight():
    x, y = make_data()
    student = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(
        CLASSES, kernel_regularizer=keras.regularizers.L2(0.05))])
    student.set_weights(linear(3).get_weights())
    compile_student(student)
    history = fit(student, batched(x, y), [Distillation(linear(7), temperature=2.0, alpha=0.3)])
    ref_w, ref_b, ref_loss = reference(x, y, l2=0.05)
    weights_close(student.get_weights(), [ref_w, ref_b])
    np.testing.assert_allclose(history.history["loss"][0], ref_loss, rtol=1e-5)


# ================================================================ composition
@pytest.mark.parametrize("case_name, source, order", [
    ("default", "live", "accumulation_first"),
    ("default", "live", "distillation_first"),
    ("mirrored", "cache", "distillation_first"),
])
def test_gradient_accumulation_equals_full_batch(case_name, source, order):
    """Distillation + GradientAccumulation: micro-batches of 4 (2 per replica on
    MirroredStrategy's 2; on JAX's 8 devices steps=2, 1 per device) give the full
    batch's update; the callbacks' order does not matter."""
    from conftest import StrategyCase

    case = StrategyCase(case_name)
    x, y = make_data()
    student, teacher = setup_case(case)
    if source == "live":
        data, distill = batched(x, y), Distillation(teacher, temperature=2.0, alpha=0.3)
    else:
        data = cached(teacher, x, y, student=student)
        distill = Distillation(temperature=2.0, alpha=0.3)
    callbacks = [GradientAccumulation(steps=4 // min(case.num_replicas, 2)), distill]
    if order == "distillation_first":
        callbacks.reverse()
    history = fit(student, data, callbacks)
    ref_w, ref_b, ref_loss = reference(x, y)
    weights_close(student.get_weights(), [ref_w, ref_b])
    np.testing.assert_allclose(history.history["loss"][0], ref_loss, rtol=1e-5)


def test_composes_with_bfloat16_pruning_and_accumulation_in_any_order():
    """MixedBFloat16 + Pruning + GradientAccumulation + Distillation: the callbacks'
    order does not change the result; the teacher keeps its float32 policy."""
    from keras_tpu_mem.precision import MixedBFloat16
    from keras_tpu_mem.pruning import Pruning
    from keras_tpu_mem.pruning.schedules import ConstantSparsity

    x, y = make_data()
    keras.utils.set_random_seed(4)
    teacher = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64, activation="relu"),
                                keras.layers.Dense(CLASSES)])
    keras.utils.set_random_seed(5)
    initial = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                                keras.layers.Dense(CLASSES)]).get_weights()
    results, losses = [], []
    for reverse in (False, True):
        student = keras.Sequential([keras.Input((FEATURES,)),
                                    keras.layers.Dense(16, activation="relu"),
                                    keras.layers.Dense(CLASSES)])
        student.set_weights(initial)
        compile_student(student)
        callbacks = [MixedBFloat16(), Pruning(ConstantSparsity(0.5, begin_step=0, frequency=1)),
                     GradientAccumulation(steps=2), Distillation(teacher, alpha=0.5)]
        if reverse:
            callbacks.reverse()
        history = fit(student, batched(x, y), callbacks)
        results.append(student.get_weights())
        losses.append(history.history["loss"][0])
    weights_close(*results, atol=1e-6)
    assert np.isfinite(losses).all() and losses[0] == pytest.approx(losses[1], rel=1e-6)
    kernel = student.layers[0].kernel.numpy()
    assert 0.45 <= float(np.mean(kernel == 0)) <= 0.55
    assert all(layer.compute_dtype == "float32" for layer in teacher.layers)


def _reachable_tf_functions(fn):
    """Every tf.function reachable from a Python callable through closures."""
    import tensorflow as tf

    found, seen, stack = [], set(), [fn]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, tf.types.experimental.PolymorphicFunction):
            found.append(obj)
            obj = getattr(obj, "_python_function", None)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                stack.append(cell.cell_contents)
            except ValueError:
                pass
        if getattr(obj, "__wrapped__", None) is not None:
            stack.append(obj.__wrapped__)
    return found


def _captured_handles(model):
    """ids of the resource handles captured by the compiled train step(s)."""
    handles = set()
    functions = _reachable_tf_functions(model.train_function)
    assert functions, "the engine's train function holds no tf.function"
    for function in functions:
        for concrete in function._list_all_concrete_functions():
            handles.update(id(t) for t in concrete.captured_inputs)
    return handles


# ================================================================ schedules, resume
def temperature_schedule(epoch):
    return 1.0 + epoch


def alpha_schedule(epoch):
    return 0.2 + 0.2 * epoch


def count_traces(callback):
    """Counts how often the step is traced (transform_loss runs only while tracing)."""
    calls = []
    original = callback.transform_loss

    def counting(loss, ctx):
        calls.append(1)
        return original(loss, ctx)

    callback.transform_loss = counting
    return calls


@pytest.mark.parametrize("source", ["live", "cache"])
def test_schedules_resume_through_backup_and_restore(tmp_path, source):
    """Epoch schedules update variables (one trace for all epochs) and a resumed fit
    continues with the restored epoch's values: equal to the numpy reference."""
    x, y = make_data(n=2 * BATCH)
    epochs = 4
    w, b = linear(3).get_weights()
    t = teacher_np_logits(x)
    for epoch in range(epochs):
        w, b, _ = np_train(w, b, x, y, t, temperature=temperature_schedule(epoch),
                           alpha=alpha_schedule(epoch), steps=2)
    teacher = linear(7)
    data = batched(x, y) if source == "live" else cached(teacher, x, y)

    def callback():
        return Distillation(teacher if source == "live" else None,
                            temperature=temperature_schedule, alpha=alpha_schedule)

    # Uninterrupted, counting traces.
    student = compile_student(linear(3))
    first = callback()
    traces = count_traces(first)
    fit(student, data, [first], epochs=epochs)
    assert len(traces) == 1
    weights_close(student.get_weights(), [w, b])
    # Interrupted at epoch 2, then resumed by a fresh BackupAndRestore.
    student = compile_student(linear(3))
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted at epoch 2"):
        fit(student, data, [keras.callbacks.BackupAndRestore(backup), callback(),
                            RaiseAtEpoch(2)], epochs=epochs)
    student = compile_student(linear(3))
    resumed = callback()
    fit(student, data, [keras.callbacks.BackupAndRestore(backup), resumed], epochs=epochs)
    weights_close(student.get_weights(), [w, b])
    state = Engine.of(student).feature_state(resumed)
    assert float(keras.ops.convert_to_numpy(state.temperature)) == temperature_schedule(
        epochs - 1)


# ================================================================ the teacher
def test_teacher_is_frozen_in_inference_mode_and_student_stays_a_plain_model(tmp_path):
    """A teacher with Dropout and BatchNormalization: unchanged by the student's fit, and
    the live run equals the cache made with training=False (Dropout would differ)."""
    x, y = make_data()
    keras.utils.set_random_seed(2)
    teacher = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32),
                                keras.layers.BatchNormalization(), keras.layers.Dropout(0.5),
                                keras.layers.Dense(CLASSES)])
    before = [v.numpy().copy() for v in teacher.weights]
    results = []
    for data, callback in ((batched(x, y), Distillation(teacher, alpha=0.9)),
                           (cached(teacher, x, y), Distillation(alpha=0.9))):
        student = compile_student(linear(3))
        fit(student, data, [callback])
        results.append(student.get_weights())
    weights_close(*results, atol=1e-6)
    for old, new in zip(before, teacher.weights):
        np.testing.assert_array_equal(old, new.numpy())
    # The student is the user's model: saved, reloaded, fitted without the callback.
    student.save(tmp_path / "student.keras")
    reloaded = keras.models.load_model(tmp_path / "student.keras")
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), student.predict(x, verbose=0),
                               rtol=1e-6)
    fit(student, batched(x, y), [])
    assert not any(isinstance(v, Distillation) for v in vars(student).values())


def test_float32_teacher_with_bfloat16_student():
    x, y = make_data()
    student = keras.Sequential([keras.Input((FEATURES,)),
                                keras.layers.Dense(CLASSES, dtype="mixed_bfloat16")])
    student.set_weights(linear(3).get_weights())
    compile_student(student)
    teacher = linear(7)
    history = fit(student, batched(x, y), [Distillation(teacher, temperature=2.0, alpha=0.3)])
    assert student(x[:2]).dtype == "bfloat16"
    assert all(v.dtype == "float32" for v in teacher.weights)
    ref_w, ref_b, ref_loss = reference(x, y)
    # bf16 compute: close to the float32 reference at bf16 precision.
    weights_close(student.get_weights(), [ref_w, ref_b], atol=5e-2)
    np.testing.assert_allclose(history.history["loss"][0], ref_loss, rtol=2e-2)


# ================================================================ bad input
@pytest.mark.parametrize("kwargs, error, match", [
    ({"temperature": 0.0}, ValueError, "temperature"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"temperature": "2"}, TypeError, "temperature"),
    ({"alpha": -0.1}, ValueError, r"alpha.*\[0, 1\]"),
    ({"alpha": 1.5}, ValueError, r"alpha.*\[0, 1\]"),
    ({"alpha": True}, TypeError, "alpha"),
    ({"top_k": 0}, ValueError, "top_k"),
    ({"top_k": 2.5}, TypeError, "top_k"),
    ({"top_k": CLASSES + 1}, ValueError, "larger than the number of classes"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Distillation(linear(7), **kwargs)


def test_bad_teachers():
    with pytest.raises(TypeError, match="keras.Model"):
        Distillation(lambda x: x)
    unbuilt = keras.Sequential([keras.layers.Dense(CLASSES)])
    with pytest.raises(ValueError, match="not built"):
        Distillation(unbuilt)
    with pytest.raises(ValueError, match="not built"):
        cache_teacher_logits(unbuilt, batched(*make_data()))


def fit_error(callback, data=None, student=None):
    x, y = make_data()
    student = student or compile_student(linear(3))
    fit(student, batched(x, y) if data is None else data, [callback])


def test_teacher_and_student_shapes_must_match():
    other = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES + 1)])
    with pytest.raises(ValueError, match="teacher outputs 6 logits .* student outputs 5"):
        fit_error(Distillation(other))
    x, y = make_data()
    with pytest.raises(ValueError, match="cached teacher logits have shape"):
        fit_error(Distillation(), data=cached(other, x, y))


def test_softmax_outputs_are_refused():
    probs = keras.Sequential([keras.Input((FEATURES,)),
                              keras.layers.Dense(CLASSES, activation="softmax")])
    with pytest.raises(ValueError, match="teacher's last layer applies softmax"):
        fit_error(Distillation(probs))
    with pytest.raises(ValueError, match="student's last layer applies softmax"):
        fit_error(Distillation(linear(7)), student=compile_student(probs))


def test_dataset_and_teacher_must_agree():
    x, y = make_data()
    with pytest.raises(ValueError, match="carry none"):
        fit_error(Distillation())
    with pytest.raises(ValueError, match="pass teacher=None"):
        fit_error(Distillation(linear(7)), data=cached(linear(7), x, y))
    with pytest.raises(ValueError, match="caches only the teacher's top 2"):
        fit_error(Distillation(top_k=3), data=cached(linear(7), x, y, top_k=2))


def test_bad_schedule_value_names_the_epoch():
    with pytest.raises(ValueError, match=r"temperature.*epoch 0"):
        fit_error(Distillation(linear(7), temperature=lambda epoch: 0.0))


def test_get_config_round_trip():
    callback = Distillation(temperature=3.0, alpha=0.25, top_k=2)
    config = callback.get_config()
    assert config == {"temperature": 3.0, "alpha": 0.25, "top_k": 2}
    again = Distillation.from_config(config)
    assert again.get_config() == config and again.teacher is None
