"""What a backend's trainer and the engine both read: the step's context and checks.

The engine (`keras_tpu_mem.engine`) builds its step with the running backend's
trainer (`backends/<name>/trainer.py`), which must not import the engine (the
engine imports this package). What both need lives here, backend-neutral:
the context a feature sees inside the step, the name of the micro-batch split,
and the settings check of micro-batches pulled from the data.
"""

from __future__ import annotations

#: The name of the reshape that splits a batch into micro-batches on TensorFlow
#: (features recognise it in XLA's errors); here so that importing it needs no TensorFlow.
MICRO_BATCH_SPLIT = "ktm_micro_batch_split"


class StepContext:
    """Everything a feature sees: the step's values, and the verbs that write state.

    Inside the compiled step (one replica, one micro-batch) the engine hands one
    to `transform_loss` and `after_update`; around the step (a feature's
    `install`, a resume) `StepContext.outside(model)` gives the same verbs
    without a batch. The verbs are the running backend's
    (`backends/<name>/context.py`, contract `backends.contracts.Context`): a
    feature never asks which backend runs.

    Attributes:
        model: The model being trained.
        x, y, sample_weight: The (micro-)batch as Keras unpacked it.
        y_pred: The model output for `x` (inside the gradient computation).
        extras: Dict of extra per-example tensors from `split_extras`.
        num_micro_batches: How many micro-batches make this update (1 without
            accumulation).
        quiet: True in a step compiled for the updates that every feature with state
            said leave it as it is (`Feature.quiet_update`): its `after_update` must
            then return its state unchanged (the JAX engine checks).
        state: The state of the feature whose hook runs (what its `init_state` made,
            as the last step left it; None for a feature without state). The engine
            sets it before each feature's `transform_loss` and `after_update`.

    Example (a feature's loss term reads the batch; an update writes a weight and
    returns the feature's new state, a count of the clipped entries):

    ```python
    def transform_loss(self, loss, ctx):
        return loss + 0.1 * keras.ops.mean(keras.ops.square(ctx.y_pred))

    def init_state(self, ctx):
        return (keras.ops.zeros((), "int32"),)

    def after_update(self, ctx):
        kernel = ctx.model.layers[0].kernel
        clipped = keras.ops.sum(keras.ops.cast(keras.ops.abs(kernel.value) > 1, "int32"))
        ctx.assign(kernel, keras.ops.clip(kernel.value, -1.0, 1.0))
        return (ctx.state[0] + clipped,)
    ```
    """

    def __init__(self, model, x=None, y=None, sample_weight=None, y_pred=None,
                 extras=None, num_micro_batches=1, quiet=False, state=None):
        self.model = model
        self.x = x
        self.y = y
        self.sample_weight = sample_weight
        self.y_pred = y_pred
        self.extras = extras or {}
        self.num_micro_batches = num_micro_batches
        self.quiet = quiet
        self.state = state
        #: The backend's holders of `state` where it keeps them in variables
        #: (TensorFlow), set with `state` by the engine; None on JAX.
        self.state_carriers = None
        #: Values `state_where` made from the carriers it wrote (TensorFlow): the
        #: engine does not write them again.
        self.written = []
        self._verbs = _running_context()

    @classmethod
    def outside(cls, model=None) -> StepContext:
        """The verbs around the step (no batch): for a feature's set-up and resume."""
        return cls(model)

    # ------------------------------------------------------------ the backend's step
    @property
    def backend_label(self) -> str:
        """How messages name the running backend ("TensorFlow", "JAX")."""
        from keras_tpu_mem import backends

        return backends.current().label

    def update_count_dtype(self) -> str:
        """The dtype of `optimizer.iterations`, the step a schedule gets."""
        return self._verbs.update_count_dtype()

    def runs_tensorflow_ops(self) -> bool:
        """Whether a function made of TensorFlow ops (tfmot's schedules) runs in the step."""
        return self._verbs.runs_tensorflow_ops()

    def builds_in_step(self) -> bool:
        """Whether Keras builds a model still unbuilt at `fit` inside the step's first
        trace (then a feature makes its state there, through `eagerly`)."""
        return self._verbs.builds_in_step()

    def compiles_with_xla(self) -> bool:
        """Whether the model's step is an XLA program."""
        return self._verbs.compiles_with_xla(self.model)

    def check_layer_remat(self) -> None:
        """Raises a `ValueError` where recomputing whole layers does not work."""
        self._verbs.check_layer_remat()

    def explain_split_error(self, error, message):
        """Where `error` is the failed split of a batch into micro-batches, an error of
        the same kind saying `message()` first; else None (always, on a backend whose
        step never splits a batch it does not know the size of)."""
        if not self._verbs.splits_batches_at_run_time():
            return None
        from keras_tpu_mem import backends

        return backends.current().batch_split.explain_split_error(error, message)

    # ------------------------------------------------------------ a feature's state
    def eagerly(self, fn):
        """`fn()` outside the step being traced (to create state inside a first trace)."""
        return self._verbs.eagerly(fn)

    def ones_like(self, like, dtype):
        """Outside the step: an all-ones value of `like`'s shape (a variable) and
        `dtype`, laid out like its value (for a feature's `init_state`)."""
        return self._verbs.ones_like(like, dtype)

    def computed_like(self, like, fn, dtype):
        """Outside the step: `fn(like's value)` as `dtype`, computed where the value
        lives (`fn`: elementwise keras.ops, a module-level function)."""
        return self._verbs.computed_like(like, fn, dtype)

    # ------------------------------------------------------------ inside the step
    def update_count(self):
        """The updates made so far, this one included (after the optimizer's update)."""
        return self._verbs.update_count(self.model.optimizer)

    def assign(self, variable, value) -> None:
        """Writes the model's `variable` on every replica."""
        self._verbs.assign(variable, value)

    def state_where(self, condition, new_state):
        """This feature's state where `condition` holds: `new_state()` (computed only
        then), else `ctx.state` as it came; return it from `after_update`."""
        return self._verbs.state_where(condition, self, new_state)

    def checked(self, condition, valid, message: str, *data):
        """`condition and valid`; where the backend can assert in the step (TensorFlow
        without XLA), a `valid` that fails where `condition` holds stops the step with
        `message` and `data`."""
        return self._verbs.checked(condition, valid, message, *data)

    def masked(self, value, mask):
        """`value` with exact +0.0 where the (float) `mask` is 0, also over inf/NaN."""
        return self._verbs.masked(value, mask)

    def first_step_where(self, predicate, first: int, stride: int, traceable: bool = True):
        """`limit -> bool`: whether `predicate(s)` holds for some `s` in `first, first +
        stride, ...` up to `limit` (`traceable`: `predicate` may be compiled)."""
        return self._verbs.first_step_where(predicate, first, stride, traceable)


