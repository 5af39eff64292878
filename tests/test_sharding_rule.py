"""The sharding rule (no framework): which dimension of a variable splits over the data axis.

Runs on TensorFlow (the rule is backend-neutral), as do the argument checks.
"""

from __future__ import annotations

import pytest

from keras_tpu_mem.sharding.rule import (
    SHARD_MODES,
    check_min_shard_bytes,
    check_shard,
    has_divisible_dim,
    shard_dim,
)


@pytest.mark.parametrize("shape, expected", [
    ((512, 1024), 1),          # the largest dimension 8 divides
    ((1024, 512), 0),
    ((1024, 1024), 0),         # a tie goes to the first
    ((1024,), 0),
    ((16,), 0),                # the head's bias: 8 divides 16
    ((8,), 0),                 # exactly one row per device
    ((10,), None),             # 8 divides no dimension
    ((10, 24), 1),             # only the second divides
    ((3, 5, 7), None),
    ((4,), None),              # smaller than the axis
    ((), None),                # scalars (iteration, learning rate)
    ((0, 16), 1),              # an empty dimension is never the one
    ((3, 3, 64, 128), 3),      # a conv kernel: the output channels
])
def test_shard_dim_picks_the_largest_divisible_dimension(shape, expected):
    assert shard_dim(shape, 4, 8) == expected


def test_min_shard_bytes_keeps_small_variables_whole():
    assert shard_dim((1024,), 4, 8, min_shard_bytes=4096) == 0          # 4096 bytes: split
    assert shard_dim((1024,), 4, 8, min_shard_bytes=4097) is None
    assert shard_dim((1024,), 2, 8, min_shard_bytes=4096) is None       # bf16: 2048 bytes


def test_taken_dimensions_are_not_free():
    assert shard_dim((1024, 512), 4, 2, taken={0}) == 1
    assert shard_dim((1024, 10), 4, 8, taken={0}) is None
    assert has_divisible_dim((1024, 10), 8) and not has_divisible_dim((1024, 10), 8, taken={0})


def test_an_axis_of_one_device_splits_nothing():
    assert shard_dim((1024, 1024), 4, 1) is None


def test_argument_checks_name_the_argument_and_the_accepted_values():
    assert SHARD_MODES == ("all", "optimizer", None)
    for mode in SHARD_MODES:
        assert check_shard(mode) == mode
    with pytest.raises(ValueError, match=r'`shard` must be "all", "optimizer" or None'):
        check_shard("zero3")
    assert check_min_shard_bytes(0) == 0
    with pytest.raises(ValueError, match="`min_shard_bytes` must be an int >= 0"):
        check_min_shard_bytes(-1)
    with pytest.raises(TypeError, match="`min_shard_bytes` must be an int >= 0"):
        check_min_shard_bytes(1.5)
    with pytest.raises(TypeError, match="`min_shard_bytes`"):
        check_min_shard_bytes(True)
