"""tf.data as user input: TensorFlow's own objects, on either Keras backend.

A `tf.data.Dataset` exists only where TensorFlow is loaded; the neutral
`keras_tpu_mem.tf_data` recognises one without importing TensorFlow and hands
the functions here to whoever reads or writes one (the distillation cache).

TensorFlow only; contract: `keras_tpu_mem.backends.contracts.Data`.
"""

from __future__ import annotations

import tensorflow as tf


def is_dataset(value) -> bool:
    return isinstance(value, tf.data.Dataset)


def is_infinite(dataset) -> bool:
    return dataset.cardinality() == tf.data.INFINITE_CARDINALITY


def to_numpy(element):
    def convert(t):
        if isinstance(t, (tf.SparseTensor, tf.RaggedTensor)):
            raise TypeError(
                "cache_teacher_logits supports datasets of dense tensors; got a "
                f"{type(t).__name__}."
            )
        return t.numpy()

    return tf.nest.map_structure(convert, element)


def examples_dataset(examples):
    return tf.data.Dataset.from_tensor_slices(examples)


def save_examples(examples, path):
    examples_dataset(examples).save(path)


def load_examples(paths, num_examples):
    dataset = None
    for path in paths:
        part = tf.data.Dataset.load(path)
        dataset = part if dataset is None else dataset.concatenate(part)
    return dataset.apply(tf.data.experimental.assert_cardinality(num_examples))


def directory_in_use(path) -> bool:
    return bool(tf.io.gfile.exists(path) and tf.io.gfile.listdir(path))


def drop_logits(dataset):
    return dataset.map(lambda data, logits: data)


def first_element(dataset):
    return next(iter(dataset.take(1)))
