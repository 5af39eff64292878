"""The search's sharding lever: the model state split over the data-parallel devices.

`plan(..., search=True)` under a `keras.distribution` whose batch axis spans more
than one device (JAX) also compiles each candidate with the state laid out by a
`ShardedDataParallel` over the same devices — the optimizer's slots (ZeRO-1), then
weights and slots (FSDP) — without moving the model: the candidate's layouts are
proposed to the compile (`sharding.layouts.proposed_layouts`). Least communication
first: replicated, then optimizer-sharded, then fully sharded, each from the
active distribution's own level up (a model already fully sharded is not offered
less).
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np

from keras_tpu_mem import backends
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.backends.mesh import data_parallel_size
from keras_tpu_mem.sharding.distribution import ShardedDataParallel
from keras_tpu_mem.sharding.layouts import proposed_layouts

#: State split modes, least communication first (None: replicated).
MODES = (None, "optimizer", "all")


def sharding_options(distribution) -> list:
    """`[(mode, distribution)]` for the search, least communication first.

    Args:
        distribution: The active `keras.distribution` (None: none).

    Returns:
        The active distribution at its own level, then a `ShardedDataParallel`
        per more-sharded mode over the same devices (and the same `LayoutMap`
        rules under a `ModelParallel`); only the first where the backend has
        no such lever or the batch axis spans one device.
    """
    if isinstance(distribution, ShardedDataParallel):
        own = distribution.shard
    else:
        own = None
    options = [(own, distribution)]
    if (distribution is None or not backends.current("plan").compiled.sharding_lever()
            or data_parallel_size(distribution) < 2):
        return options
    layout_map = keras_compat.distribution_layout_map(distribution)
    if layout_map is not None and not len(layout_map):
        layout_map = None
    for mode in MODES[MODES.index(own) + 1:]:
        kwargs = {"shard": mode, "axis_name": distribution.batch_dim_name}
        if layout_map is not None:
            kwargs["layout_map"] = layout_map
        else:
            kwargs["devices"] = list(np.asarray(distribution.device_mesh.devices).flat)
        if isinstance(distribution, ShardedDataParallel):
            kwargs["min_shard_bytes"] = distribution.min_shard_bytes
        options.append((mode, ShardedDataParallel(**kwargs)))
    return options


@contextlib.contextmanager
def compiling_under(model, distribution, active):
    """Compiles in the block see `model`'s state as `distribution` lays it out (the
    active one as it is)."""
    if distribution is active:
        yield
        return
    with proposed_layouts(model, distribution):
        yield


def state_bytes_under(model, distribution, active) -> tuple:
    """`(state, trainable)`: the bytes of `model`'s weights and optimizer slots, and of
    its trainable weights, that one device holds when `distribution` lays the state out
    (`active`: as it is), read from the layouts alone (nothing compiles).

    The search's lower bound: a compiled step's arguments hold the state as laid out,
    and with accumulation its temporaries hold one accumulator per trainable weight
    (`CompiledMemory.accumulator_bytes`), so no compile under that layout is smaller.

    Example:

    ```python
    for mode, distribution in sharding_options(active):
        state, trainable = state_bytes_under(model, distribution, active)
    ```
    """
    from keras_tpu_mem.planning.compiled import _device_bytes

    backend = backends.current("plan").compiled
    optimizer = getattr(model, "optimizer", None)
    with compiling_under(model, distribution, active):
        # The Compiler counts a compile's weight and optimizer bytes the same way.
        weights = _device_bytes(model.weights, backend)
        slots = _device_bytes(optimizer.variables, backend) if optimizer is not None else 0
        trainable = _device_bytes(model.trainable_weights, backend)
    return weights + slots, trainable


def active_distribution():
    """The `keras.distribution` the plan compiles under (None: none)."""
    return keras.distribution.distribution()


__all__ = ["MODES", "active_distribution", "compiling_under", "sharding_options",
           "state_bytes_under"]
