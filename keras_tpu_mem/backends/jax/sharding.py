"""Sharded model state on JAX: moving a variable to a layout, and reading where it lies.

`ShardedDataParallel` and `reshard` (`keras_tpu_mem/sharding/`) decide the
layouts; this module puts the values there. A Keras JAX variable distributes
every value assigned to it to its layout (`KerasVariable._layout`), so moving
one is: give it the new layout, then assign its value laid out that way
(`jax.device_put` onto the layout's `NamedSharding`). The value's bytes are
kept; only where they lie changes.

Contract: `keras_tpu_mem.backends.contracts.Sharding` (`backends/tensorflow/sharding.py`
raises for each, naming JAX). Callers ask `Backend.shards_state()` first.
"""

from __future__ import annotations

import math

import jax
import keras
import numpy as np

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem._compat import keras as keras_compat


def resolve_devices(devices) -> list:
    """`jax.Device`s for Keras device names (`"cpu:0"`, as `list_devices()` gives
    them) or devices, in order (through the mesh Keras would build of them)."""
    devices = np.asarray(devices, dtype=object).reshape(-1)
    mesh = keras.distribution.DeviceMesh((devices.size,), ("devices",), devices)
    return list(np.asarray(jax_compat.backend_mesh(mesh).devices).flat)


def _sharding(layout):
    return getattr(layout, "backend_layout", layout)


def move(variable, layout) -> None:
    """Lays `variable` out as `layout` (a `keras.distribution.TensorLayout`), in place.

    The variable keeps its value and from now on distributes every assigned
    value to `layout` (so a `fit`'s write-back keeps the sharding).
    """
    keras_compat.set_variable_layout(variable, layout)
    if not keras_compat.has_value(variable):
        # Deferred (`ktm.shapes_only()`): the layout is all there is to move; its value
        # is made in it later (`ktm.materialize`).
        return
    value = variable.value
    sharding = _sharding(layout)
    if getattr(value, "sharding", None) != sharding:
        if getattr(value, "is_fully_addressable", True):
            value = jax.device_put(value, sharding)
        else:
            # Several processes: each holds only its shards; a jitted identity
            # reshards the global array (every process runs it).
            value = jax.jit(lambda a: a, out_shardings=sharding)(value)
    variable.assign(value)


def sharded_axes(variable) -> tuple | None:
    """Per dimension of `variable`, the mesh axis (or tuple of axes) its value is
    split over, or None for a whole dimension; None when the value has no
    mesh sharding (one device)."""
    sharding = getattr(variable.value, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return None
    axes = tuple(spec) + (None,) * (len(variable.shape) - len(tuple(spec)))
    return tuple(tuple(a) if isinstance(a, list) else a for a in axes)


def device_bytes(variable) -> int:
    """Bytes of `variable` one device holds, from its value's sharding."""
    value = variable.value
    shape = tuple(variable.shape)
    sharding = getattr(value, "sharding", None)
    if sharding is not None:
        shape = tuple(sharding.shard_shape(shape))
    itemsize = np.dtype(keras.backend.standardize_dtype(variable.dtype)).itemsize
    return int(math.prod(shape)) * itemsize


__all__ = ["device_bytes", "move", "resolve_devices", "sharded_axes"]
