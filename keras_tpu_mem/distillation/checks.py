"""Argument and model checks shared by `Distillation` and the caches.

Each check returns the value to use (a number as a float, a batch size as an
int) or raises the TypeError / ValueError the user reads, naming the argument.
"""

from __future__ import annotations

import math

import keras
import numpy as np

ops = keras.ops


def _check_number(value, name, accepted):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        if (ops.is_tensor(value) and len(value.shape) == 0
                and keras.backend.is_float_dtype(keras.backend.standardize_dtype(value.dtype))):
            return float(value)
        raise TypeError(f"`{name}` must be {accepted}, got {value!r} ({type(value).__name__}).")
    return float(value)


def check_temperature(value, where=""):
    """`value` as a float > 0 (`where` says which schedule returned it)."""
    value = _check_number(value, "temperature", "a float > 0 or a callable of the epoch")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"`temperature` must be a finite float > 0{where}, got {value}.")
    return value


def check_alpha(value, where=""):
    """`value` as a float in [0, 1] (`where` says which schedule returned it)."""
    value = _check_number(value, "alpha", "a float in [0, 1] or a callable of the epoch")
    if not (0.0 <= value <= 1.0):
        raise ValueError(f"`alpha` must be a float in [0, 1]{where}, got {value}.")
    return value


def check_top_k(top_k, teacher=None):
    """`top_k` as None or an int >= 1 (at most the classes `teacher` outputs, if given)."""
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"`top_k` must be None or an int >= 1, got {top_k!r}.")
    if top_k < 1:
        raise ValueError(f"`top_k` must be None or an int >= 1, got {top_k}.")
    if teacher is not None:
        check_top_k_classes(top_k, output_classes(teacher), "the teacher")
    return top_k


def check_top_k_classes(top_k, num_classes, who):
    """Refuses a `top_k` larger than the classes `who` (a phrase) outputs."""
    if top_k is not None and num_classes is not None and top_k > num_classes:
        raise ValueError(
            f"`top_k`={top_k} is larger than the number of classes ({num_classes}) of "
            f"{who}. Use top_k <= {num_classes}, or top_k=None to keep all logits."
        )


def check_batch_size(batch_size):
    """`batch_size` as an int >= 1."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"`batch_size` must be an int >= 1, got {batch_size!r}.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be an int >= 1, got {batch_size}.")
    return int(batch_size)


def single_output(value, who):
    """`value`, refused when `who` (a phrase) has several outputs."""
    if isinstance(value, (dict, list, tuple)):
        raise TypeError(
            f"Distillation needs {who} with a single logits output, got a "
            f"{type(value).__name__} of outputs."
        )
    return value


def ends_in_probabilities(model) -> str | None:
    """Name of the final activation when the model outputs probabilities."""
    layers = getattr(model, "layers", None)
    if not layers:
        return None
    last = layers[-1]
    if isinstance(last, keras.layers.Softmax):
        return "softmax"
    activation = getattr(last, "activation", None)
    for fn in (keras.activations.softmax, keras.activations.sigmoid):
        if activation is fn:
            return fn.__name__
    return None


def output_classes(model):
    """The static size of the model's last output axis, or None when unknown."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError, TypeError):
        return None
    if not outputs or len(outputs) != 1:
        return None
    shape = tuple(outputs[0].shape)
    return shape[-1] if shape else None


__all__ = [
    "check_alpha",
    "check_batch_size",
    "check_temperature",
    "check_top_k",
    "check_top_k_classes",
    "ends_in_probabilities",
    "output_classes",
    "single_output",
]
