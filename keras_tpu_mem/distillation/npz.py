"""The `.npz` file of a cache made from arrays (version 1; see docs/distillation.md).

One numpy `.npz` archive, which `np.load(path, allow_pickle=False)` reads on any
machine: the data parts (`x`, `y`, `sample_weight`; a nest stored as `x_0,
x_1, ...` in the order `metadata.structures` describes), the teacher's arrays
(`logits`, or `top_k_values` and `top_k_indices`) and `metadata`, a 0-d unicode
array holding JSON (format, version, num_examples, batch_size, top_k,
single_x, structures).
"""

from __future__ import annotations

import json
import os

import numpy as np

from keras_tpu_mem.distillation.elements import (
    LOGITS_KEY,
    TOP_K_INDICES_KEY,
    TOP_K_VALUES_KEY,
    teacher_arrays,
)
from keras_tpu_mem.distillation.structure import (
    DATA_PARTS,
    count_leaves,
    leaves,
    rebuild,
    split_data,
    structure_spec,
)

FORMAT = "keras_tpu_mem.teacher_logits.npz"
VERSION = 1
SUFFIX = ".npz"
METADATA = "metadata"  # a 0-d unicode array holding the JSON metadata
# The element's keys by the names of their arrays in the file.
_ARRAYS = {LOGITS_KEY: "logits", TOP_K_VALUES_KEY: "top_k_values",
           TOP_K_INDICES_KEY: "top_k_indices"}


def new_path(path):
    """`path` as a string, refused unless it names a `.npz` file that does not exist yet."""
    path = os.fspath(path)
    if not path.endswith(SUFFIX):
        raise ValueError(
            f"`path` {path!r}: a cache of arrays is one .npz file; give a name ending in "
            "'.npz' (a directory is for caching a tf.data.Dataset).")
    if os.path.exists(path):
        raise ValueError(f"`path` {path!r} already exists; the cache is never overwritten.")
    return path


def write(path, data, logits, *, batch_size, top_k):
    """Writes the examples `data` and the dict `logits` of teacher arrays to `path`.

    Args:
        path: A `.npz` file name that does not exist yet.
        data: `x` or a tuple `(x[, y[, sample_weight]])` of numpy nests.
        logits: The element's logits dict (keys of `elements`), per example.
        batch_size: The batch recorded for reading back.
        top_k: The k of a top-k cache, None for all logits.
    """
    path = new_path(path)
    parts, single = split_data(data)
    arrays, structures = {}, {}
    for name, value in zip(DATA_PARTS, parts):
        spec = structure_spec(value)
        structures[name] = spec
        flat = leaves(value, spec)
        if spec == "array":
            arrays[name] = flat[0]
        else:
            arrays.update({f"{name}_{i}": leaf for i, leaf in enumerate(flat)})
    arrays.update({_ARRAYS[k]: v for k, v in logits.items()})
    num_examples = len(next(iter(logits.values())))
    metadata = {"format": FORMAT, "version": VERSION,
                "num_examples": num_examples, "batch_size": batch_size,
                "top_k": top_k, "single_x": single, "structures": structures}
    arrays[METADATA] = np.array(json.dumps(metadata))
    # Through a file object: np.savez would append ".npz" to a name without it.
    with open(path, "xb") as f:
        np.savez(f, **arrays)


def read(path):
    """`(data, logits, batch_size)` read from the `.npz` cache `path`.

    Raises:
        ValueError: `path` does not exist or is not a cache of this version.
    """
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} does not exist: no teacher-logit cache to load.")
    with np.load(path, allow_pickle=False) as f:
        if METADATA not in f.files:
            raise ValueError(f"{path!r} is not a keras_tpu_mem teacher-logit cache "
                             f"(no {METADATA!r} entry).")
        metadata = json.loads(str(f[METADATA]))
        if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
            raise ValueError(
                f"{path!r} is not a keras_tpu_mem teacher-logit cache of version "
                f"{VERSION} (found format={metadata.get('format')!r}, "
                f"version={metadata.get('version')!r}).")
        arrays = {name: f[name] for name in f.files if name != METADATA}
    parts = []
    for name in DATA_PARTS:
        spec = metadata["structures"].get(name)
        if spec is None:
            break
        if spec == "array":
            parts.append(arrays[name])
        else:
            count = count_leaves(spec)
            parts.append(rebuild(spec, iter(arrays[f"{name}_{i}"] for i in range(count))))
    data = parts[0] if metadata["single_x"] else tuple(parts)
    if "logits" in arrays:
        logits = teacher_arrays(arrays["logits"])
    else:
        logits = teacher_arrays(top_k_values=arrays["top_k_values"],
                                top_k_indices=arrays["top_k_indices"])
    return data, logits, metadata["batch_size"]


__all__ = ["FORMAT", "SUFFIX", "VERSION", "new_path", "read", "write"]
