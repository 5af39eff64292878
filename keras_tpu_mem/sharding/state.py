"""Where sharded state lies: which dimension of a variable is split over which axis,
and how many bytes of a model's state one device holds."""

from __future__ import annotations

from keras_tpu_mem import backends


def sharded_dim(variable, axis_name: str = "batch", *, distribution=None) -> int | None:
    """The dimension of `variable` split over the mesh axis `axis_name`, or None
    (whole along that axis: replicated over it).

    Without `distribution`, read from the value's sharding
    (`variable.value.sharding.spec`): where the state really lies. With one,
    read from the layout it gives the variable
    (`distribution.get_variable_layout(variable).axes`; a variable laid out
    by `ShardedDataParallel` or `reshard` keeps its layout), which needs no
    value: what a step being traced, whose variables hold no values, asks.

    Args:
        variable: A `keras.Variable`.
        axis_name: The mesh axis (a `ShardedDataParallel`'s `axis_name`).
        distribution: Optional `keras.distribution` to ask instead of the value.

    Example:

    ```python
    from keras_tpu_mem.sharding import sharded_dim

    sharded_dim(model.layers[0].kernel)     # 1 for a (512, 1024) kernel on 8 devices
    ```
    """
    if distribution is not None:
        layout = distribution.get_variable_layout(variable)
        axes = getattr(layout, "axes", None)
        if axes is None:  # a backend sharding: its spec
            axes = tuple(getattr(layout, "spec", None) or ())
    else:
        axes = backends.current("sharded_dim").sharding.sharded_axes(variable)
    for dim, axis in enumerate(axes or ()):
        names = axis if isinstance(axis, tuple) else (axis,)
        if axis_name in names:
            return dim
    return None


def state_bytes_per_device(model) -> dict:
    """Bytes of a model's state one device holds, read from the values' shardings.

    Returns:
        `{"weights": ..., "optimizer": ..., "total": ...}` (the most any
        device holds: every device holds the same share here).
    """
    concern = backends.current("state_bytes_per_device").sharding
    seen = set()

    def total(variables):
        count = 0
        for variable in variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                count += concern.device_bytes(variable)
        return count

    weights = total(model.weights)
    optimizer = getattr(model, "optimizer", None)
    slots = total(optimizer.variables) if optimizer is not None else 0
    return {"weights": weights, "optimizer": slots, "total": weights + slots}


__all__ = ["sharded_dim", "state_bytes_per_device"]
