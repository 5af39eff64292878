"""`GradientAccumulation`: a big global batch in the memory of a small one."""

from __future__ import annotations

import keras

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import check_positive_int, logger
from keras_tpu_mem.engine import EngineCallback, StepContext

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


_DATASET_YIELDS = ("global_batches", "micro_batches")


class GradientAccumulation(EngineCallback):
    """Splits each replica's batch into micro-batches and applies one update.

    The batch that `fit` delivers is the **global batch you want**. On every
    replica it is split into `steps` equal micro-batches (or micro-batches of
    `micro_batch_size` examples). Forward and backward passes run one
    micro-batch after another inside the compiled step (a `tf.while_loop` on
    TensorFlow, a `lax.scan` on JAX, so only one micro-batch's activations are
    alive), gradients are summed on the
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

    **Keras' convention too: `dataset_yields="micro_batches"`.** The dataset
    yields micro-batches and every `steps` of them make one update, as with
    `optimizer(gradient_accumulation_steps=steps)` — but with one optimizer
    call and one all-reduce per update, under every strategy. The global batch
    never exists in memory (the least memory of all modes). Units: Keras'
    step counting (progress bar, `steps_per_epoch`, callbacks' batch indices,
    `steps_per_execution`) counts micro-batches, as in Keras' own
    accumulation; `optimizer.iterations` and learning-rate schedules count
    updates. Each epoch's micro-batch count must divide by `steps` (checked at
    the start of `fit` where the length is known, else at the epoch's end): a
    partial window is an error, never a silent partial update.
    `steps_per_execution` must divide or be a multiple of `steps`.

    **On JAX** (`KERAS_BACKEND=jax`, with or without a `keras.distribution`),
    a "replica" is a data-parallel shard: the global batch divided by the
    size of the distribution's batch axis (per device under
    `DataParallel`; per batch shard under `ModelParallel`, whose model axis
    is untouched). Each device slices micro-batches out of its own share
    (inside a `shard_map` over the batch axis), sums its own gradients, and
    the step reduces them once after the loop: no collective inside the loop,
    no data moved between devices. Same arguments, same errors; the batch
    size is always static there, so a batch that does not split is refused
    when the step is traced.

    **BatchNormalization** sees micro-batch statistics, as in every
    accumulation scheme; a warning says so once when the model has such layers.

    Works with `steps_per_execution > 1` (under MirroredStrategy/TPUStrategy
    too, where plain Keras fails: the engine owns the multi-step loop),
    `jit_compile=True`, mixed precision policies and `BackupAndRestore` (the
    callback keeps no state of its own; a window never outlives a step); on
    JAX with `DataParallel`, `ModelParallel`, `steps_per_execution > 1`,
    `BackupAndRestore` and several processes (`keras.distribution.initialize`).
    `dataset_yields="micro_batches"` works on both backends (on JAX: per-device
    accumulators inside `shard_map`, one gradient reduction per update).

    Args:
        steps: Micro-batches per update (an int >= 1). The per-replica batch
            must be divisible by it.
        micro_batch_size: Alternatively, examples per micro-batch on each
            replica; the per-replica batch must be divisible by it. Give exactly
            one of `steps` and `micro_batch_size`.
        dataset_yields: `"global_batches"` (default: each batch `fit` gets is
            split in the step) or `"micro_batches"` (Keras' convention: each
            batch is one micro-batch, `steps` of them make an update; needs
            `steps`, and a model built before `fit`).

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

    def __init__(self, steps: int | None = None, *, micro_batch_size: int | None = None,
                 dataset_yields: str = "global_batches"):
        super().__init__()
        if dataset_yields not in _DATASET_YIELDS:
            raise ValueError(
                f"`dataset_yields` must be one of {', '.join(map(repr, _DATASET_YIELDS))}; "
                f"got {dataset_yields!r}."
            )
        if dataset_yields == "micro_batches" and micro_batch_size is not None:
            raise ValueError(
                "dataset_yields='micro_batches' takes `steps` (micro-batches per update); "
                "the dataset's batch size is the micro-batch size, so `micro_batch_size` "
                f"is not accepted (got micro_batch_size={micro_batch_size!r})."
            )
        self.dataset_yields = dataset_yields
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
        return {"steps": self.steps, "micro_batch_size": self.micro_batch_size,
                "dataset_yields": self.dataset_yields}

    @classmethod
    def from_config(cls, config):
        return cls(config["steps"], micro_batch_size=config["micro_batch_size"],
                   dataset_yields=config.get("dataset_yields", "global_batches"))

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

    def _replicas(self) -> int:
        """Replicas (TensorFlow) or data-parallel shards (JAX) the global batch splits over."""
        from keras_tpu_mem.engine import Engine

        # `self._model`, not the `model` property: on JAX that property syncs
        # the training state into the model's variables, which must not happen
        # while the step is traced (Keras would then drop that step's update).
        return Engine.attach(self._model).backend_step.num_replicas()

    def batches_per_update(self):
        return self.steps if self.dataset_yields == "micro_batches" else None

    def on_train_begin(self, logs=None):
        steps = (self.params or {}).get("steps")
        if self.dataset_yields == "micro_batches" and steps and steps % self.steps:
            raise ValueError(self._partial_window_message(steps))

    def on_epoch_end(self, epoch, logs=None):
        if self.dataset_yields != "micro_batches":
            return
        from keras_tpu_mem.engine import Engine

        pending = Engine.attach(self.model).pending_micro_batches()
        if pending:
            raise ValueError(self._partial_window_message(None, pending=pending, epoch=epoch))

    def _partial_window_message(self, steps, *, pending=None, epoch=None):
        if steps is not None:
            what = f"the epoch has {steps} micro-batches"
        else:
            what = (f"epoch {epoch} ended {pending} micro-batch(es) into a window; its "
                    "gradients were not applied")
        return (
            f"GradientAccumulation(steps={self.steps}, dataset_yields='micro_batches'): "
            f"{what}, not a multiple of {self.steps}, so the last update would be partial. "
            f"Give each epoch a multiple of {self.steps} micro-batches (`steps_per_epoch`, "
            "or drop the ragged tail: `dataset.take(n)` / `batch(..., drop_remainder=True)`)."
        )

    def micro_batches(self, per_replica_batch):
        if self.dataset_yields == "micro_batches":
            return None
        size = self.micro_batch_size
        if per_replica_batch is None:
            # Only the run knows the batch (e.g. `fit(x, y, batch_size=...)` on
            # arrays, whose last batch is smaller): the trainer checks there that
            # it splits, and `explain_error` words that check's failure.
            return self.steps if size is None else None
        if isinstance(per_replica_batch, bool) or not isinstance(per_replica_batch, int):
            raise TypeError("`per_replica_batch` must be a Python int or None, got "
                            f"{per_replica_batch!r} ({type(per_replica_batch).__name__}).")
        what, divisor = self._requirement()
        if per_replica_batch % divisor:
            raise ValueError(self._indivisible_message(what, per_replica_batch,
                                                       self._replicas(), divisor))
        return self.steps if size is None else per_replica_batch // size

    def micro_batch_examples(self):
        if self.dataset_yields == "micro_batches":
            return None
        return self.micro_batch_size

    def explain_error(self, error):
        # A batch only the run knows that does not split fails the trainer's
        # check, or, under XLA (which drops run-time checks), XLA's compilation
        # of the split itself with a bare reshape error. Only TensorFlow has
        # such batches: on JAX every batch size is a Python int when the step is
        # traced, and `micro_batches` refused an indivisible one then.
        def message():
            what, divisor = self._requirement()
            return self._indivisible_message(
                what, None, self._replicas(), divisor,
                where="likely the ragged last batch of arrays; XLA's error below gives its "
                      "number of values")

        return StepContext.outside().explain_split_error(error, message)

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
