"""`GradientAccumulation`: a big global batch in the memory of a small one."""

from __future__ import annotations

import keras

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import check_positive_int, logger
from keras_tpu_mem.engine import EngineCallback

# Loss reductions for which the mean of equal micro-batch losses equals the
# full-batch loss. "sum" would need the sum, and "mean_with_sample_weight"
# divides by each micro-batch's own weight total.
_EXACT_REDUCTIONS = (None, "sum_over_batch_size", "mean")


def _loss_reductions(loss):
    """Yields the reduction of every loss object in a compile(loss=...) structure."""
    if loss is None or isinstance(loss, str) or (callable(loss) and not hasattr(loss, "reduction")):
        yield "sum_over_batch_size"  # Keras wraps strings and functions with the default
    elif isinstance(loss, dict):
        for value in loss.values():
            yield from _loss_reductions(value)
    elif isinstance(loss, (list, tuple)):
        for value in loss:
            yield from _loss_reductions(value)
    else:
        yield getattr(loss, "reduction", "sum_over_batch_size")


class GradientAccumulation(EngineCallback):
    """Splits each replica's batch into micro-batches and applies one update.

    The batch that `fit` delivers is the **global batch you want**. On every
    replica it is split into `steps` equal micro-batches (or micro-batches of
    `micro_batch_size` examples). Forward and backward passes run one
    micro-batch after another inside the compiled step (a `tf.while_loop`, so
    only one micro-batch's activations are alive), gradients are summed on the
    replica, and the optimizer is called **once**: one cross-replica all-reduce
    per update, `optimizer.iterations` and learning-rate schedules count
    updates, and no accumulation window ever spans two `fit` batches (or
    epochs).

    Loss, gradients and metrics equal one step on the full batch: the loss of
    each micro-batch is the mean over its examples (`sample_weight` applied as
    for the full batch), the micro-batch losses are averaged, and metrics are
    updated on every micro-batch.

    **Not Keras' convention.** Keras' `optimizer(gradient_accumulation_steps=k)`
    and Lightning's `accumulate_grad_batches=k` expect the dataset to yield
    micro-batches and make one update out of k of them. Here the dataset yields
    the global batch, which keeps TPU shapes static and makes one `fit` step one
    update. Keras' own accumulation also fails under any multi-replica strategy
    (keras-team/keras#20582), advances LR schedules every micro-step and carries
    a partial window across epochs; this callback does none of that.

    **BatchNormalization** sees micro-batch statistics, as in every
    accumulation scheme; a warning says so once when the model has such layers.

    Works with `steps_per_execution > 1` (under MirroredStrategy/TPUStrategy
    too, where plain Keras fails: the engine owns the multi-step loop),
    `jit_compile=True`, mixed precision policies and `BackupAndRestore` (the
    callback keeps no state of its own; a window never outlives a step).

    Args:
        steps: Micro-batches per update (an int >= 1). The per-replica batch
            must be divisible by it.
        micro_batch_size: Alternatively, examples per micro-batch on each
            replica; the per-replica batch must be divisible by it. Give exactly
            one of `steps` and `micro_batch_size`.

    Example:

    ```python
    import numpy as np, keras
    import keras_tpu_mem as ktm

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="adam", loss="mse")
    x, y = np.random.rand(256, 8), np.random.rand(256, 4)
    # Global batch 64, processed as 4 micro-batches of 16: the memory of batch 16.
    model.fit(x, y, batch_size=64, epochs=1,
              callbacks=[ktm.GradientAccumulation(steps=4)])
    ```
    """

    name = "micro_batching"
    order = 0

    def __init__(self, steps: int | None = None, *, micro_batch_size: int | None = None):
        super().__init__()
        if (steps is None) == (micro_batch_size is None):
            raise ValueError(
                "Give exactly one of `steps` (micro-batches per update) and "
                f"`micro_batch_size` (examples per micro-batch); got steps={steps!r}, "
                f"micro_batch_size={micro_batch_size!r}."
            )
        self.steps = None if steps is None else check_positive_int(steps, "steps")
        self.micro_batch_size = (
            None if micro_batch_size is None
            else check_positive_int(micro_batch_size, "micro_batch_size")
        )

    def get_config(self):
        return {"steps": self.steps, "micro_batch_size": self.micro_batch_size}

    @classmethod
    def from_config(cls, config):
        return cls(config["steps"], micro_batch_size=config["micro_batch_size"])

    # ---------------------------------------------------------------- engine
    def install(self, model):
        optimizer = model.optimizer
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        for opt in (optimizer, inner):
            if getattr(opt, "gradient_accumulation_steps", None):
                raise ValueError(
                    f"The optimizer has gradient_accumulation_steps="
                    f"{opt.gradient_accumulation_steps}; together with "
                    "GradientAccumulation the two accumulations would compound. Remove "
                    "one: compile with an optimizer without gradient_accumulation_steps."
                )
        reductions = set(_loss_reductions(getattr(model, "loss", None)))
        inexact = sorted(str(r) for r in reductions if r not in _EXACT_REDUCTIONS)
        if inexact:
            raise ValueError(
                f"GradientAccumulation needs mean-reduced losses ('sum_over_batch_size', "
                f"Keras' default) for micro-batches to equal the full batch; the compiled "
                f"loss uses reduction {', '.join(inexact)}."
            )
        has_bn = any(
            isinstance(layer, keras.layers.BatchNormalization)
            for layer in keras_compat.flatten_layers(model, include_self=False)
        )
        if has_bn and not getattr(self, "_warned_bn", False):
            self._warned_bn = True
            logger.warning(
                "GradientAccumulation: the model has BatchNormalization layers; they "
                "normalise with micro-batch statistics (as in every accumulation "
                "scheme), not with the global batch's."
            )

    def _requirement(self):
        """(what, divisor): the argument that sets the split and what must divide the batch."""
        size = self.micro_batch_size
        if size is None:
            return f"steps={self.steps}", self.steps
        return f"micro_batch_size={size}", size

    def micro_batches(self, per_replica_batch):
        import tensorflow as tf

        replicas = self.model.distribute_strategy.num_replicas_in_sync
        size = self.micro_batch_size
        what, divisor = self._requirement()
        if isinstance(per_replica_batch, int):
            if per_replica_batch % divisor:
                raise ValueError(self._indivisible_message(what, per_replica_batch, replicas,
                                                           divisor))
            return self.steps if size is None else per_replica_batch // size
        # The batch size is only known at run time (e.g. `fit(x, y, batch_size=...)`
        # on arrays, whose last batch is smaller): check it there.
        check = tf.debugging.assert_equal(
            per_replica_batch % divisor, 0,
            message=self._indivisible_message(what, None, replicas, divisor,
                                              where="its size is shown below"),
        )
        count = self.steps if size is None else per_replica_batch // size
        with tf.control_dependencies([check]):  # check before the batch is split
            return tf.identity(count)

    def explain_error(self, error):
        # Under XLA the run-time check above is dropped: a batch of unknown size
        # (arrays, whose last batch is smaller) that does not split fails in
        # XLA's compilation of the split itself, with a bare reshape error.
        import tensorflow as tf

        from keras_tpu_mem.engine import MICRO_BATCH_SPLIT

        if not isinstance(error, tf.errors.InvalidArgumentError):
            return None
        if MICRO_BATCH_SPLIT not in str(error):
            return None
        what, divisor = self._requirement()
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        message = self._indivisible_message(
            what, None, replicas, divisor,
            where="likely the ragged last batch of arrays; XLA's error below gives its "
                  "number of values")
        return tf.errors.InvalidArgumentError(
            error.node_def, error.op, f"{message}\n\nXLA's error: {error.message}")

    @staticmethod
    def _indivisible_message(what, batch, replicas, divisor, *, where=""):
        """`batch`: the per-replica batch size, or None where only run time knows it
        (`where` then says where its size is shown)."""
        if batch is None:
            batch = f"a per-replica batch over {replicas} replica(s) ({where})"
        else:
            batch = (f"the per-replica batch of {batch} (global batch {batch * replicas} "
                     f"over {replicas} replica(s))")
        return (
            f"GradientAccumulation({what}): {batch} does not split evenly. Use a global "
            f"batch that is a multiple of {divisor * replicas} and drop the ragged last "
            "batch, e.g. TPUStrategyWrapper.distribute(dataset, global_batch_size=...), "
            "which batches with drop_remainder=True."
        )
