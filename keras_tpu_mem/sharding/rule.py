"""Which dimension of a variable to shard over the data axis: the pure rule.

No framework here (shapes, byte sizes and axis sizes only), so the rule is
tested on every backend and the distribution, `reshard` and the strategy
wrapper's `describe` all ask the same question the same way.
"""

from __future__ import annotations

import math

#: What `ShardedDataParallel(shard=...)` accepts: every variable (FSDP / ZeRO-3),
#: only the optimizer's slots (ZeRO-1), or nothing (`DataParallel`).
SHARD_MODES = ("all", "optimizer", None)


def check_shard(shard):
    """Returns `shard` if it is one of `SHARD_MODES`, else raises naming the argument."""
    if shard not in SHARD_MODES:
        raise ValueError(f'`shard` must be "all", "optimizer" or None, got {shard!r}.')
    return shard


def check_min_shard_bytes(value) -> int:
    """Returns `value` if it is an int >= 0 (bools refused), else raises naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`min_shard_bytes` must be an int >= 0, got {value!r} "
                        f"({type(value).__name__}).")
    if value < 0:
        raise ValueError(f"`min_shard_bytes` must be an int >= 0, got {value}.")
    return value


def shard_dim(shape, itemsize: int, axis_size: int, min_shard_bytes: int = 0,
              taken=()) -> int | None:
    """The dimension of a variable to split over the data axis, or None (replicated).

    The largest dimension whose size the axis size divides (ties: the first),
    among the dimensions not in `taken` (those a user's layout already splits).
    None for a scalar, for a variable smaller than `min_shard_bytes`, where no
    free dimension divides, and on an axis of one device (nothing to split).

    Args:
        shape: The variable's shape (ints).
        itemsize: Bytes per element (4 for float32).
        axis_size: Devices on the data axis.
        min_shard_bytes: Variables of fewer bytes stay replicated.
        taken: Dimensions that are not free.

    Example:

    ```python
    from keras_tpu_mem.sharding.rule import shard_dim

    shard_dim((512, 1024), 4, 8)      # 1: the largest dimension 8 divides
    shard_dim((1024, 1024), 4, 8)     # 0: a tie goes to the first
    shard_dim((10,), 4, 8)            # None: 8 divides no dimension
    ```
    """
    shape = tuple(int(d) for d in shape)
    if axis_size <= 1 or not shape:
        return None
    if math.prod(shape) * int(itemsize) < min_shard_bytes:
        return None
    best = None
    for dim, size in enumerate(shape):
        if dim in taken or size <= 0 or size % axis_size:
            continue
        if best is None or size > shape[best]:
            best = dim
    return best


def has_divisible_dim(shape, axis_size: int, taken=()) -> bool:
    """Whether any free dimension splits over the axis (what the replicated-variables
    line reports when it does not)."""
    return shard_dim(shape, 1, axis_size, 0, taken) is not None


__all__ = ["SHARD_MODES", "check_min_shard_bytes", "check_shard", "has_divisible_dim",
           "shard_dim"]
