"""Pruning on TensorFlow: masks in replica-local variables, assigned inside the step.

`ktm.Pruning` (`keras_tpu_mem/pruning/callback.py`) is written once; these are
the few things that differ between the backends on the path from the schedule
to the mask inside the step. The contract (the same functions in
`backends/jax/pruning.py`):

* `STEP_DTYPE`: the dtype of `optimizer.iterations`, the step schedules get;
* `RUNS_TENSORFLOW_OPS`: whether a schedule built from TensorFlow ops (tfmot's)
  runs in this backend's step;
* `BUILDS_IN_STEP`: whether Keras builds a model still unbuilt when `fit` starts
  inside the first trace of the step (then the masks are created there, through
  `eagerly`);
* `eagerly(fn)`: runs `fn()` outside the step being traced and returns its result;
* `mask_dtype(model, variable)`: the dtype a weight's mask is stored in;
* `new_mask(model, variable)`: a new all-ones mask variable for `variable`,
  owned by the callback, never by the model;
* `derive_mask(mask, variable, from_zeros)`: outside the step, sets `mask` to
  `variable != 0` (`from_zeros`) or to all ones;
* `step_count(optimizer)`: inside the step, the updates made so far;
* `check_sparsity(should, valid, sparsity, step)`: `should and valid`, for a
  foreign schedule's sparsity (`valid`: in [0, 1));
* `update_masks(should, new_masks, masks)`: inside the step, where `should`
  holds, sets each of `masks` to the values `new_masks()` returns;
* `assign_in_step(variable, value)`: inside the step, writes a model variable
  (every replica's copy);
* `apply_float_mask(value, mask)`: `value` with exact +0.0 where the float
  `mask` is 0, also over inf/NaN;
* `step_search(prunes, first, stride, traceable)`: a function `limit -> bool`
  telling whether `prunes(s)` (a bool scalar) holds for some `s` in
  `first, first + stride, ...` up to `limit`; `traceable` says whether
  `prunes` may be compiled as one function.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_tpu_mem._compat import tensorflow as tf_compat

STEP_DTYPE = "int64"
RUNS_TENSORFLOW_OPS = True
# A lazily built model (e.g. subclassed, default strategy): Keras builds its
# layers in the first trace of the step, before `after_update`.
BUILDS_IN_STEP = True


def eagerly(fn):
    """`fn()` outside the trace (`tf.init_scope`): creates variables eagerly."""
    with tf.init_scope():
        return fn()


def mask_dtype(model, variable) -> str:
    """Bool under XLA, else the weight's dtype.

    Both give exact zeros, also where the weight is inf or NaN (`where` and
    `multiply_no_nan`). Under XLA (`jit_compile=True`; TPUStrategy always
    compiles) the masking fuses into the optimizer's update, so the 1-byte
    mask is free. Without XLA, TensorFlow's `SelectV2` kernel is about 3x
    slower than `MulNoNan` (70 vs 22 us on a 256x256 float32 kernel, 2-core
    CPU): there the mask takes the weight's dtype and masking is a multiply.
    """
    xla = bool(model.jit_compile) or isinstance(model.distribute_strategy,
                                                tf.distribute.TPUStrategy)
    return "bool" if xla else variable.dtype


def new_mask(model, variable):
    """A replica-local (sync-on-read) variable: each replica writes its own copy
    in the step (all copies are equal: same mirrored weights, same computation)."""
    with model.distribute_strategy.scope():
        return keras.Variable(
            initializer="ones", shape=tuple(variable.shape),
            dtype=mask_dtype(model, variable), trainable=False,
            synchronization="on_read", aggregation="only_first_replica",
            name="pruning_mask",
        )


def derive_mask(mask, variable, from_zeros: bool) -> None:
    value = tf.convert_to_tensor(variable.value)
    bits = tf.not_equal(value, 0) if from_zeros else tf.ones(value.shape, tf.bool)
    mask.assign(tf.cast(bits, mask.dtype))


def step_count(optimizer):
    return tf.convert_to_tensor(optimizer.iterations)


def check_sparsity(should, valid, sparsity, step):
    """A foreign schedule is only checked here. (XLA drops assertions: there an
    out-of-range sparsity keeps the previous masks instead.)"""
    check = tf.debugging.Assert(
        tf.logical_or(tf.logical_not(should), valid),
        ["Pruning: the schedule returned a sparsity outside [0, 1):", sparsity, step],
    )
    with tf.control_dependencies([check]):
        return tf.logical_and(should, valid)


def update_masks(should, new_masks, masks) -> None:
    """Assigns inside a `tf.cond`: only the pruning steps compute new masks."""

    def recompute():
        for mask, value in zip(masks, new_masks()):
            mask.assign(tf.cast(value, mask.dtype))
        return tf.constant(True)

    tf.cond(should, recompute, lambda: tf.constant(False))


def _assign(variable, value):
    return variable.assign(value)


def assign_in_step(variable, value) -> None:
    """What Keras' optimizers do to write a mirrored variable: a merge call, then
    `strategy.extended.update` on every device (as `engine.update_variable`)."""
    tf_variable = variable.value

    def merged(strategy, merged_value):
        return strategy.extended.update(tf_variable, _assign, args=(merged_value,),
                                        group=False)

    tf_compat.maybe_merge_call(merged, tf.distribute.get_strategy(), value)


def apply_float_mask(value, mask):
    """`MulNoNan`: about 3x faster than the select kernel, and exact +0.0 over inf/NaN."""
    return tf.math.multiply_no_nan(value, mask)


def step_search(prunes, first: int, stride: int, traceable: bool = True):
    """One `tf.function` with a `tf.while_loop` (a foreign schedule here is made of
    TensorFlow ops, so the search is traced whatever `traceable` says)."""

    @tf.function(autograph=False)
    def found(limit):
        def cond(s, hit):
            return tf.logical_and(s <= limit, tf.logical_not(hit))

        def body(s, hit):
            return s + stride, prunes(s)

        _, hit = tf.while_loop(cond, body, (tf.constant(first, tf.int64),
                                            tf.constant(False)))
        return hit

    return lambda limit: bool(found(tf.constant(limit, tf.int64)))
