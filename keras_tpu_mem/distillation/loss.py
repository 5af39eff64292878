"""The distillation term: `KL(softmax(t/T) || softmax(s/T))`, in `keras.ops`.

On TensorFlow these are the same `tf.nn.log_softmax` / `tf.exp` /
`tf.reduce_sum` ops as written by hand (`take_along_axis` is the batched
gather), and the same program runs in a jitted JAX step.
"""

from __future__ import annotations

import keras

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.engine import overrides

ops = keras.ops


def distillation_kl(student_logits, temperature, teacher_logits=None, *,
                    top_k_values=None, top_k_indices=None):
    """Per-example `KL(softmax(t/T) || softmax(s/T))` over the last axis, in float32.

    Give either the teacher's full `teacher_logits` or its top-k
    (`top_k_values`, `top_k_indices`). With top-k, the teacher distribution is
    `softmax` over the kept classes only (renormalised, zero elsewhere), and the
    KL is taken against the student's full distribution:
    `sum_{i in K} p_i (log p_i - log q_i)`.

    Args:
        student_logits: The student's logits, `[..., classes]`.
        temperature: The softmax temperature `T > 0` (a float or a scalar tensor).
        teacher_logits: The teacher's logits, the student's shape (or None with top-k).
        top_k_values: The teacher's k largest logits, `[..., k]`.
        top_k_indices: Their class indices, `[..., k]`.

    Returns:
        A float32 tensor of the logits' shape without the last axis.

    Example:

    ```python
    kl = ktm.distillation_kl(student_logits, 2.0, teacher_logits)   # [batch]
    loss = 2.0**2 * keras.ops.mean(kl)
    ```
    """
    temperature = ops.cast(temperature, "float32")
    s = ops.cast(student_logits, "float32") / temperature
    log_q = ops.log_softmax(s, axis=-1)
    if teacher_logits is not None:
        t = ops.cast(teacher_logits, "float32") / temperature
        log_p = ops.log_softmax(t, axis=-1)
        return ops.sum(ops.exp(log_p) * (log_p - log_q), axis=-1)
    t = ops.cast(top_k_values, "float32") / temperature
    log_p = ops.log_softmax(t, axis=-1)
    indices = ops.cast(top_k_indices, "int32")
    log_q_kept = ops.take_along_axis(log_q, indices, axis=-1)
    return ops.sum(ops.exp(log_p) * (log_p - log_q_kept), axis=-1)


def top_k_logits(logits, k):
    """The k largest logits (float32, descending) and their int32 class indices."""
    values, indices = ops.top_k(ops.cast(logits, "float32"), k=k)
    return values, ops.cast(indices, "int32")


def regularization_loss(model):
    """The regularisation part of Keras' `compute_loss` (replica-scaled), or None.

    None too when the model overrides `compute_loss`: its total cannot be split,
    so all of it is weighted by `1 - alpha`.
    """
    if overrides(model, "compute_loss"):
        return None
    losses = model.losses
    if not losses:
        return None
    total = None
    for loss in losses:
        value = ops.cast(keras_compat.aggregate_additional_loss(model, loss), "float32")
        total = value if total is None else total + value
    return total


__all__ = ["distillation_kl", "regularization_loss", "top_k_logits"]
