"""Which weights `ktm.Pruning` prunes: the layers a selection names and their kernels.

Kernels of Dense, EinsumDense, Conv (and transposed), DepthwiseConv,
SeparableConv (pointwise) and Embedding layers, and whatever a custom layer's
`get_prunable_weights()` returns (tfmot's `PrunableLayer` protocol); never
biases or normalisation weights. Each comes with the axis N:M groups run along.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass

import keras

from keras_tpu_mem._compat import keras as keras_compat


@dataclass
class PrunableWeight:
    """One prunable weight: the layer, the variable and its input-channel axis."""

    layer: object
    variable: object
    axis: int  # the axis N:M groups run along (the contracted input axis)
    kind: str  # "dense", "conv", "depthwise", "embedding", "custom", ...

    @property
    def path(self) -> str:
        return getattr(self.variable, "path", None) or f"{self.layer.name}/{self.variable.name}"


def check_pair(value, name, what):
    """`value` as a pair of ints, or a TypeError naming `name` and `what` it means."""
    try:
        pair = tuple(value)
    except TypeError:
        raise TypeError(f"`{name}` must be a pair of ints ({what}), got {value!r}.") from None
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, numbers.Integral)
                             for v in pair):
        raise TypeError(f"`{name}` must be a pair of ints ({what}), got {value!r}.")
    return tuple(int(v) for v in pair)


def _einsum_input_axis(layer) -> int:
    """The last kernel axis that is contracted with the input (EinsumDense)."""
    inputs = layer.equation.split("->")[0].split(",")
    input_spec, kernel_spec = inputs[0].strip(), inputs[1].strip()
    kernel_spec = kernel_spec.replace("...", "")
    contracted = [i for i, c in enumerate(kernel_spec) if c in input_spec]
    return contracted[-1] if contracted else 0


def _prunable_variables(layer) -> list[tuple[object, int, str]]:
    """(variable, input axis, kind) for every weight of `layer` that is pruned.

    Biases and normalisation weights are never returned.
    """
    L = keras.layers
    if hasattr(layer, "get_prunable_weights") and callable(layer.get_prunable_weights):
        weights = list(layer.get_prunable_weights())
        for w in weights:
            if not isinstance(w, keras.Variable):
                raise TypeError(
                    f"{layer.name}.get_prunable_weights() must return Keras variables "
                    f"(created with add_weight), got {type(w).__name__}."
                )
        return [(w, (len(w.shape) - 2) if len(w.shape) >= 2 else 0, "custom") for w in weights]
    if isinstance(layer, L.Dense):
        spec = [("kernel", 0, "dense")]
    elif isinstance(layer, L.EinsumDense):
        spec = [("kernel", _einsum_input_axis(layer), "einsum_dense")]
    elif isinstance(layer, (L.SeparableConv1D, L.SeparableConv2D)):
        # As tfmot: the pointwise kernel [1, (1,) in, out]; the depthwise part is tiny.
        spec = [("pointwise_kernel", -2, "separable_conv")]
    elif isinstance(layer, (L.DepthwiseConv1D, L.DepthwiseConv2D)):
        spec = [("kernel", -2, "depthwise")]
    elif isinstance(layer, (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)):
        spec = [("kernel", -1, "conv_transpose")]  # [..., out, in]
    elif isinstance(layer, (L.Conv1D, L.Conv2D, L.Conv3D)):
        spec = [("kernel", -2, "conv")]  # [..., in, out]
    elif isinstance(layer, L.Embedding):
        # The table is the kernel of one_hot(ids) @ table: the vocabulary is the
        # contracted axis (tfmot's rank-2 rule gives the same).
        spec = [("embeddings", 0, "embedding")]
        if getattr(layer, "reverse_embeddings", None) is not None:  # untied ReversibleEmbedding
            spec.append(("reverse_embeddings", 0, "embedding"))
    else:
        return []
    if getattr(layer, "lora_enabled", False):
        raise ValueError(
            f"Layer {layer.name!r} has LoRA enabled: its effective kernel is kernel + A @ B, "
            "which masking the frozen kernel cannot make sparse. Prune before enabling "
            "LoRA, or exclude the layer with `layers=`."
        )
    if getattr(layer, "quantization_mode", None):
        raise ValueError(
            f"Layer {layer.name!r} is quantized ({layer.quantization_mode}); prune the "
            "float model, then quantize it."
        )
    out = []
    for attr, axis, kind in spec:
        variable = getattr(layer, attr)
        if not isinstance(variable, keras.Variable):
            raise TypeError(
                f"{layer.name}.{attr} is a {type(variable).__name__}, not a variable; "
                "keras_tpu_mem cannot prune it."
            )
        axis = axis % len(variable.shape) if len(variable.shape) else 0
        out.append((variable, axis, kind))
    return out


def _all_layers(model):
    return keras_compat.flatten_layers(model, include_self=False, recursive=True)


def normalise_selection(layers):
    if layers is None:
        return None
    if isinstance(layers, (str, type)):
        layers = [layers]
    if not isinstance(layers, Iterable):
        raise TypeError(
            "`layers` must be None, a layer name, a layer class, or a list of them; got "
            f"{layers!r} ({type(layers).__name__})."
        )
    layers = list(layers)
    if not layers:
        raise ValueError("`layers` is empty: pass None to prune every supported layer.")
    for item in layers:
        if not (isinstance(item, str) or (isinstance(item, type)
                                          and issubclass(item, keras.layers.Layer))):
            raise TypeError(
                "`layers` items must be layer names (str) or keras.layers.Layer subclasses; "
                f"got {item!r} ({type(item).__name__})."
            )
    return layers


def select_layers(model, selection):
    """The layers `selection` (normalised `layers`) designates; errors for names
    and classes that match no layer."""
    all_layers = _all_layers(model)
    if selection is None:
        return all_layers
    chosen, unmatched = [], []
    for item in selection:
        if isinstance(item, str):
            hits = [layer for layer in all_layers if layer.name == item]
        else:
            hits = [layer for layer in all_layers if isinstance(layer, item)]
        if not hits:
            unmatched.append(item if isinstance(item, str) else item.__name__)
        for hit in hits:
            chosen.append(hit)
            # A selected block (e.g. MultiHeadAttention) brings its sublayers.
            chosen.extend(keras_compat.flatten_layers(hit, include_self=False, recursive=True))
    if unmatched:
        names = ", ".join(repr(layer.name) for layer in all_layers[:20])
        raise ValueError(
            f"`layers` names no layer of the model: {', '.join(map(str, unmatched))}. "
            f"Layers are: {names}{' ...' if len(all_layers) > 20 else ''}."
        )
    return chosen


def find_prunable_weights(model, layers=None) -> list[PrunableWeight]:
    """The weights `Pruning(layers=layers)` would prune in `model`.

    Raises `ValueError` when a name or class in `layers` matches no layer, when
    a selected layer has nothing prunable, or when the model has nothing
    prunable at all.
    """
    selection = normalise_selection(layers)
    chosen = select_layers(model, selection)
    found, seen = [], set()
    for layer in chosen:
        for variable, axis, kind in _prunable_variables(layer):
            key = id(variable)
            if key in seen:  # shared layers and tied weights are pruned once
                continue
            seen.add(key)
            found.append(PrunableWeight(layer, variable, axis, kind))
    if selection is not None:
        selected_with_weights = {id(w.layer) for w in found}
        for item in selection:
            if isinstance(item, str):
                empty = [layer for layer in chosen if layer.name == item
                         and id(layer) not in selected_with_weights
                         and not any(id(sub) in selected_with_weights for sub in
                                     keras_compat.flatten_layers(layer, include_self=False))]
                if empty:
                    raise ValueError(
                        f"Layer {item!r} ({type(empty[0]).__name__}) has no prunable "
                        "weights: Pruning prunes the kernels of Dense, EinsumDense, Conv, "
                        "DepthwiseConv, SeparableConv and Embedding layers and of layers with "
                        "get_prunable_weights(); biases and normalisation weights never."
                    )
    if not found:
        raise ValueError(
            f"Nothing to prune in model {model.name!r}: no Dense, EinsumDense, Conv*, "
            "DepthwiseConv*, SeparableConv*, Embedding layer or layer with "
            "get_prunable_weights() was found"
            + ("" if selection is None else " among the `layers` selected") + "."
        )
    return found


__all__ = ["PrunableWeight", "find_prunable_weights", "normalise_selection", "select_layers"]
