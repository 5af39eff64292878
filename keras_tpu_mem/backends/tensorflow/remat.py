"""Rematerialization on TensorFlow: which recomputation the backend can run.

Contract (same in `backends/jax/remat.py`): `check_layer_remat()` raises a
`ValueError` where recomputing whole layers (`Rematerialize(mode="layers")`)
does not work on this backend, and returns None where it does.
"""

from __future__ import annotations


def check_layer_remat() -> None:
    """Refuses whole-layer recomputation: recomputing a layer that reads variables
    crashes in TensorFlow's `fit` (keras-team/keras#21207)."""
    raise ValueError(
        "Rematerialize(mode='layers') does not work on the TensorFlow backend: "
        "recomputing a layer that reads variables crashes in fit "
        "(keras-team/keras#21207). Use mode='activations' there, or the JAX "
        "backend.")


__all__ = ["check_layer_remat"]
