"""Output layers: float32 forward, bfloat16 backward (precision.output).

TensorFlow only: these read gradients through tf.GradientTape and the ops of a
tf.function graph. JAX's counterpart of the forward check is
`test_precision_callback_jax.py::test_output_layer_forward_is_exactly_float32`.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from precision_models import digits_mlp

from keras_tpu_mem.precision import MixedBFloat16


def test_output_layer_forward_is_float32_and_backward_bfloat16():
    model = digits_mlp()
    head = model.get_layer("logits")
    rng = np.random.default_rng(0)
    h = tf.cast(tf.constant(rng.normal(size=(32, 64)), "float32"), "bfloat16")
    upstream = rng.normal(size=(32, 10)).astype("float32")
    kernel, bias = (np.asarray(w, "float64") for w in head.get_weights())
    h64 = np.asarray(tf.cast(h, "float32"), "float64")
    exact_out = h64 @ kernel + bias

    def run(callback):
        callback.install(model)
        try:
            with tf.GradientTape() as tape:
                tape.watch(h)
                out = head(h)
            d_h, d_kernel = tape.gradient(out, [h, head.kernel], output_gradients=upstream)
        finally:
            callback.restore(model)
        return out, d_h, d_kernel

    out, d_h, d_kernel = run(MixedBFloat16())
    assert out.dtype == tf.float32
    # The forward value is a float32 layer's: float32 rounding only (a bfloat16
    # layer would be off by ~1e-2 here).
    assert np.abs(out.numpy() - exact_out).max() / np.abs(exact_out).max() < 1e-6
    # The backward pass is bfloat16: the input gradient is bfloat16 and the
    # kernel gradient is that of a bfloat16 product.
    assert d_h.dtype == tf.bfloat16
    exact_d_kernel = h64.T @ upstream.astype("float64")
    error = np.abs(d_kernel.numpy() - exact_d_kernel).max() / np.abs(exact_d_kernel).max()
    assert 1e-5 < error < 2e-2

    out, d_h, d_kernel = run(MixedBFloat16(exact_output_gradients=True))
    assert np.abs(out.numpy() - exact_out).max() / np.abs(exact_out).max() < 1e-6
    error = np.abs(d_kernel.numpy() - exact_d_kernel).max() / np.abs(exact_d_kernel).max()
    assert error < 1e-6


def _float32_activation_gradients(model, callback, batch=256):
    """float32 tensors of activation size (batch x 64) in the gradient graph."""
    callback.install(model)
    try:
        @tf.function
        def grads(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=True))
            return tape.gradient(loss, model.trainable_variables)

        graph = grads.get_concrete_function(tf.TensorSpec((batch, 64), "float32")).graph
    finally:
        callback.restore(model)
    found = []
    for op in graph.get_operations():
        if "gradient" not in op.name:
            continue
        for out in op.outputs:
            if out.dtype == tf.float32 and out.shape.as_list() == [batch, 64]:
                found.append(op.name)
    return found


def test_no_float32_activation_gradient_with_the_default_output_layer():
    model = digits_mlp()
    assert _float32_activation_gradients(model, MixedBFloat16()) == []
    # The plain float32 output layer has one (what the default avoids).
    assert _float32_activation_gradients(model, MixedBFloat16(exact_output_gradients=True))
