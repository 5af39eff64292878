"""Gradient accumulation's checks on JAX, where every shape is static: the batch's
size is a Python int when the split is planned, and the split never fails later.

Contract: as `backends/tensorflow/accumulation.py`.
"""

from __future__ import annotations


def checked_count(per_replica_batch, divisor, count, message: str):
    """`count`, or a ValueError with `message` where the batch does not split."""
    if int(per_replica_batch) % divisor:
        raise ValueError(message)
    return count


def explain_split_error(error, message):
    """None: `GradientAccumulation.micro_batches` already refused a batch that does not
    split, before the step was traced."""
    return None


__all__ = ["checked_count", "explain_split_error"]
