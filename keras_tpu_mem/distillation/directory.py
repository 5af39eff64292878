"""The cache of a tf.data.Dataset: single examples with their logits, in a directory.

`cache_dataset` runs the teacher on each batch of a dataset (under the active
strategy, split over the replicas) and keeps `(data, logits)` single examples,
in host memory or written to a directory in parts of about `PART_BYTES` with
`tf.data.Dataset.save`, next to `METADATA_FILE` (format, version, top_k,
num_examples, parts); `load_directory` reads them back without the teacher.
What touches tf.data or tf.distribute is the backend's
(`keras_tpu_mem.tf_data`, `devices.placement`); this module is the format and the order.
"""

from __future__ import annotations

import json
import os

import keras

from keras_tpu_mem import events, tf_data
from keras_tpu_mem._utils import logger
from keras_tpu_mem.devices import placement
from keras_tpu_mem.distillation.checks import check_top_k, check_top_k_classes, single_output
from keras_tpu_mem.distillation.elements import is_cached_element, teacher_arrays
from keras_tpu_mem.distillation.loss import top_k_logits
from keras_tpu_mem.distillation.placement import copy_into_strategy, outside
from keras_tpu_mem.distillation.structure import concat, nbytes

FORMAT = "keras_tpu_mem.teacher_logits"
VERSION = 1
METADATA_FILE = "ktm_teacher_logits.json"
# Examples are written to disk in parts of about this many bytes, so that
# caching a dataset larger than host memory never holds more than one part.
PART_BYTES = 256 * 2**20

ops = keras.ops


def _teacher_fn(teacher, top_k):
    """One replica's batch of inputs -> the element's logits dict (float32 values)."""

    def replica_fn(x):
        out = single_output(teacher(x, training=False), "a teacher")
        out = ops.cast(out, "float32")
        if top_k is None:
            return teacher_arrays(out)
        check_top_k_classes(top_k, out.shape[-1], "the teacher")
        values, indices = top_k_logits(out, top_k)
        return teacher_arrays(top_k_values=values, top_k_indices=indices)

    return replica_fn


def cache_dataset(teacher, dataset, *, top_k, path):
    """`cache_teacher_logits` of a tf.data.Dataset of batches (see its docstring)."""
    data, files = tf_data.functions(), events.gfile()
    top_k = check_top_k(top_k, teacher)
    if data.is_infinite(dataset):
        raise ValueError(
            "`dataset` is infinite (e.g. `.repeat()`); cache_teacher_logits iterates it "
            "once to the end. Pass the finite dataset and repeat the result instead."
        )
    if is_cached_element(dataset.element_spec):
        raise ValueError("`dataset` already carries cached teacher logits.")
    if path is not None:
        path = os.fspath(path)
        if data.directory_in_use(path):
            raise ValueError(
                f"`path` {path!r} already exists and is not empty; choose a new directory "
                "(the cache is never overwritten)."
            )
        files.makedirs(path)
    strategy = placement.active_strategy("cache_teacher_logits")
    if strategy is not None:
        if outside(teacher, strategy):
            # As for a live teacher: each replica should read variables that
            # live where it runs. MirroredStrategy on one host's CPUs would
            # copy a foreign variable to every replica at each read (measured:
            # it works); a TPU program is not assumed to read host variables
            # at all (not verified here). So a teacher from elsewhere runs as
            # a copy made under this strategy, dropped when caching ends.
            teacher = copy_into_strategy(
                teacher, strategy, strategy, who="cache_teacher_logits",
                advice="Call cache_teacher_logits outside the strategy scope (the teacher "
                       "then runs on its own strategy), or create or load the teacher "
                       "under that `strategy.scope()`.")
    else:
        strategy = placement.training_strategy(teacher, "cache_teacher_logits")
    run = placement.replica_runner(_teacher_fn(teacher, top_k), strategy,
                                   "cache_teacher_logits")
    pending, pending_bytes, parts, total = [], 0, [], 0

    def flush():
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f"part-{len(parts):05d}"
        data.save_examples(concat(pending), os.path.join(path, name))
        parts.append(name)
        pending, pending_bytes = [], 0

    for batch in dataset:
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        logits = run(x)
        element = (data.to_numpy(batch), logits)
        total += len(next(iter(logits.values())))
        pending.append(element)
        pending_bytes += nbytes(element)
        if path is not None and pending_bytes >= PART_BYTES:
            flush()
    if total == 0:
        raise ValueError("`dataset` is empty: there is nothing to cache.")
    logger.info("cache_teacher_logits: %d examples, %s.", total,
                "all logits" if top_k is None else f"top {top_k} logits")
    if path is None:
        return data.examples_dataset(concat(pending))
    flush()
    metadata = {"format": FORMAT, "version": VERSION, "top_k": top_k,
                "num_examples": total, "parts": parts}
    with files.GFile(os.path.join(path, METADATA_FILE), "w") as f:
        json.dump(metadata, f, indent=1)
    return load_directory(path)


def load_directory(path):
    """The dataset of single `(data, logits)` examples cached in the directory `path`."""
    data, files = tf_data.functions(), events.gfile()
    meta_path = os.path.join(path, METADATA_FILE)
    if not files.exists(meta_path):
        raise ValueError(
            f"{path!r} holds no teacher-logit cache (no {METADATA_FILE}); write one with "
            "ktm.cache_teacher_logits(teacher, dataset, path=...)."
        )
    with files.GFile(meta_path, "r") as f:
        metadata = json.load(f)
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise ValueError(
            f"{meta_path!r} is not a keras_tpu_mem teacher-logit cache of version "
            f"{VERSION} (found format={metadata.get('format')!r}, "
            f"version={metadata.get('version')!r})."
        )
    return data.load_examples([os.path.join(path, name) for name in metadata["parts"]],
                                 metadata["num_examples"])


__all__ = ["FORMAT", "METADATA_FILE", "PART_BYTES", "VERSION", "cache_dataset",
           "load_directory"]
