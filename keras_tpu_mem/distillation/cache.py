"""The cache API: run the teacher once, train the student from its logits.

`cache_teacher_logits` takes arrays (any backend: a `TeacherLogits` PyDataset,
saved as `.npz`, see `arrays`) or a tf.data.Dataset of batches (TensorFlow: a
dataset of single examples, saved as a directory, see `directory`);
`load_teacher_logits` reads either back without the teacher;
`strip_teacher_logits` and `prepare_student` serve the student's `fit`.
"""

from __future__ import annotations

import os

import keras

from keras_tpu_mem import tf_data
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.devices import placement
from keras_tpu_mem.distillation.arrays import cache_arrays
from keras_tpu_mem.distillation.checks import ends_in_probabilities
from keras_tpu_mem.distillation.directory import cache_dataset, load_directory
from keras_tpu_mem.distillation.elements import is_cached_element
from keras_tpu_mem.distillation.npz import SUFFIX as NPZ_SUFFIX
from keras_tpu_mem.distillation.npz import read as read_npz
from keras_tpu_mem.distillation.placement import strategy_scope
from keras_tpu_mem.distillation.teacher_logits import TeacherLogits


def cache_teacher_logits(teacher, dataset, *, batch_size: int = 32,
                         top_k: int | None = None, path: str | os.PathLike | None = None):
    """Runs the teacher once and returns the examples with its logits attached.

    **Arrays** (any backend, no TensorFlow needed): `dataset` is `x`, `(x,)`,
    `(x, y)` or `(x, y, sample_weight)` of numpy arrays or backend tensors
    (`x` may be a dict or tuple of arrays). The teacher runs once with
    `teacher.predict(x, batch_size=batch_size)` (in inference mode, under the
    active `keras.distribution` on JAX, else on the default device; the input
    is padded to a multiple of `batch_size` for that, then cropped). Returned:
    a `TeacherLogits`, a `keras.utils.PyDataset` yielding batches of
    `batch_size` examples **in the input order** (the last may be smaller),
    each `(data_batch, logits_batch)` in the element structure below; pass it
    to `fit` as it is. With `path` (a file name ending in `.npz`) the examples
    and logits are also written there in the documented npz format
    (docs/distillation.md), which `load_teacher_logits(path)` reads on either
    backend.

    **A tf.data.Dataset** (TensorFlow): the teacher runs in inference mode
    (`training=False`) under the current strategy (the one whose scope is
    active, else the teacher's), each batch split over the replicas. A teacher
    whose variables live outside the active strategy runs as a copy made under
    it (as for `Distillation`; logged), kept only while caching. Every
    returned element is `(data, logits)`:
    `data` is the input element unchanged and `logits` a dict of the teacher's
    float32 logits (all classes, or the `top_k` largest values and their
    indices). Because the logits sit inside each element, shuffling and
    re-batching the result keeps them with their examples. Train the student
    with `Distillation()` (no teacher) on it.

    The returned dataset holds **single examples** (the input's batches are
    split): shuffle and batch it as you would the original examples, e.g.
    `tpu.distribute(cached.shuffle(n), global_batch_size)`.

    Without `path` the examples and logits are kept in host memory. With
    `path` they are written there (in parts of about 256 MiB, with
    `tf.data.Dataset.save`) and the returned dataset reads them back from disk;
    a later run, on another machine, calls `load_teacher_logits(path)` and
    never loads the teacher.

    If the student was created under a strategy scope and has not been trained
    yet, call `prepare_student(student, batched_cached_dataset)` before its first
    `fit` (Keras builds such a model from the raw first batch before any
    callback runs).

    Args:
        teacher: A built `keras.Model` with one logits output.
        dataset: Arrays `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)` (see
            above), or a finite `tf.data.Dataset` of **batches** (`x`, `(x, y)`
            or `(x, y, sample_weight)`, as passed to `fit`), iterated once.
        batch_size: With arrays: the teacher's predict batch and the batch the
            returned PyDataset yields (an int >= 1; under `DataParallel` a
            multiple of the device count). Ignored for a dataset (its own
            batches are used).
        top_k: `None` to keep all logits, or how many of the largest to keep
            (with their class indices): k/classes of the storage.
        path: Optional place to save the cache: with arrays a `.npz` file that
            does not exist yet; with a dataset a directory that does not exist
            yet or is empty.

    Returns:
        With arrays, a `TeacherLogits` PyDataset of `(data, logits)` batches;
        with a dataset, a `tf.data.Dataset` of `(data, logits)` single examples.

    Example:

    ```python
    # Arrays, on any backend: batches in order, ready for fit.
    cached = ktm.cache_teacher_logits(teacher, (x, y), batch_size=64, path="logits.npz")
    student.fit(cached, epochs=3, callbacks=[ktm.Distillation()])
    cached = ktm.load_teacher_logits("logits.npz")        # later, without the teacher

    # A tf.data pipeline (TensorFlow):
    cached = ktm.cache_teacher_logits(teacher, train_ds.batch(256), path="gs://bucket/logits")
    # later, anywhere, without the teacher:
    cached = ktm.load_teacher_logits("gs://bucket/logits")
    student.fit(cached.shuffle(10_000).batch(128), callbacks=[ktm.Distillation()])
    ```
    """
    if not isinstance(teacher, keras.Model):
        raise TypeError(f"`teacher` must be a keras.Model, got {type(teacher).__name__}.")
    if not teacher.built:
        raise ValueError(
            "The teacher is not built (it has no trained weights). Build or load it first."
        )
    which = ends_in_probabilities(teacher)
    if which:
        raise ValueError(
            f"The teacher's last layer applies {which}: cache_teacher_logits needs logits. "
            "Remove the final activation."
        )
    if not tf_data.is_training_dataset(dataset):
        return cache_arrays(teacher, dataset, batch_size=batch_size, top_k=top_k, path=path)
    return cache_dataset(teacher, dataset, top_k=top_k, path=path)


