"""Rematerialization on JAX: `jax.checkpoint` recomputes whole layers as well as
activations.

Contract: as `backends/tensorflow/remat.py`.
"""

from __future__ import annotations


def check_layer_remat() -> None:
    """Nothing to refuse: whole-layer recomputation works on JAX."""


__all__ = ["check_layer_remat"]
