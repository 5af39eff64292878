"""The KL term (keras_tpu_mem.distillation.loss) on TensorFlow.

The backend-neutral tests live in `test_distillation_loss_jax.py` (KL against
float64 numpy, eager and compiled) and run here on TensorFlow too; the tests
below use TensorFlow's own tensors (bfloat16, `tf.math.top_k`). The KL inside
the TensorFlow step is tested with the callback (`test_distillation_callback.py`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from test_distillation_callback import CLASSES, np_kl
from test_distillation_loss_jax import (  # noqa: F401  (collected here, on TensorFlow)
    test_distillation_kl_equals_float64_numpy,
    test_distillation_kl_of_bfloat16_logits_is_float32,
)

from keras_tpu_mem.distillation import distillation_kl


def test_term_is_float32_for_a_bfloat16_student():
    rng = np.random.default_rng(4)
    s16 = tf.cast(rng.normal(scale=4.0, size=(64, CLASSES)), tf.bfloat16)
    t32 = rng.normal(scale=4.0, size=(64, CLASSES)).astype("float32")
    kl = distillation_kl(s16, 3.0, t32)
    assert kl.dtype == tf.float32
    # Exact against float64 on the bf16 values: a bf16 computation would be ~1e-2 off.
    expected = np_kl(np.float64(tf.cast(s16, tf.float32).numpy()), t32, 3.0)
    np.testing.assert_allclose(kl.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_top_k_with_all_classes_equals_full_logits():
    rng = np.random.default_rng(5)
    s, t = rng.normal(size=(8, CLASSES)), rng.normal(size=(8, CLASSES))
    values, indices = tf.math.top_k(tf.constant(t, tf.float32), k=CLASSES)
    np.testing.assert_allclose(
        distillation_kl(s, 2.0, top_k_values=values, top_k_indices=indices).numpy(),
        distillation_kl(s, 2.0, t).numpy(), rtol=1e-6, atol=1e-7)
