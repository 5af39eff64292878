"""The `Feature` protocol: the registration points a feature fills, and its loss scaling.

Keras builds `model.train_function` from `model.train_step`. The engine
replaces that function, for the duration of a `fit` whose callbacks include
our features, with one that runs *our* step. Features never patch the training
loop themselves; they register with the engine and fill one or more of these
registration points (all optional, all methods of `Feature`):

* **`install(model)` / `uninstall(model)`** – Python-side set-up before the step
  is traced and tear-down after training (e.g. switch layer dtype policies,
  create Keras variables). Called once per `fit`. The compute policy (which
  layers compute in bfloat16) is set here, because the step is traced after it.
* **`split_extras(data) -> (data, extras)`** – take extra per-example tensors
  (e.g. cached teacher logits) out of the batch before Keras unpacks
  `(x, y, sample_weight)`. `extras` is a dict of tensors with the batch as
  first axis; it is sliced into micro-batches together with the batch.
* **`micro_batches(per_replica_batch) -> int | None`** – micro-batching
  (gradient accumulation). At most one feature may return a count: features
  say *how many*, each backend's trainer says *how* (a `tf.while_loop` on
  TensorFlow, a `lax.scan` on JAX), sums the gradients locally and applies
  them **once**. The batch is a Python int, or None where only the run knows
  it (TensorFlow, a batch dimension that is not static: arrays whose last
  batch is smaller); the count is always a Python int.
* **`micro_batch_examples() -> int | None`** – where a feature fixes the
  micro-batch's size rather than the count, that size: how a trainer splits a
  batch whose size only the run knows (it then checks that the batch splits,
  in an op named `MICRO_BATCH_SPLIT` that `explain_error` can recognise).
* **`batches_per_update() -> int | None`** – Keras' accumulation convention:
  the dataset yields micro-batches and this many of them make one update.
  The engine pulls them one at a time from the iterator, sums their
  gradients in local accumulators and applies once, with no conditional in
  the step (which call applies is known before it runs). Keras' step counting
  (progress bar, `steps_per_epoch`, callbacks' batch indices,
  `steps_per_execution`) stays in micro-batches; `optimizer.iterations` and
  learning-rate schedules count updates.
* **`transform_loss(loss, ctx) -> loss`** – extra loss terms (distillation).
  `loss` is the compiled loss already scaled for the number of replicas, as
  Keras scales it; anything added must be scaled the same way
  (`scale_for_replicas`). `ctx` is a `StepContext`.
* **`init_state(ctx) -> state | None`** – the state a feature carries from step to
  step (pruning masks, a distillation temperature), made at the start of each `fit`
  from `ctx = StepContext.outside(model)`: a tuple, named tuple or dict of arrays
  (optax's way: the feature owns no variable). The engine carries it — beside Keras'
  state into and out of the jitted step on JAX, in variables it makes on
  TensorFlow — and hands it to the hooks as `ctx.state`; between steps
  `Engine.feature_state(feature)` reads it and `Engine.set_feature_state(feature,
  state)` replaces it (a schedule, a resume).
* **`after_update(ctx) -> state | None`** – runs inside the compiled step right after
  the optimizer update, on every replica (pruning masks); returns the feature's new
  state (None: unchanged; `ctx.state_where(condition, new_state)` for a conditional
  one). Written with Keras variables (`variable.value`, `ctx.assign`) and
  `keras.ops`: on TensorFlow it writes the model's variables; on JAX the engine runs it
  inside a `keras.StatelessScope` that maps the model's and the optimizer's variables
  to their post-update values and takes its assignments as the step's new values
  (values in, values out: the jitted step stays pure). `optimizer.iterations` reads the
  count after the update (`ctx.update_count()`).
* **`frozen_variables()`** – Keras variables a feature reads in the step and never
  writes (a teacher's weights): on JAX they enter the jitted step as inputs, never
  returned nor embedded as constants.
* **`explain_error(error) -> Exception | None`** – when the step fails, each
  feature may return a clearer exception to raise instead (chained to the
  original).

Composition is independent of the order of the callbacks list: features are
sorted by their `order` attribute (then name) before the step is built, and a
feature `name` can be registered only once (a second one replaces the first).
"""

