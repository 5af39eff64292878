"""Distillation on TensorFlow: tf.distribute placement and the tf.data cache.

Contract (same functions in `backends/jax/distillation.py`):

* `model_strategy(model)`: the strategy the model's variables are made under
  (None where there is none).
* `variable_owner(variable)`: the strategy a (Keras) variable is distributed
  by, None for a plain variable.
* `active_strategy()`: the strategy whose scope is entered, None outside any.
* `replica_runner(fn, strategy)`: `call(x) -> dict of numpy arrays`, running
  `fn` (a batch of inputs -> dict of tensors, per example) compiled on every
  replica of `strategy`, each on its slice of the batch, results in batch order.
* tf.data as user input: `is_dataset(value)`, `is_infinite(dataset)`,
  `to_numpy(element)` (a nest of numpy arrays; TypeError for sparse or ragged
  tensors), `examples_dataset(examples)` (a dataset of the nest's first-axis
  slices), `save_examples(examples, path)`, `load_examples(paths,
  num_examples)` (the saved parts, in order, as one dataset),
  `directory_in_use(path)` (exists and is not empty), `drop_logits(dataset)`
  (`(data, logits)` elements -> `data`), `first_element(dataset)`.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf


def model_strategy(model):
    return model.distribute_strategy


def variable_owner(variable):
    # The TensorFlow variable behind a Keras variable.
    tf_var = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(tf_var, tf.distribute.DistributedValues):
        return tf_var.distribute_strategy
    return None


def active_strategy():
    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


def replica_runner(fn, strategy):
    replicas = strategy.num_replicas_in_sync

    @tf.function(reduce_retracing=True, autograph=False)
    def run(per_replica_x):
        return strategy.run(fn, args=(per_replica_x,))

    def call(x):
        size = int(tf.shape(tf.nest.flatten(x)[0])[0])
        per = -(-size // replicas)
        pad = per * replicas - size

        def padded(t):
            t = tf.convert_to_tensor(t)
            if pad:
                t = tf.concat([t, tf.repeat(t[-1:], pad, axis=0)], axis=0)
            return t

        x = tf.nest.map_structure(padded, x)
        if replicas == 1:
            per_replica = x
        else:
            per_replica = strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.nest.map_structure(
                    lambda t: t[ctx.replica_id_in_sync_group * per:
                                (ctx.replica_id_in_sync_group + 1) * per], x))
        outputs = run(per_replica)
        # Replica results in replica order: the order of the batch's slices.
        return {k: np.concatenate([t.numpy() for t in strategy.experimental_local_results(v)],
                                  axis=0)[:size]
                for k, v in outputs.items()}

    return call


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