def load_teacher_logits(path: str | os.PathLike, *, batch_size: int | None = None):
    """Reads a cache written by `cache_teacher_logits(..., path=...)`, without the teacher.

    Args:
        path: The `.npz` file (cached from arrays; readable on any backend) or
            the directory (cached from a tf.data.Dataset; TensorFlow) given to
            `cache_teacher_logits`.
        batch_size: For a `.npz` cache: the batch the PyDataset yields
            (default: the one it was cached with). Not used for a directory.

    Returns:
        For a `.npz` file, a `TeacherLogits` PyDataset of `(data, logits)`
        batches in the cached order; for a directory, a `tf.data.Dataset` of
        `(data, logits)` single examples, in the order they were cached
        (shuffle it for training).

    Raises:
        ValueError: if `path` holds no teacher-logit cache.

    Example:

    ```python
    cached = ktm.load_teacher_logits("/data/digits_logits")
    student.fit(cached.shuffle(2048).batch(64), callbacks=[ktm.Distillation(temperature=4.0)])
    ```
    """
    path = os.fspath(path)
    if path.endswith(NPZ_SUFFIX) or os.path.isfile(path):
        data, logits, cached_batch_size = read_npz(path)
        return TeacherLogits(data, logits, cached_batch_size if batch_size is None
                             else batch_size)
    if batch_size is not None:
        raise ValueError(
            "`batch_size` applies to a .npz cache only; a directory cache holds single "
            "examples: batch the returned dataset instead.")
    return load_directory(path)


def strip_teacher_logits(dataset):
    """The dataset without its cached logits (the original elements).

    Args:
        dataset: A `tf.data.Dataset` from `cache_teacher_logits` /
            `load_teacher_logits`, or a `TeacherLogits` PyDataset (then a
            PyDataset of the original batches is returned).
    """
    if isinstance(dataset, TeacherLogits):
        return dataset.without_logits()
    if not is_cached_element(dataset.element_spec):
        raise ValueError("`dataset` carries no cached teacher logits.")
    return tf_data.functions().drop_logits(dataset)


def prepare_student(student, dataset) -> None:
    """Builds a student made under a strategy scope before its first fit on cached logits.

    Keras builds a model created inside `strategy.scope()` (its compiled loss
    and metrics) from the first batch of the data, *before* any callback runs,
    and would take the cached logits for part of the data. This does that build
    from the first batch of `dataset` without them; afterwards `fit` does not
    rebuild. A `TeacherLogits` (the array cache) gives that build its first
    batch without the logits by itself, so on JAX (whose `fit` always builds
    first) and on TensorFlow outside a strategy scope its students need no
    preparation, unless it reads its batches in other threads (`workers` > 1).
    On TensorFlow a student created outside any strategy scope, or one that
    has already been trained or evaluated, needs none either. Calling this is
    always harmless.

    Args:
        student: The compiled student model.
        dataset: The **batched** cached dataset you will pass to `fit`.

    Example:

    ```python
    with tpu.scope():
        student = build_student()
        student.compile(optimizer="adam", loss=loss)
    train = tpu.distribute(ktm.load_teacher_logits(path).shuffle(50_000), 1024)
    ktm.prepare_student(student, train)
    student.fit(train, callbacks=[ktm.Distillation()])
    ```
    """
    if not isinstance(student, keras.Model):
        raise TypeError(f"`student` must be a keras.Model, got {type(student).__name__}.")
    if isinstance(dataset, TeacherLogits):
        batch = dataset.without_logits()[0]
        strategy = placement.training_strategy(student, "prepare_student")
        with strategy_scope(strategy):
            keras_compat.symbolic_build(student, batch)
        return
    if (not tf_data.is_training_dataset(dataset)
            or not is_cached_element(dataset.element_spec)):
        raise ValueError(
            "`dataset` must be the batched tf.data.Dataset of cached teacher logits you "
            "will pass to fit (from cache_teacher_logits / load_teacher_logits)."
        )
    batch = tf_data.functions().first_element(strip_teacher_logits(dataset))
    with strategy_scope(placement.training_strategy(student, "prepare_student")):
        keras_compat.symbolic_build(student, batch)


__all__ = [
    "cache_teacher_logits",
    "load_teacher_logits",
    "prepare_student",
    "strip_teacher_logits",
]
