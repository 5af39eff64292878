"""The KL term (keras_tpu_mem.distillation.loss), on the active backend.

Backend-neutral tests: this module runs on JAX; `test_distillation_loss.py`
imports its tests to run the same logic on TensorFlow (it imports neither
framework at the top). Reference: the KL term in float64 numpy.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_tpu_mem.distillation import (
    distillation_kl,
)

CLASSES = 7


def np64_kl(student, teacher, temperature, top_k=None):
    """Per-example KL(softmax(t/T) || softmax(s/T)) in float64 (top-k renormalised)."""
    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    log_q = log_softmax(np.float64(student) / temperature)
    t = np.float64(teacher) / temperature
    if top_k is None:
        log_p = log_softmax(t)
        return (np.exp(log_p) * (log_p - log_q)).sum(-1)
    idx = np.argsort(-t, axis=-1, kind="stable")[..., :top_k]
    log_p = log_softmax(np.take_along_axis(t, idx, -1))
    return (np.exp(log_p) * (log_p - np.take_along_axis(log_q, idx, -1))).sum(-1)


def _compile(fn):
    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn, jit_compile=True)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 2.5, 7.0])
@pytest.mark.parametrize("top_k", [None, 3])
def test_distillation_kl_equals_float64_numpy(temperature, top_k, compiled):
    rng = np.random.default_rng(0)
    student = (rng.normal(size=(64, CLASSES)) * 3).astype("float32")
    teacher = (rng.normal(size=(64, CLASSES)) * 3).astype("float32")
    if top_k is None:
        fn = lambda s, t: distillation_kl(s, temperature, t)  # noqa: E731
        args = (student, teacher)
    else:
        idx = np.argsort(-teacher, axis=-1, kind="stable")[..., :top_k].astype("int32")
        fn = lambda s, v, i: distillation_kl(s, temperature, top_k_values=v,  # noqa: E731
                                             top_k_indices=i)
        args = (student, np.take_along_axis(teacher, idx, -1), idx)
    got = keras.ops.convert_to_numpy((_compile(fn) if compiled else fn)(*args))
    assert got.dtype == np.float32 and got.shape == (64,)
    np.testing.assert_allclose(got, np64_kl(student, teacher, temperature, top_k), rtol=1e-4,
                               atol=1e-7)


def test_distillation_kl_of_bfloat16_logits_is_float32():
    rng = np.random.default_rng(1)
    student = keras.ops.cast(rng.normal(size=(8, CLASSES)), "bfloat16")
    teacher = keras.ops.cast(rng.normal(size=(8, CLASSES)), "bfloat16")
    got = distillation_kl(student, 2.0, teacher)
    assert keras.backend.standardize_dtype(got.dtype) == "float32"
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(got),
        np64_kl(keras.ops.convert_to_numpy(keras.ops.cast(student, "float32")),
                keras.ops.convert_to_numpy(keras.ops.cast(teacher, "float32")), 2.0),
        rtol=1e-4, atol=1e-7)
