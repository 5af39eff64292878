"""Nested structures of arrays: describing them in JSON and rebuilding them.

A cache stores `x`, `y` and `sample_weight` as they were given: an array, or a
dict / list / tuple of them (dicts by sorted key). `structure_spec` describes a
nest in JSON, `leaves` flattens it in that order and `rebuild` makes it again
from the flat arrays, so that a file read back gives the structure it was
written from.
"""

from __future__ import annotations

import keras
import numpy as np

#: The parts of a Keras data element, in their order.
DATA_PARTS = ("x", "y", "sample_weight")


def structure_spec(value):
    """A JSON description of a nest of arrays (dicts by sorted key, lists, tuples)."""
    if isinstance(value, dict):
        return {"dict": {str(k): structure_spec(value[k]) for k in sorted(value)}}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple":
                [structure_spec(v) for v in value]}
    return "array"


def leaves(value, spec):
    """The arrays of `value`, in the order `spec` (its `structure_spec`) lists them."""
    if spec == "array":
        return [value]
    if "dict" in spec:
        return [leaf for k, sub in spec["dict"].items() for leaf in leaves(value[k], sub)]
    kind = "list" if "list" in spec else "tuple"
    return [leaf for v, sub in zip(value, spec[kind]) for leaf in leaves(v, sub)]


def count_leaves(spec) -> int:
    """How many arrays the nest `spec` describes."""
    if spec == "array":
        return 1
    subs = spec["dict"].values() if "dict" in spec else spec.get("list", spec.get("tuple"))
    return sum(count_leaves(sub) for sub in subs)


def rebuild(spec, arrays):
    """The nest `spec` describes, taking its arrays from the iterator `arrays`."""
    if spec == "array":
        return next(arrays)
    if "dict" in spec:
        return {k: rebuild(sub, arrays) for k, sub in spec["dict"].items()}
    if "list" in spec:
        return [rebuild(sub, arrays) for sub in spec["list"]]
    return tuple(rebuild(sub, arrays) for sub in spec["tuple"])


def split_data(data):
    """`(parts, single)`: the `x`, `y`, `sample_weight` present, and whether `data` is bare `x`."""
    if isinstance(data, (tuple, list)):
        if not 1 <= len(data) <= 3:
            raise ValueError(
                "`dataset` given as arrays must be x, (x,), (x, y) or (x, y, sample_weight); "
                f"got a {type(data).__name__} of {len(data)} items.")
        return list(data), False
    return [data], True


def concat(parts):
    """The nests `parts` (of one structure) joined along their first axis."""
    return keras.tree.map_structure(lambda *xs: np.concatenate(xs, axis=0), *parts)


def nbytes(structure):
    """The bytes of the arrays in `structure`."""
    return sum(getattr(a, "nbytes", 0) for a in keras.tree.flatten(structure))


__all__ = ["DATA_PARTS", "concat", "count_leaves", "leaves", "nbytes", "rebuild",
           "split_data", "structure_spec"]
