"""Memory by Keras layer on TensorFlow: not built yet.

Contract: see `backends/jax/compiled_layers.py`. The TensorFlow path would read the
same attribution from XLA's `HloProto` (its buffer assignment and the instructions'
`op_name`, which carry the layers' name scopes and `gradient_tape/...`).
"""

from __future__ import annotations


def require() -> None:
    raise NotImplementedError(
        "CompiledMemory.by_layer() needs the JAX backend (KERAS_BACKEND=jax) so far; on "
        "TensorFlow, compiled_memory() gives the step's totals (arguments, temporaries, "
        "live-out).")


def layer_rows(model, texts, device_shape):
    require()