from __future__ import annotations

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.backends.step import StepContext


def scale_for_replicas(value):
    """Scales a mean-reduced loss term for the replicas, exactly as Keras does.

    Keras divides every mean-reduced loss by the number of replicas so that the
    cross-replica *sum* of gradients is the gradient of the global mean. A term
    added to the loss must be divided the same way. (On JAX the step is one
    SPMD program over the global batch: no replica scaling, identity.)
    """
    return keras_compat.scale_loss_for_distribution(value)


def unscale_for_replicas(value):
    """Inverse of `scale_for_replicas` (for logging a loss per replica)."""
    return keras_compat.unscale_loss_for_distribution(value)


class Feature:
    """Base class for everything that plugs into the engine. See the module docstring.

    Subclasses fill only the registration points they need; the defaults do
    nothing. Feature callbacks subclass `EngineCallback` (a Keras callback and a
    `Feature`), which registers them with the model's engine.

    Example: a loss term on both backends

    ```python
    class KernelPenalty(EngineCallback):
        name = "kernel_penalty"

        def transform_loss(self, loss, ctx):
            kernel = ctx.model.layers[0].kernel
            return loss + scale_for_replicas(0.1 * keras.ops.sum(keras.ops.square(kernel)))
    ```
    """

    #: Unique key of the feature kind; registering a second one replaces the first.
    name: str = "feature"
    #: Position in the step, lower first (policy 10, loss terms 50, after-update 90).
    order: int = 50

    def install(self, model) -> None:
        """Python-side set-up, before the step is traced."""

    def uninstall(self, model) -> None:
        """Undo `install` after training."""

    def split_extras(self, data):
        """Returns `(data, extras)`; extras is a dict of per-example tensors."""
        return data, {}

    def micro_batches(self, per_replica_batch: int | None) -> int | None:
        """Micro-batch count (a Python int) for a per-replica batch, or None for no
        micro-batching (or, for a batch only the run knows, where the count follows
        from `micro_batch_examples`)."""
        return None

    def micro_batch_examples(self) -> int | None:
        """Examples per micro-batch, where the feature fixes that rather than the count."""
        return None

    def batches_per_update(self) -> int | None:
        """Dataset batches (micro-batches) per optimizer update, or None."""
        return None

    def transform_loss(self, loss, ctx: StepContext):
        """Returns the loss to differentiate; `loss` is replica-scaled."""
        return loss

    def init_state(self, ctx: StepContext):
        """The state this feature carries from step to step (a structure of arrays), or
        None; made at the start of each `fit` (`ctx`: `StepContext.outside(model)`)."""
        return None

    def after_update(self, ctx: StepContext):
        """Runs inside the step after the optimizer update; returns the feature's new
        state (None: `ctx.state` unchanged)."""
        return None

    def frozen_variables(self) -> list:
        """Keras variables (outside the model) the step only reads."""
        return []

    def quiet_update(self, update: int) -> bool:
        """Whether the update that brings `optimizer.iterations` to `update` leaves this
        feature's state as it is. When every feature with state says so, the JAX engine
        runs a second compiled step for it (`ctx.quiet` True) that takes the states and
        returns none: no copy of them, and no branch. Default False: any update may
        change it."""
        return False

    def explain_error(self, error: Exception) -> Exception | None:
        """A clearer exception for an error of the step, or None."""
        return None


def in_step_order(features) -> list:
    """`features` in the order the step runs them: by `order`, then `name` (the
    order of a callbacks list never matters)."""
    return sorted(features, key=lambda f: (f.order, f.name))


def overrides(model, method: str) -> bool:
    """Whether the model's class overrides a method of Keras' backend trainer."""
    base = keras_compat.backend_trainer_class()
    return getattr(type(model), method) is not getattr(base, method)
