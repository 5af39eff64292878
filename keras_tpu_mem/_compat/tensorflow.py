"""TensorFlow internals and Keras' TensorFlow trainer. Versions: checked on
TensorFlow 2.19.1 and 2.21.0 with Keras 3.12.0, 3.15.1 and keras-nightly
3.16.0.dev2026102704; `tests/test_compat.py` names each one."""

from __future__ import annotations


def maybe_merge_call(fn, strategy, *args):
    """A merge call from a replica context, or a plain call outside one (TF 2.19-2.21:
    `tf.__internal__.distribute.interim.maybe_merge_call`, what Keras' optimizer uses;
    the public `get_replica_context().merge_call` fails outside a replica context)."""
    import tensorflow as tf

    return tf.__internal__.distribute.interim.maybe_merge_call(fn, strategy, *args)


def reduce_per_replica(values, strategy, reduction="auto"):
    """Keras' reduction of per-replica step outputs (3.12-3.16:
    `keras.src.backend.tensorflow.trainer.reduce_per_replica`)."""
    from keras.src.backend.tensorflow.trainer import reduce_per_replica as reduce

    return reduce(values, strategy, reduction=reduction)


def make_keras_train_function(model, step_fn):
    """Keras' own multi-step train function around `step_fn` (3.12-3.16:
    `TensorFlowTrainer._make_function`), for data of unknown length."""
    return model._make_function(step_fn)


def per_replica_parts(value) -> list | None:
    """The per-replica components of a `PerReplicaSpec` or `PerReplica` value
    (TF 2.19-2.21: `PerReplicaSpec._component_specs`, `PerReplica.values`), else None."""
    parts = getattr(value, "_component_specs", None) or getattr(value, "values", None)
    if not parts or not isinstance(parts, (list, tuple)):
        return None
    return list(parts)


def dataset_shuffles(dataset) -> list[tuple[bool, bool]] | None:
    """`(seeded, reshuffles)` of each `shuffle` in the chain of datasets `dataset` is
    made of (its inputs, their inputs, ...; not datasets made inside a function such as
    an `interleave`'s); None where `dataset` is not a `tf.data.Dataset` read that way.

    TF 2.19-2.21: `DatasetV2._inputs()` and `shuffle_op._ShuffleDataset`'s `_seed`,
    `_seed2` (both 0 when neither the op nor `tf.random.set_seed` gave one: a new
    order at every run) and `_reshuffle_each_iteration`. Read from the Python objects,
    not the serialized graph, which would copy arrays the dataset holds."""
    import numpy as np

    if not callable(getattr(dataset, "_inputs", None)):
        return None
    found, pending, seen = [], [dataset], set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if type(current).__name__ == "_ShuffleDataset":
            seeds = [0 if s is None else int(np.asarray(s)) for s in (current._seed,
                                                                      current._seed2)]
            found.append((any(seeds), bool(current._reshuffle_each_iteration)))
        pending.extend(current._inputs())
    return found
