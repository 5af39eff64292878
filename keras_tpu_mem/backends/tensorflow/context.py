"""The step's verbs on TensorFlow: what `StepContext` does for a feature.

`keras_tpu_mem.backends.step.StepContext` is everything a feature sees: inside
the step (the update count, writing a variable on every replica, a conditional
update, a checked condition, a float mask) and around it, for the state a
feature carries beside the model (values laid out like a weight, running
eagerly) and what the backend's step can run. Its methods are these functions;
both backends offer the same ones (the contract is
`keras_tpu_mem.backends.contracts.Context`, checked by a test).

Here a feature's state is carried in variables the engine makes from its
`init_state` (`feature_state.FeatureStates`): replica-local (sync-on-read) under the model's
strategy, read at the start of its hooks and written inside the compiled step.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_tpu_mem._compat import tensorflow as tf_compat


def update_count_dtype() -> str:
    """The dtype of `optimizer.iterations` (the step schedules get)."""
    return "int64"


def runs_tensorflow_ops() -> bool:
    """Whether a function made of TensorFlow ops (tfmot's schedules) runs in the step."""
    return True


def builds_in_step() -> bool:
    """A lazily built model (subclassed, default strategy): Keras builds its layers
    in the first trace of the step, before a feature's `after_update`."""
    return True


def compiles_with_xla(model) -> bool:
    """Whether `model`'s step is compiled by XLA (`jit_compile=True`; TPUStrategy
    always compiles)."""
    return bool(model.jit_compile) or isinstance(model.distribute_strategy,
                                                 tf.distribute.TPUStrategy)


def eagerly(fn):
    """`fn()` outside the trace (`tf.init_scope`): creates variables eagerly."""
    with tf.init_scope():
        return fn()


def ones_like(like, dtype):
    """Outside the step: all ones of `like`'s shape and `dtype`."""
    return tf.ones(tuple(like.shape), dtype=dtype)


def computed_like(like, fn, dtype):
    """Outside the step: `fn(like's value)` (keras.ops, elementwise) as `dtype`."""
    return tf.cast(fn(tf.convert_to_tensor(like.value)), dtype)


def update_count(optimizer):
    """Inside the step: the updates made so far, this one included."""
    return tf.convert_to_tensor(optimizer.iterations)


def assign(variable, value) -> None:
    """Inside the step, writes a model variable (every replica's copy): what Keras'
    optimizers do to a mirrored variable, a merge call, then
    `strategy.extended.update` on every device."""
    tf_variable = variable.value

    def merged(strategy, merged_value):
        return strategy.extended.update(tf_variable, _assign, args=(merged_value,),
                                        group=False)

    tf_compat.maybe_merge_call(merged, tf.distribute.get_strategy(), value)


def _assign(variable, value):
    return variable.assign(value)


def state_where(condition, ctx, new_state):
    """Inside the step: where `condition` holds, the feature's carriers take
    `new_state()` inside a `tf.cond` (computed and written only then); returns what
    they hold after it, which the engine then does not write again."""
    carriers = keras.tree.flatten(ctx.state_carriers)

    def update():
        for variable, value in zip(carriers, keras.tree.flatten(new_state()), strict=True):
            variable.assign(tf.cast(value, variable.dtype))
        return tf.constant(True)

    tf.cond(condition, update, lambda: tf.constant(False))
    fresh = [variable.value for variable in carriers]
    ctx.written.extend(fresh)
    return keras.tree.pack_sequence_as(ctx.state_carriers, fresh)


def checked(condition, valid, message: str, *data):
    """`condition and valid`; where `condition` holds and `valid` does not, the step
    fails with `message` and `data` (XLA drops assertions: there only the `and`)."""
    check = tf.debugging.Assert(tf.logical_or(tf.logical_not(condition), valid),
                                [message, *data])
    with tf.control_dependencies([check]):
        return tf.logical_and(condition, valid)


def masked(value, mask):
    """`value` with exact +0.0 where the float `mask` is 0, also over inf/NaN:
    `MulNoNan`, about 3x faster than the select kernel."""
    return tf.math.multiply_no_nan(value, mask)


def first_step_where(predicate, first: int, stride: int, traceable: bool = True):
    """`limit -> bool`: whether `predicate(s)` (a bool scalar) holds for some `s` in
    `first, first + stride, ...` up to `limit`. One `tf.function` with a
    `tf.while_loop` (a foreign predicate here is made of TensorFlow ops, so it is
    traced whatever `traceable` says)."""

    @tf.function(autograph=False)
    def found(limit):
        def cond(s, hit):
            return tf.logical_and(s <= limit, tf.logical_not(hit))

        def body(s, hit):
            return s + stride, predicate(s)

        _, hit = tf.while_loop(cond, body, (tf.constant(first, tf.int64),
                                            tf.constant(False)))
        return hit

    return lambda limit: bool(found(tf.constant(limit, tf.int64)))


def check_layer_remat() -> None:
    """Refuses whole-layer recomputation: recomputing a layer that reads variables
    crashes in TensorFlow's `fit` (keras-team/keras#21207)."""
    raise ValueError(
        "Rematerialize(mode='layers') does not work on the TensorFlow backend: "
        "recomputing a layer that reads variables crashes in fit "
        "(keras-team/keras#21207). Use mode='activations' there, or the JAX "
        "backend.")


def splits_batches_at_run_time() -> bool:
    """Whether a batch's split into micro-batches can fail while the step runs: a
    batch whose size only the run knows (arrays, whose last batch is smaller).
    Only then does the backend have the `batch_split` concern, which explains such
    an error."""
    return True
