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
    """What a feature sees inside the compiled step (one replica, one micro-batch).

    Attributes:
        model: The model being trained.
        x, y, sample_weight: The (micro-)batch as Keras unpacked it.
        y_pred: The model output for `x` (inside the gradient computation).
        extras: Dict of extra per-example tensors from `split_extras`.
        num_micro_batches: How many micro-batches make this update (1 without
            accumulation).
        quiet: True in a step compiled for the updates that every feature with step
            variables said leave them as they are (`Feature.quiet_update`): its
            `after_update` must then not assign them (the JAX engine checks).

    Example (a feature's loss term reads the batch):

    ```python
    def transform_loss(self, loss, ctx):
        return loss + 0.1 * keras.ops.mean(keras.ops.square(ctx.y_pred))
    ```
    """

    def __init__(self, model, x=None, y=None, sample_weight=None, y_pred=None,
                 extras=None, num_micro_batches=1, quiet=False):
        self.model = model
        self.x = x
        self.y = y
        self.sample_weight = sample_weight
        self.y_pred = y_pred
        self.extras = extras or {}
        self.num_micro_batches = num_micro_batches
        self.quiet = quiet


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


__all__ = ["MICRO_BATCH_SPLIT", "StepContext", "check_pulled_micro_batches"]
