"""Output layers with a float32 forward pass and a bfloat16 backward pass.

An output layer fed by bfloat16 activations runs twice while `MixedBFloat16`
is installed: in float32 (the value it returns, exactly that of a float32
layer) and in bfloat16 (the path gradients flow through), so no float32 copy
of its input or of that input's gradient is alive when memory peaks, at the
start of the backward pass.
"""

from __future__ import annotations

import keras

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.precision.policies import sublayers


def is_float(tensor, dtype=None) -> bool:
    """Whether `tensor` is a float tensor (of `dtype`, if given)."""
    if not hasattr(tensor, "dtype") or not keras.ops.is_tensor(tensor):
        return False
    name = keras.backend.standardize_dtype(tensor.dtype)
    return keras.backend.is_float_dtype(name) and (dtype is None or name == dtype)


def _join(exact, low):
    """`exact` as the value, the gradient of `low` as the gradient."""
    if not is_float(exact) or low is None:
        return exact
    low = keras.ops.cast(low, exact.dtype)
    return keras.ops.stop_gradient(exact) + (low - keras.ops.stop_gradient(low))


class Float32Forward:
    """Replaces an output layer's `call` while `MixedBFloat16` is installed.

    With a bfloat16 input, the layer runs twice: in float32 on the upcast input
    (the value it returns, exactly that of a float32 layer) and in bfloat16 (the
    path gradients flow through). Nothing of the float32 pass is kept for the
    backward pass, so no float32 copy of the activation is alive at the memory
    peak. Only for leaf layers without non-trainable state or random seeds, so
    running the layer twice has no side effect.
    """

    def __init__(self, layer):
        self.layer = layer
        self.original = layer.__dict__.get("call")
        self.convert = keras_compat.convert_input_args(layer)
        self.call = layer.call

    def install(self):
        layer = self.layer
        # Keras would cast the bfloat16 input to float32 before `call`; we cast
        # ourselves, so the bfloat16 tensor reaches the bfloat16 pass.
        keras_compat.set_convert_input_args(layer, False)
        object.__setattr__(layer, "call", self)

    def uninstall(self):
        layer = self.layer
        keras_compat.set_convert_input_args(layer, self.convert)
        if self.original is None:
            layer.__dict__.pop("call", None)
        else:
            object.__setattr__(layer, "call", self.original)

    def _cast(self, structure, dtype):
        """What Keras' `__call__` does to the inputs, to `dtype` (floats only)."""
        policy = self.layer.dtype_policy

        def convert(x):
            if keras.ops.is_tensor(x) or (hasattr(x, "__array__") and hasattr(x, "dtype")):
                return policy.convert_input(x, self.layer.autocast, dtype)
            return x

        return keras.tree.map_structure(convert, structure)

    def __call__(self, *args, **kwargs):
        exact_args, exact_kwargs = self._cast((args, kwargs), self.layer.compute_dtype)
        exact = self.call(*exact_args, **exact_kwargs)
        if not any(is_float(x, "bfloat16") for x in keras.tree.flatten((args, kwargs))):
            return exact
        low_args, low_kwargs = self._cast((args, kwargs), "bfloat16")
        with keras_compat.autocast_scope("bfloat16"):
            low = self.call(*low_args, **low_kwargs)
        return keras.tree.map_structure(_join, exact, low)


def straight_through_ok(layer) -> bool:
    """Whether running `layer` twice has no side effect: no sublayers, no non-trainable state."""
    return not sublayers(layer) and not layer.non_trainable_variables
