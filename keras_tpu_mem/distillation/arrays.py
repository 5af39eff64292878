"""The cache of arrays: the teacher's `predict` once, kept as a `TeacherLogits`.

Works on every Keras backend (numpy and `keras.ops` only): the examples are
read as numpy arrays, the teacher runs with `teacher.predict` over whole
batches, and the logits (all, or the top k by a stable sort) are kept in the
input order, optionally written to a `.npz` file (`npz`).
"""

from __future__ import annotations

import keras
import numpy as np

from keras_tpu_mem._utils import logger
from keras_tpu_mem.distillation.checks import check_batch_size, check_top_k, single_output
from keras_tpu_mem.distillation.elements import teacher_arrays
from keras_tpu_mem.distillation.npz import new_path as new_npz_path
from keras_tpu_mem.distillation.structure import DATA_PARTS, split_data
from keras_tpu_mem.distillation.teacher_logits import TeacherLogits

ops = keras.ops


def _numpy_nest(value, where):
    try:
        return keras.tree.map_structure(lambda a: np.asarray(ops.convert_to_numpy(a)), value)
    except Exception as err:
        raise TypeError(
            f"`dataset` must be a tf.data.Dataset or arrays (numpy arrays or tensors); its "
            f"{where} could not be read as arrays ({type(err).__name__}: {err})."
        ) from err


def cache_arrays(teacher, data, *, batch_size, top_k, path):
    """`cache_teacher_logits` of arrays: a `TeacherLogits` (see its docstring)."""
    batch_size = check_batch_size(batch_size)
    top_k = check_top_k(top_k, teacher)
    if path is not None:
        path = new_npz_path(path)
    parts, single = split_data(data)
    parts = [_numpy_nest(p, name) for p, name in zip(parts, DATA_PARTS)]
    data = parts[0] if single else tuple(parts)
    bad = [np.shape(a) for a in keras.tree.flatten(parts)
           if np.ndim(a) == 0 or np.asarray(a).dtype == object]
    if bad:
        raise TypeError(
            "`dataset` must be a tf.data.Dataset or arrays with a leading example axis "
            f"(x, (x, y) or (x, y, sample_weight)); got an array of shape {bad[0]} or "
            "of objects.")
    x = parts[0]
    sizes = {len(leaf) for leaf in keras.tree.flatten(data)}
    if len(sizes) != 1:
        raise ValueError(f"`dataset` arrays must all hold the same number of examples; got "
                         f"lengths {sorted(sizes)}.")
    size = sizes.pop()
    if size == 0:
        raise ValueError("`dataset` is empty: there is nothing to cache.")
    # Padded to whole batches (the last example repeated, then cropped): under
    # a DataParallel distribution every predict batch must divide by the
    # devices, which a partial last batch would not.
    pad = -size % batch_size
    if pad:
        x_in = keras.tree.map_structure(
            lambda a: np.concatenate([a, np.repeat(a[-1:], pad, axis=0)]), x)
    else:
        x_in = x
    logits = single_output(teacher.predict(x_in, batch_size=batch_size, verbose=0),
                           "a teacher")
    logits = np.asarray(ops.convert_to_numpy(ops.cast(logits, "float32")))[:size]
    if top_k is None:
        extras = teacher_arrays(logits)
    else:
        # A stable descending sort: among equal logits the lower class first,
        # as tf.math.top_k / jax.lax.top_k order them.
        indices = np.argsort(-logits, axis=-1, kind="stable")[..., :top_k].astype(np.int32)
        extras = teacher_arrays(top_k_values=np.take_along_axis(logits, indices, axis=-1),
                                top_k_indices=indices)
    cached = TeacherLogits(data, extras, batch_size)
    logger.info("cache_teacher_logits: %d examples, %s.", size,
                "all logits" if top_k is None else f"top {top_k} logits")
    if path is not None:
        cached.save(path)
    return cached


__all__ = ["cache_arrays"]
