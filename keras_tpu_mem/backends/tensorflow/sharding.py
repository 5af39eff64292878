"""Sharded model state on TensorFlow: not offered; each function says so, naming JAX.

`ShardedDataParallel`, `reshard` and `TPUStrategyWrapper(sharding=...)` lay
variables out with `keras.distribution`, which shards state only on the JAX
backend. On TensorFlow, `tf.distribute` owns placement (`TPUStrategy` mirrors
variables on every replica).

Contract: as `backends/jax/sharding.py`, plus `refuse(what)`, the error every
caller that needs sharded state raises where `Backend.shards_state()` is False.
"""

from __future__ import annotations


def refuse(what: str) -> None:
    """Raises: sharded model state needs the JAX backend.

    Raises:
        RuntimeError: always, naming JAX and what to use on TensorFlow.
    """
    raise RuntimeError(
        f"{what} needs the JAX backend (KERAS_BACKEND=jax before importing keras): it "
        "shards weights and optimizer state with keras.distribution, which lays out "
        "state only on JAX. On TensorFlow use tf.distribute (TPUStrategy, "
        "MirroredStrategy), which keeps a whole copy of the state on every replica.")


def resolve_devices(devices) -> list:
    refuse("ShardedDataParallel")


def move(variable, layout) -> None:
    refuse("Moving a variable to a sharded layout")


def sharded_axes(variable):
    refuse("Reading a variable's sharding")


def device_bytes(variable) -> int:
    refuse("Reading a variable's per-device bytes")


__all__ = ["device_bytes", "move", "refuse", "resolve_devices", "sharded_axes"]