def _running_context():
    """The running backend's verbs (`backends/<name>/context.py`)."""
    from keras_tpu_mem import backends

    return backends.current("keras_tpu_mem's step").context


def check_state_replacement(feature, held, state) -> None:
    """Refuses a state given to `feature` between steps (`Engine.set_feature_state`)
    that is not structured or shaped as the one it `held`.

    Raises:
        ValueError: Another structure, or a value of another shape.
    """
    import keras
    import numpy as np

    try:
        keras.tree.assert_same_structure(held, state)
    except (ValueError, TypeError) as err:
        raise ValueError(
            f"The state given to {type(feature).__name__} is not structured as the one "
            f"it holds: {err}") from err
    for old, new in zip(keras.tree.flatten(held), keras.tree.flatten(state)):
        if tuple(np.shape(new)) != tuple(old.shape):
            raise ValueError(
                f"The state given to {type(feature).__name__} has a value of shape "
                f"{tuple(np.shape(new))} where it holds {tuple(old.shape)}.")


def micro_batch_count(features, per_replica_batch) -> int:
    """The micro-batches one update's batch is split into: the first count a feature
    gives (at most one feature gives one; the engine checks), else 1.

    Args:
        features: The step's features, in step order.
        per_replica_batch: The per-replica batch (a Python int), or None where only
            the run knows it (then a count only where a feature fixes it).
    """
    for feature in features:
        count = feature.micro_batches(per_replica_batch)
        if count is not None:
            return count
    return 1


def batches_per_update(features) -> int:
    """Dataset batches (micro-batches) per optimizer update: the first count a feature
    gives (`Feature.batches_per_update`; at most one feature gives one), else 1."""
    for feature in features:
        count = feature.batches_per_update()
        if count is not None:
            return count
    return 1


def check_pulled_micro_batches(model, k: int) -> None:
    """The settings `GradientAccumulation(k, dataset_yields="micro_batches")` needs,
    checked alike by both trainers: a built model, and a `steps_per_execution`
    (counted in micro-batches, Keras' unit) that divides or is a multiple of k."""
    spe = int(model.steps_per_execution)
    if spe % k and k % spe:
        raise ValueError(
            f"GradientAccumulation(steps={k}, dataset_yields='micro_batches') with "
            f"steps_per_execution={spe}: one must divide the other (steps_per_execution "
            "counts micro-batches here, Keras' unit), e.g. steps_per_execution="
            f"{k} or {2 * k}.")
    if not model.built or not model.trainable_weights:
        raise ValueError(
            "GradientAccumulation(dataset_yields='micro_batches') needs a built model: "
            "build it (an `Input` layer, or call it once on a batch) before `fit`.")


__all__ = ["MICRO_BATCH_SPLIT", "StepContext", "batches_per_update", "check_pulled_micro_batches",
           "check_state_replacement", "micro_batch_count"]
