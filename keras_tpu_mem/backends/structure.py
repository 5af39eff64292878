"""Batch structures of either backend's data: their leaves and their batch size.

A batch reaches the package as TensorFlow values (a `tf.data` element or spec,
a `PerReplica` value of a distributed iterator) or as arrays (numpy, JAX), on
either Keras backend: a JAX `fit` may iterate a `tf.data.Dataset`. These
helpers read all of them, without ever importing TensorFlow themselves.
"""

from __future__ import annotations

import sys


def flatten_structure(element) -> list:
    """Leaves of a batch structure: tf.nest where TensorFlow is already loaded, else keras.tree.

    Example:

    ```python
    flatten_structure((x, {"labels": y}))  # [x, y]
    ```
    """
    tf = sys.modules.get("tensorflow")  # only a TensorFlow already loaded: never import it
    if tf is not None and hasattr(tf, "nest"):
        return tf.nest.flatten(element)
    import keras

    return keras.tree.flatten(element)


def leading_dim(element) -> int | None:
    """Samples in one (possibly per-replica) batch element or spec: the first dimension
    of its first leaf that has one (None where no leaf has, or it is unknown).

    Takes TensorFlow specs and tensors (`TensorShape`, unknown dimensions are
    `None`), distributed values (the replicas' batches summed) and arrays (numpy,
    JAX: a `shape` tuple) alike.

    Example:

    ```python
    leading_dim((np.zeros((32, 8)), np.zeros(32)))  # 32
    ```
    """
    for leaf in flatten_structure(element) if element is not None else []:
        found, dim = _leaf_leading_dim(leaf)
        if found:
            return dim
    return None


def _leaf_leading_dim(leaf) -> tuple[bool, int | None]:
    """`(True, dim)` for a leaf with a first dimension (`dim` None: unknown), else
    `(False, None)` (a scalar, or no shape at all)."""
    shape = getattr(leaf, "shape", None)
    if shape is None:
        # A PerReplicaSpec (distributed iterator) or a PerReplica value: the
        # global batch is the sum of the replicas' batches.
        from keras_tpu_mem._compat import tensorflow as tf_compat

        parts = tf_compat.per_replica_parts(leaf)
        if not parts:
            return False, None
        sizes = [leading_dim(part) for part in parts]
        return True, None if any(s is None for s in sizes) else sum(sizes)
    try:
        rank = shape.rank  # tf.TensorShape
    except AttributeError:
        rank = len(shape)  # a tuple: numpy, JAX
    if rank is None:
        return True, None
    if rank == 0:
        return False, None
    dim = shape[0]
    return True, None if dim is None else int(dim)


__all__ = ["flatten_structure", "leading_dim"]
