"""Which dtype policy each layer of a model gets under bfloat16 mixed precision.

The shared core of `MixedBFloat16`, `to_mixed_bfloat16` and
`precision_report`: every layer of a built model, the layers that produce its
outputs (read back from its graph), the `keep_float32` argument, and the plan
that puts hidden layers in `mixed_bfloat16`, output and kept layers in
`float32`, and leaves alone the layers whose weights a switch would change.
"""

from __future__ import annotations

import dataclasses

import keras

from keras_tpu_mem._compat import keras as keras_compat

MIXED_BF16 = "mixed_bfloat16"
FLOAT32 = "float32"
LOW_PRECISION = ("bfloat16", "float16")
# Policies we switch: those whose variables are float32 and whose compute is a
# float type. Others ("float16", "bfloat16", "float64" variables, quantized
# policies) are left exactly as they are: switching them would change weights.
_SWITCHABLE = ("float32", "mixed_float16", "mixed_bfloat16")


def is_graph_container(layer) -> bool:
    """Functional and Sequential models: their policy does not cast anything."""
    return isinstance(layer, (keras_compat.functional_class(), keras.Sequential))


def _input_layer(layer) -> bool:
    return isinstance(layer, keras.layers.InputLayer)


def sublayers(layer) -> list:
    """Every layer inside `layer` (not itself), input layers left out."""
    return [sub for sub in keras_compat.flatten_layers(layer, include_self=False)
            if not _input_layer(sub)]


def all_layers(model) -> list:
    """Every layer of the model, depth first, the model itself first."""
    return [layer for layer in keras_compat.flatten_layers(model, include_self=True)
            if not _input_layer(layer)]


def policy_name(layer) -> str:
    """The name of the layer's dtype policy (`"mixed_bfloat16"`)."""
    return getattr(layer.dtype_policy, "name", str(layer.dtype_policy))


def _switchable(layer) -> str | None:
    """None if we may switch the layer's policy, else why not."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return "DTypePolicyMap"
    if getattr(policy, "quantization_mode", None) is not None:
        return f"quantized ({policy_name(layer)})"
    if policy_name(layer) not in _SWITCHABLE:
        return f"policy {policy_name(layer)!r}"
    return None


def output_layers(model) -> list | None:
    """The layers that produce the model's outputs, or None if unknowable.

    Walks back from each output through weightless layers (an `Activation`, a
    `Reshape`) and plain `keras.ops` calls to the first layer with weights, so
    that `Dense(10) -> Activation("softmax")` counts both: the logits are the
    Dense layer's output. Nested Functional/Sequential models on the output
    path contribute their own output layers. Subclassed models have no graph
    to read: None.
    """
    found: list = []

    def add(layer):
        if all(layer is not f for f in found):
            found.append(layer)

    def add_outputs_of(container) -> bool:
        inner = output_layers(container)
        if inner is None:
            return False
        for f in inner:
            add(f)
        return True

    def from_sequential(seq) -> bool:
        for layer in reversed([lay for lay in seq.layers if not _input_layer(lay)]):
            if is_graph_container(layer):
                return add_outputs_of(layer)
            add(layer)
            if layer.weights or sublayers(layer):
                return True
        return True

    def from_tensor(tensor) -> bool:
        history = getattr(tensor, "_keras_history", None)
        if history is None:
            return True
        op = history.operation
        if _input_layer(op):
            return True
        if is_graph_container(op):
            return add_outputs_of(op)
        is_layer = isinstance(op, keras.layers.Layer)
        if is_layer:
            add(op)
            if op.weights or sublayers(op):
                return True
        node = keras_compat.inbound_node(op, history.node_index)
        inputs = list(node.input_tensors)
        if is_layer and len(inputs) != 1:
            return True  # Add/Concatenate cast their own inputs to their policy
        return all(from_tensor(t) for t in inputs)

    if isinstance(model, keras.Sequential):
        return found if from_sequential(model) else None
    if isinstance(model, keras_compat.functional_class()):
        ok = all(from_tensor(t) for t in keras.tree.flatten(model.outputs))
        return found if ok else None
    return None


def normalize_keep(keep_float32):
    """Returns (names, types) from the `keep_float32` argument."""
    if keep_float32 is None:
        return (), ()
    items = [keep_float32] if isinstance(keep_float32, (str, type)) else keep_float32
    try:
        items = list(items)
    except TypeError:
        raise TypeError(
            "`keep_float32` must be None, a layer name (str), a layer class, or a "
            f"list of them; got {keep_float32!r} ({type(keep_float32).__name__})."
        ) from None
    names, types = [], []
    for item in items:
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, type) and issubclass(item, keras.layers.Layer):
            types.append(item)
        else:
            raise TypeError(
                "`keep_float32` entries must be layer names (str) or keras Layer "
                f"classes; got {item!r} ({type(item).__name__})."
            )
    return tuple(names), tuple(types)


@dataclasses.dataclass
class PolicyPlan:
    """Which policy each layer gets: the shared core of the callback and converter."""

    bf16: list
    float32: list  # (layer, reason)
    outputs: list | None
    unchanged: list  # (layer, why)


def plan_policies(model, names, types) -> PolicyPlan:
    """Which layers of `model` get `mixed_bfloat16`, which `float32`, and which stay.

    `names` and `types` are `keep_float32`, as `normalize_keep` returns it.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"Expected a keras.Model, got {type(model).__name__}.")
    layers = all_layers(model)
    by_name = {layer.name for layer in layers}
    missing = [name for name in names if name not in by_name]
    if missing:
        known = ", ".join(sorted(by_name))
        raise ValueError(
            f"`keep_float32` names {missing}, which are not layers of model "
            f"{model.name!r}. Its layers are: {known}."
        )
    outputs = output_layers(model)
    kept: list = []
    for layer in layers:
        if layer.name in names or (types and isinstance(layer, types)):
            kept.append(layer)
            kept.extend(sublayers(layer))
    heads: list = []
    for layer in outputs or ():
        heads.append(layer)
        heads.extend(sublayers(layer))

    def member(layer, group):
        return any(layer is other for other in group)

    plan = PolicyPlan([], [], outputs, [])
    for layer in layers:
        if is_graph_container(layer):
            continue
        why = _switchable(layer)
        if why is not None:
            plan.unchanged.append((layer, why))
        elif member(layer, kept):
            plan.float32.append((layer, "keep_float32"))
        elif member(layer, heads):
            plan.float32.append((layer, "output"))
        else:
            plan.bf16.append(layer)
    return plan


def describe_plan(plan: PolicyPlan, straight_through) -> str:
    """The log line of a plan: counts, the float32 layers and why, the unchanged ones."""
    count = len(plan.bf16)
    parts = [f"{count} layer{'s' if count != 1 else ''} compute{'s' if count == 1 else ''} "
             "in bfloat16"]
    if plan.float32:
        kept = []
        for layer, reason in plan.float32:
            note = reason
            if any(layer is s for s in straight_through):
                note += ", bfloat16 backward"
            kept.append(f"{layer.name} ({note})")
        parts.append("float32: " + ", ".join(kept))
    if plan.unchanged:
        parts.append("unchanged: " + ", ".join(f"{lay.name} ({why})"
                                               for lay, why in plan.unchanged))
    return "; ".join(parts)
