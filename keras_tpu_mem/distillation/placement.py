"""Where the teacher runs: on the replicas that run the student.

A teacher whose variables live outside the student's strategy (loaded before
`strategy.scope()`, or trained on another strategy) would be read across
devices at every step (on a TPU not assumed to work at all), so it runs as a
frozen copy made under that strategy. Which strategy owns a variable is the
backend's fact (`devices.placement.variable_owner`): on JAX there
is no `tf.distribute`, every variable answers None, and the teacher is always
used as it is (keras.distribution lays variables out).
"""

from __future__ import annotations

import contextlib

import keras

from keras_tpu_mem._utils import logger
from keras_tpu_mem.devices import placement


def strategy_scope(strategy):
    """`strategy.scope()`, or a context doing nothing where there is no strategy (None)."""
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def outside(model, owner):
    """Paths of the model's variables not distributed by `owner` (None: plain variables)."""
    owner_of = placement.variable_owner
    return [v.path for v in model.weights if owner_of(v) is not owner]


def student_owner(student):
    """`(True, owner)` when all the student's variables share one owner, else `(False, None)`.

    A student with mixed variables (some made under a strategy, some not) gives
    nothing sensible to compare a teacher with.
    """
    owner_of = placement.variable_owner
    owners = {id(owner_of(v)): owner_of(v) for v in student.weights}
    if len(owners) != 1:
        return False, None
    return True, next(iter(owners.values()))


def _describe_strategy(strategy):
    # The default strategy's class is private (`_DefaultDistributionStrategy`).
    name = type(strategy).__name__.lstrip("_")
    return f"{name} ({strategy.num_replicas_in_sync} replica(s))"


def copy_into_strategy(teacher, strategy, owner, *, who, advice):
    """A frozen copy of `teacher` whose variables are created under `strategy`.

    `keras.models.clone_model` (under `strategy.scope()`) rebuilds the teacher
    from its config, then its weights are assigned. Sequential and Functional
    models always clone; a subclassed model clones only through its
    `get_config()` / `from_config()`. Whatever cannot be cloned into the same
    variable structure raises: a teacher with other weights than the user's
    must never be distilled from.

    Args:
        teacher: The built teacher model.
        strategy: The strategy to copy it into.
        owner: What `variable_owner` answers for the variables of `strategy`.
        who: The API, for messages ("Distillation").
        advice: The sentence that ends the error where it cannot be copied.
    """
    where = _describe_strategy(strategy)

    def cannot(reason):
        return ValueError(
            f"{who}: the teacher {teacher.name!r} has variables outside the "
            f"{where} it must run under (e.g. {outside(teacher, owner)[0]!r}), and it "
            f"could not be copied into that strategy: {reason}. {advice}"
        )

    try:
        with strategy.scope():
            copy = keras.models.clone_model(teacher)
            build_config = teacher.get_build_config()
            if not copy.built and build_config is not None:
                copy.build_from_config(build_config)
    except Exception as error:  # whatever clone_model raises: say so, with the cause chained
        # The cause is also in the message: Keras' traceback filtering drops
        # `__cause__` when the error leaves `fit`.
        said = " ".join(str(error).split())
        said = said if len(said) <= 240 else said[:240] + "..."
        raise cannot(f"keras.models.clone_model failed ({type(error).__name__}: {said})"
                     ) from error
    if not copy.built:
        raise cannot("its clone is not built and the teacher records no input shape to "
                     "build it from")
    source, target = teacher.weights, copy.weights
    if len(source) != len(target) or any(
            tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype
            for a, b in zip(source, target)):
        raise cannot(
            f"its clone has {len(target)} variables of other shapes or dtypes than the "
            f"teacher's {len(source)} (a get_config() that does not describe the model?)")
    stray = outside(copy, owner)
    if stray:
        raise cannot(f"the clone's variable {stray[0]!r} was not created under the strategy")
    # Frozen: `trainable=False` is what Keras reads to exclude variables from
    # training; the step also calls it with training=False under stop_gradient.
    copy.trainable = False
    assign_weights(copy, teacher, strategy)
    logger.info(
        "%s: copied the teacher %r (%d variables, %d parameters) into the %s, because "
        "its variables were created outside that strategy's scope; the copy is frozen "
        "and runs in inference mode (create or load the teacher under strategy.scope() "
        "to use it as is).", who, teacher.name, len(source), teacher.count_params(), where)
    return copy


def assign_weights(copy, teacher, strategy):
    """Assigns the teacher's current weights to its copy (no new variables).

    Each value is read into host memory before entering `strategy.scope()` (a
    variable of another strategy is read as that strategy allows), one variable
    at a time, then assigned in that scope's cross-replica context, which
    writes every replica's copy.
    """
    for target, source in zip(copy.weights, teacher.weights):
        value = keras.ops.convert_to_numpy(source)
        with strategy.scope():
            target.assign(value)


__all__ = ["assign_weights", "copy_into_strategy", "outside", "strategy_scope",
           "student_owner"]
