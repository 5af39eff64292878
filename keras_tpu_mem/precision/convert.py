"""Models that stay bfloat16: `to_mixed_bfloat16` and `enable_mixed_bfloat16`."""

from __future__ import annotations

import keras

from keras_tpu_mem.precision.policies import (
    FLOAT32,
    LOW_PRECISION,
    MIXED_BF16,
    all_layers,
    is_graph_container,
    normalize_keep,
    plan_policies,
)

__all__ = ["enable_mixed_bfloat16", "to_mixed_bfloat16"]


def to_mixed_bfloat16(model, keep_float32=None):
    """Returns a new model computing in bfloat16, with the same weights bit for bit.

    The policy assignment is `MixedBFloat16`'s (hidden layers `mixed_bfloat16`,
    output layers and `keep_float32` layers `float32`), but built into the new
    model's config: it saves and loads as a mixed-precision model, and its
    output layers are plain float32 layers. The original model is not changed.
    The new model is not compiled: compile it as you compiled the original.

    Functional and Sequential models (nested ones too) are cloned layer by layer
    with `keras.models.clone_model`. A subclassed model is recreated from its
    config and the policies are set on its built layers, as `MixedBFloat16`
    does; they are part of a later save only if its `get_config` passes
    `dtype` on to its layers, and its output layers must be named in
    `keep_float32`.

    Args:
        model: A built Keras model.
        keep_float32: Layer names or classes to keep in float32 (see
            `MixedBFloat16`).

    Returns:
        The new model.

    Raises:
        ValueError: if `model` is not built, `keep_float32` names a layer the
            model does not have, or a subclassed model's output would not be
            float32 (its output layer is not in `keep_float32`).

    Example:

    ```python
    import numpy as np, keras
    import keras_tpu_mem as ktm

    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(3)])
    bf16 = ktm.to_mixed_bfloat16(model)
    print(bf16.layers[0].compute_dtype, bf16.layers[-1].compute_dtype)
    # bfloat16 float32
    print(bf16.predict(np.random.rand(4, 16), verbose=0).dtype)   # float32
    ```
    """
    names, types = normalize_keep(keep_float32)
    plan = plan_policies(model, names, types)
    if not model.built:
        raise ValueError(f"Model {model.name!r} is not built: call it on data or build "
                         "it with an Input before converting it.")
    target = {id(layer): MIXED_BF16 for layer in plan.bf16}
    target.update({id(layer): FLOAT32 for layer, _ in plan.float32})

    if is_graph_container(model):
        def clone_layer(layer):
            config = layer.get_config()
            if id(layer) in target:
                config["dtype"] = target[id(layer)]
            return layer.__class__.from_config(config)

        new = keras.models.clone_model(model, clone_function=clone_layer, recursive=True)
    else:
        build_config = model.get_build_config()
        if not build_config:
            raise ValueError(f"Model {model.name!r} has no build config to rebuild "
                             "it from; build it with a known input shape first.")
        new = keras.models.clone_model(model)
        new.build_from_config(build_config)
        old_layers, new_layers = all_layers(model), all_layers(new)
        if [type(a) for a in old_layers] != [type(b) for b in new_layers]:
            raise ValueError(f"The clone of {model.name!r} does not have the same layers; "
                             "its get_config/from_config do not round-trip.")
        for old, layer in zip(old_layers, new_layers):
            if id(old) in target:
                layer.dtype_policy = target[id(old)]
        _check_subclassed_output(new, build_config)
    new.set_weights(model.get_weights())
    return new


def _check_subclassed_output(model, build_config) -> None:
    """Raises if a converted subclassed model's output is not float32."""
    shape = build_config.get("input_shape")
    try:
        spec = model.compute_output_spec(keras.KerasTensor(tuple(shape)))
    except Exception as err:  # a call that needs more than one plain input
        raise ValueError(
            f"to_mixed_bfloat16 could not check the output dtype of {model.name!r} "
            f"({type(err).__name__}: {err}); convert a Functional version of the model."
        ) from err
    low = [t.dtype for t in keras.tree.flatten(spec)
           if keras.backend.standardize_dtype(t.dtype) in LOW_PRECISION]
    if low:
        raise ValueError(
            f"{type(model).__name__} is a subclassed model, whose output layers cannot "
            f"be read from a graph, and its output would be {low[0]}: name the layer "
            "that produces it in `keep_float32`, e.g. "
            "to_mixed_bfloat16(model, keep_float32=['head'])."
        )


def enable_mixed_bfloat16():
    """Sets the global policy to `mixed_bfloat16`; returns the previous policy.

    Only layers built afterwards are affected. Give the layer that produces the
    model's output `dtype="float32"` (check with `precision_report`), or convert
    an existing model with `to_mixed_bfloat16` instead.

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm

    previous = ktm.enable_mixed_bfloat16()
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(3, dtype="float32")])
    keras.config.set_dtype_policy(previous)   # back to what it was
    ```
    """
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(MIXED_BF16)
    return previous
