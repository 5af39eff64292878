"""Small helpers shared by the package: the logger and backend checks."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("keras_tpu_mem")
if not logger.handlers:
    # Users run this in notebooks where the root logger prints nothing below
    # WARNING; our one-line notices (what the strategy picked, what a callback
    # changed) are meant to be seen. Silence them with
    # logging.getLogger("keras_tpu_mem").setLevel(logging.WARNING).
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("keras_tpu_mem: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def require_tensorflow_backend(what: str) -> None:
    """Raises a clear error when Keras runs on a backend other than TensorFlow."""
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"{what} needs the Keras TensorFlow backend (tf.distribute, TPUStrategy), "
            f"but Keras is running on {backend!r}. Set KERAS_BACKEND=tensorflow "
            "before importing keras."
        )


def check_positive_int(value, name: str) -> int:
    """Returns `value` if it is an int >= 1 (bools refused), else raises naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int >= 1, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value}.")
    return value


def flatten_structure(element) -> list:
    """Leaves of a batch structure: tf.nest where TensorFlow is already loaded, else keras.tree."""
    tf = sys.modules.get("tensorflow")  # only a TensorFlow already loaded: never import it
    if tf is not None and hasattr(tf, "nest"):
        return tf.nest.flatten(element)
    import keras

    return keras.tree.flatten(element)


def leading_dim(element) -> int | None:
    """Samples in one (possibly per-replica) batch element or spec.

    Takes TensorFlow specs and tensors (`TensorShape`, unknown dimensions are
    `None`) and arrays (numpy, JAX: a `shape` tuple) alike.
    """
    leaves = flatten_structure(element) if element is not None else []
    leaf = leaves[0] if leaves else None
    if leaf is None:
        return None
    shape = getattr(leaf, "shape", None)
    if shape is None:
        # A PerReplicaSpec (distributed iterator) or a PerReplica value: the
        # global batch is the sum of the replicas' batches.
        from keras_tpu_mem._compat import tensorflow as tf_compat

        parts = tf_compat.per_replica_parts(leaf)
        if not parts:
            return None
        sizes = [leading_dim(part) for part in parts]
        return None if any(s is None for s in sizes) else sum(sizes)
    try:
        rank = shape.rank  # tf.TensorShape
    except AttributeError:
        rank = len(shape)  # a tuple: numpy, JAX
    if rank is None or rank == 0:
        return None
    dim = shape[0]
    return None if dim is None else int(dim)
