"""The data-parallel axis of a `keras.distribution`: one place for its size.

Neutral (Keras' `DeviceMesh` only), so that the planner, the sharding rules,
the strategy wrapper and the JAX trainer read one answer.
"""

from __future__ import annotations


def axis_size(mesh, name: str | None) -> int:
    """Devices along the axis `name` of a Keras `DeviceMesh` (1 where it has none)."""
    names = list(mesh.axis_names)
    if name not in names:
        return 1
    return int(mesh.shape[names.index(name)])


def data_parallel_size(distribution=None) -> int:
    """Devices along the batch axis of a `keras.distribution` (1 without one).

    Args:
        distribution: A `keras.distribution.Distribution`; the active one if None.

    Returns:
        The number of data-parallel shards the global batch is split into.
    """
    if distribution is None:
        import keras

        distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    return axis_size(distribution.device_mesh, distribution.batch_dim_name)


__all__ = ["axis_size", "data_parallel_size"]
