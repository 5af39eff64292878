"""Sharded model state on TensorFlow: not offered; each function says so, naming JAX.

`ShardedDataParallel`, `reshard` and `TPUStrategyWrapper(sharding=...)` lay
variables out with `keras.distribution`, which shards state only on the JAX
backend. On TensorFlow, `tf.distribute` owns placement (`TPUStrategy` mirrors
variables on every replica).

Contract: `keras_tpu_mem.backends.contracts.Sharding`; every function here raises
`contracts.ShardedStateUnavailable`, as callers do themselves where
`Backend.shards_state()` is False.
"""

from __future__ import annotations

from keras_tpu_mem.backends.contracts import ShardedStateUnavailable


def resolve_devices(devices) -> list:
    raise ShardedStateUnavailable("ShardedDataParallel")


def move(variable, layout) -> None:
    raise ShardedStateUnavailable("Moving a variable to a sharded layout")


def sharded_axes(variable):
    raise ShardedStateUnavailable("Reading a variable's sharding")


def device_bytes(variable) -> int:
    raise ShardedStateUnavailable("Reading a variable's per-device bytes")


__all__ = ["device_bytes", "move", "resolve_devices", "sharded_axes"]
