"""`strip_pruning`: a pruned model as ordinary layers with its sparse weights, for export."""

from __future__ import annotations

import keras


def strip_pruning(model):
    """Returns a copy of `model` for export: ordinary layers, the sparse weights.

    `ktm.Pruning` never wraps layers nor adds variables to the model, so the
    copy is a plain `keras.models.clone_model` of the trained model with its
    weights (the pruned entries exactly zero) and without the optimizer or the
    compiled training step (compile it again to evaluate or fine-tune, as after
    tfmot's `strip_pruning`). It saves to `.keras` and loads with
    `keras.saving.load_model(path)` in safe mode with no custom objects (as
    long as the original model's own layers need none).

    Args:
        model: A (pruned) `keras.Model`: Sequential, functional, or a subclassed
            model that implements `get_config`/`from_config`.

    Returns:
        A new, uncompiled `keras.Model` with the same weights.

    Example:

    ```python
    stripped = ktm.strip_pruning(model)
    stripped.save("model.keras")
    restored = keras.saving.load_model("model.keras")   # safe_mode=True
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"strip_pruning expects a keras.Model, got {type(model).__name__}.")
    if not model.built:
        raise ValueError(f"Model {model.name!r} is not built: it has no weights to strip.")
    try:
        clone = keras.models.clone_model(model)
    except Exception as err:  # subclassed models without get_config
        raise TypeError(
            f"strip_pruning could not clone {type(model).__name__} ({type(err).__name__}: "
            f"{err}). Implement get_config/from_config on the model, or save it directly: "
            "keras_tpu_mem adds no state to the model, its weights are already sparse."
        ) from err
    if not clone.built:
        shapes = getattr(model, "_build_shapes_dict", None)
        if shapes:
            clone.build(**shapes)
    clone.set_weights(model.get_weights())
    return clone


__all__ = ["strip_pruning"]
