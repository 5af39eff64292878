"""The training engine: one composable train step that features plug into.

Keras builds `model.train_function` from `model.train_step`. The engine
replaces that function, for the duration of a `fit` whose callbacks include
our features, with one that runs *our* step. Features never patch the training
loop themselves; they register with the engine and fill one or more of these
registration points (all optional, all methods of `Feature`):

* **`install(model)` / `uninstall(model)`** – Python-side set-up before the step
  is traced and tear-down after training (e.g. switch layer dtype policies,
  create Keras variables). Called once per `fit`.
* **compute policy** – done in `install`: anything that changes how layers
  compute must happen there, because the step is traced after it.
* **`split_extras(data) -> (data, extras)`** – take extra per-example tensors
  (e.g. cached teacher logits) out of the batch before Keras unpacks
  `(x, y, sample_weight)`. `extras` is a dict of tensors with the batch as
  first axis; it is sliced into micro-batches together with the batch.
* **`micro_batches(per_replica_batch) -> int | None`** – micro-batching
  (gradient accumulation). At most one feature may return a count. The engine
  splits the replica's batch into that many equal slices, runs forward and
  backward on each inside a `tf.while_loop` (so only one slice's activations
  are alive), sums the gradients locally, and applies them **once**.
* **`transform_loss(loss, ctx) -> loss`** – extra loss terms (distillation).
  `loss` is the compiled loss already scaled for the number of replicas, as
  Keras scales it; anything added must be scaled the same way
  (`scale_for_replicas`). `ctx` is a `StepContext`.
* **`after_update(ctx)`** – runs inside the compiled step right after the
  optimizer update, on every replica (pruning masks). It runs with
  `steps_per_execution > 1` and under XLA because it is part of the step.
  Assign model variables there with `update_variable`, which works in the
  replica context of every strategy.
* **`explain_error(error) -> Exception | None`** – when the step fails with a
  TensorFlow error, each feature may return a clearer exception to raise
  instead (chained to the original). For errors only XLA detects: it drops
  the step's runtime assertions.

Composition is independent of the order of the callbacks list: features are
sorted by their `order` attribute (then name) before the step is built, and a
feature `name` can be registered only once (a second one replaces the first).

**The multi-step loop.** With `steps_per_execution = N`, the engine owns the
loop that runs N steps per call: a `tf.while_loop` of `strategy.run` calls
(the pattern of TensorFlow's custom-training-loop guides) followed by one last
step whose metrics are returned. Keras' own loop fails under MirroredStrategy
(keras-team/keras#19246); this one works under every strategy. The step count
of each call comes from the epoch's position (the last call of an epoch runs
the remainder), which every engine callback reports in
`on_train_batch_begin`.

**Lifetime.** A feature callback registers in `set_model`, which Keras calls
when `fit` builds its `CallbackList`, before it calls
`model.make_train_function()`. The engine overrides `make_train_function` on
the model instance: each call starts a new `fit`, takes the features
registered since the previous call, and builds the step. A later `fit`
without our callbacks therefore gets Keras' own step back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import keras
import tensorflow as tf

from keras_tpu_mem._utils import logger, require_tensorflow_backend


def scale_for_replicas(value):
    """Scales a mean-reduced loss term for the replicas, exactly as Keras does.

    Keras divides every mean-reduced loss by the number of replicas so that the
    cross-replica *sum* of gradients is the gradient of the global mean. A term
    added to the loss must be divided the same way.
    """
    from keras.src.losses.loss import scale_loss_for_distribution

    return scale_loss_for_distribution(value)


def unscale_for_replicas(value):
    """Inverse of `scale_for_replicas` (for logging a loss per replica)."""
    from keras.src.losses.loss import unscale_loss_for_distribution

    return unscale_loss_for_distribution(value)


def update_variable(variable, fn, *args):
    """Updates a model variable from inside the step, consistently on every replica.

    For `after_update` hooks: under a multi-replica strategy a replica may not
    assign a mirrored variable directly. This does what Keras' optimizer does:
    a merge call, then `fn(per_device_variable, *per_device_args)` on every
    device. `fn` must assign and may return the assign op. Args that are
    per-replica tensors arrive as each device's own value.

    Example (inside `after_update`): clip a kernel

    ```python
    update_variable(layer.kernel, lambda v: v.assign(tf.clip_by_value(v, -1.0, 1.0)))
    ```
    """
    tf_variable = variable.value if isinstance(variable, keras.Variable) else variable

    def merged(strategy, *merged_args):
        return strategy.extended.update(tf_variable, fn, args=merged_args, group=False)

    return tf.__internal__.distribute.interim.maybe_merge_call(
        merged, tf.distribute.get_strategy(), *args
    )


class StepContext:
    """What a feature sees inside the compiled step (one replica, one micro-batch).

    Attributes:
        model: The model being trained.
        x, y, sample_weight: The (micro-)batch as Keras unpacked it.
        y_pred: The model output for `x` (inside the gradient tape).
        extras: Dict of extra per-example tensors from `split_extras`.
        num_micro_batches: How many micro-batches make this update (1 without
            accumulation).
    """

    def __init__(self, model, x=None, y=None, sample_weight=None, y_pred=None,
                 extras=None, num_micro_batches=1):
        self.model = model
        self.x = x
        self.y = y
        self.sample_weight = sample_weight
        self.y_pred = y_pred
        self.extras = extras or {}
        self.num_micro_batches = num_micro_batches


class Feature:
    """Base class for everything that plugs into the engine. See the module docstring."""

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
        """Micro-batch count for a per-replica batch, or None for no micro-batching."""
        return None

    def transform_loss(self, loss, ctx: StepContext):
        """Returns the loss to differentiate; `loss` is replica-scaled."""
        return loss

    def after_update(self, ctx: StepContext) -> None:
        """Runs inside the step after the optimizer update."""

    def explain_error(self, error: Exception) -> Exception | None:
        """A clearer exception for a TensorFlow error of the step, or None."""
        return None


def _overrides(model, method: str) -> bool:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return getattr(type(model), method) is not getattr(TensorFlowTrainer, method)


class Engine:
    """Owns the train function of one model. Get it with `Engine.attach(model)`."""

    _ATTR = "_keras_tpu_mem_engine"

    def __init__(self, model):
        self.model = model
        self._pending: dict[str, Feature] = {}
        self.features: list[Feature] = []
        self._installed = False
        self._next_begin_step: int | None = None
        self._steps_per_epoch: int | None = None
        self._cache = None
        self.num_builds = 0

    # ------------------------------------------------------------ attachment
    @classmethod
    def attach(cls, model) -> Engine:
        """Returns the model's engine, creating it on first use."""
        require_tensorflow_backend("keras_tpu_mem's training engine")
        if not isinstance(model, keras.Model):
            raise TypeError(f"Expected a keras.Model, got {type(model).__name__}.")
        engine = model.__dict__.get(cls._ATTR)
        if engine is None:
            engine = cls(model)
            # object.__setattr__ keeps Keras' attribute tracking out of it.
            object.__setattr__(model, cls._ATTR, engine)
        return engine

    def register(self, feature: Feature) -> None:
        """Adds a feature to the next `fit` of this model."""
        if not isinstance(feature, Feature):
            raise TypeError(f"Expected a keras_tpu_mem Feature, got {type(feature).__name__}.")
        if _overrides(self.model, "train_step"):
            raise TypeError(
                f"{type(self.model).__name__} overrides `train_step`, so keras_tpu_mem "
                f"cannot install its step ({type(feature).__name__} would silently do "
                "nothing). Remove the override, or move custom logic into "
                "`compute_loss` / `compute_metrics`, which the engine calls."
            )
        self._pending[feature.name] = feature
        if "make_train_function" not in self.model.__dict__:
            object.__setattr__(self.model, "make_train_function", self._make_train_function)

    # ------------------------------------------------------- fit boundaries
    def _make_train_function(self, force: bool = False):
        model = self.model
        features = sorted(self._pending.values(), key=lambda f: (f.order, f.name))
        self._pending = {}
        previous = [f for f in self.features if f not in features]
        for feature in previous:  # features of an earlier, interrupted fit
            self._uninstall(feature)
        if not features:
            # No feature in this fit: hand the model back to Keras.
            del model.__dict__["make_train_function"]
            self.features = []
            force = force or self._installed
            self._installed = False
            return model.make_train_function(force=force)
        self.features = features
        for feature in features:
            feature.install(model)
        self._check_compatible()
        # A later fit with the very same feature objects and compile settings
        # reuses the traced step instead of tracing (and compiling) it again.
        key = (tuple(features), model.steps_per_execution, model.jit_compile,
               model.run_eagerly, id(model.distribute_strategy), id(model.optimizer),
               id(getattr(model, "_compile_loss", None)),
               id(getattr(model, "_compile_metrics", None)))
        cached = self._cache
        if cached is None or not _same_key(cached[0], key):
            self._cache = (key, self._build_train_function())
            self.num_builds += 1
        model.train_function = self._cache[1]
        self._installed = True
        return model.train_function

    def _uninstall(self, feature: Feature) -> None:
        try:
            feature.uninstall(self.model)
        finally:
            if feature in self.features:
                self.features.remove(feature)

    def discard_pending(self, feature: Feature) -> None:
        """Forgets a registration that no `fit` took up (evaluate/predict callbacks)."""
        if self._pending.get(feature.name) is feature:
            del self._pending[feature.name]

    def release(self, feature: Feature) -> None:
        """Called by a feature at the end of `fit`: undo its `install`."""
        if feature in self.features:
            self._uninstall(feature)

    def note_batch_begin(self, begin_step: int, steps_per_epoch: int | None) -> None:
        """Feature callbacks report the position in the epoch before each call."""
        self._next_begin_step = begin_step
        self._steps_per_epoch = steps_per_epoch

    # -------------------------------------------------------------- checks
    def _check_compatible(self) -> None:
        model = self.model
        counts = [f for f in self.features if type(f).micro_batches is not Feature.micro_batches]
        if len(counts) > 1:
            names = ", ".join(type(f).__name__ for f in counts)
            raise ValueError(f"Only one micro-batching feature per fit, got: {names}.")
        strategy = model.distribute_strategy
        if strategy.num_replicas_in_sync > 1:
            uses_float16 = any(
                getattr(layer.dtype_policy, "compute_dtype", None) == "float16"
                for layer in model._flatten_layers(include_self=True)
            ) or isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            if uses_float16:
                raise ValueError(
                    "float16 training (mixed_float16 / LossScaleOptimizer) with "
                    f"{strategy.num_replicas_in_sync} replicas is refused: Keras' "
                    "LossScaleOptimizer checks only replica 0's gradients for overflow, "
                    "so another replica's inf/nan could reach the weights. Use bfloat16 "
                    "(ktm.MixedBFloat16), which needs no loss scaling."
                )

    # ------------------------------------------------------------ the step
    def _micro_batch_count(self, per_replica_batch):
        for feature in self.features:
            count = feature.micro_batches(per_replica_batch)
            if count is not None:
                return count
        return 1

    def _forward(self, x, y, sample_weight, extras, num_micro):
        """Forward pass and loss of one (micro-)batch, inside the caller's tape."""
        model = self.model
        if model._call_has_training_arg:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                   training=True)
        ctx = StepContext(model, x, y, sample_weight, y_pred, extras, num_micro)
        for feature in self.features:
            loss = feature.transform_loss(loss, ctx)
        return y_pred, loss

    def _track(self, x, y, y_pred, sample_weight, loss):
        """Updates the loss tracker and compiled metrics exactly as Keras' train_step."""
        model = self.model
        from keras.src import tree

        batch = tf.shape(next(i for i in tree.flatten(x) if i is not None))[0]
        model._loss_tracker.update_state(unscale_for_replicas(loss), sample_weight=batch)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _replica_step(self, data):
        from keras.src.trainers.data_adapters import data_adapter_utils

        model = self.model
        extras = {}
        for feature in self.features:
            data, more = feature.split_extras(data)
            extras.update(more)
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        per_replica_batch = _batch_size((x, y, sample_weight, extras))
        num_micro = self._micro_batch_count(per_replica_batch)
        if isinstance(num_micro, int) and num_micro == 1:
            with tf.GradientTape() as tape:
                y_pred, loss = self._forward(x, y, sample_weight, extras, 1)
                scaled = model.optimizer.scale_loss(loss) if model.optimizer else loss
            logs = self._track(x, y, y_pred, sample_weight, loss)
            grads = tape.gradient(scaled, model.trainable_weights)
        else:
            grads = self._accumulated_gradients((x, y, sample_weight, extras), num_micro)
            logs = model.get_metrics_result()
        # Read after the forward pass, which builds a lazily built model.
        trainable = model.trainable_weights
        if trainable:
            model.optimizer.apply_gradients(zip(grads, trainable))
        else:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        ctx = StepContext(model, x, y, sample_weight, None, extras, num_micro)
        for feature in self.features:
            feature.after_update(ctx)
        return logs

    def _accumulated_gradients(self, batch, num_micro):
        """Sum of micro-batch gradients, one micro-batch alive at a time."""
        model = self.model
        structure = tf.nest.map_structure(
            lambda t: None if t is None else _split(t, num_micro), batch
        )
        inv = 1.0 / tf.cast(num_micro, "float32")

        def micro_gradients(index):
            x, y, sample_weight, extras = tf.nest.map_structure(
                lambda t: None if t is None else t[index], structure
            )
            with tf.GradientTape() as tape:
                y_pred, loss = self._forward(x, y, sample_weight, extras, num_micro)
                scaled = model.optimizer.scale_loss(loss * tf.cast(inv, loss.dtype))
            self._track(x, y, y_pred, sample_weight, loss)
            grads = tape.gradient(scaled, model.trainable_weights)
            return [None if g is None else tf.convert_to_tensor(g) for g in grads]

        # Accumulators start at zero for every trainable weight. Which weights
        # get no gradient at all (None, as in Keras' own step) is learnt while
        # the loop body is traced, and those stay None for the optimizer.
        # (Peeling the first micro-batch out of the loop would give the same
        # answer, but lets the runtime overlap it with the loop's first
        # iteration, and XLA folds a one-iteration loop into it: two
        # micro-batches alive at once.)
        if not all(layer.built for layer in model._flatten_layers()):
            # A model built outside any strategy scope is built lazily, when the
            # step is first traced (as Keras' own step does by calling it). The
            # accumulators need its weights first: call it once on the first
            # micro-batch. That call is pure (training=False) and its result is
            # unused, so it is pruned from the step that runs.
            first_x = tf.nest.map_structure(lambda t: t[0], structure[0])
            model(first_x, training=False)
        trainable = model.trainable_weights
        connected = []

        def body(index, *sums):
            grads = micro_gradients(index)
            if not connected:
                connected.extend(g is not None for g in grads)
            grads = [tf.zeros_like(s) if g is None else tf.cast(g, s.dtype)
                     for s, g in zip(sums, grads)]
            return (index + 1, *[s + g for s, g in zip(sums, grads)])

        initial = [tf.zeros(w.shape, dtype=w.dtype) for w in trainable]
        # parallel_iterations=1: iterations must not overlap, or several
        # micro-batches' activations would be alive at once.
        _, *sums = tf.while_loop(
            lambda index, *sums: index < num_micro,
            body,
            (tf.constant(0), *initial),
            parallel_iterations=1,
        )
        return [s if c else None for s, c in zip(sums, connected)]

    # -------------------------------------------------- the train function
    def _build_train_function(self) -> Callable:
        from keras.src.backend.tensorflow.trainer import reduce_per_replica

        model = self.model
        strategy = model.distribute_strategy

        replica_step = tf.autograph.experimental.do_not_convert(self._replica_step)

        @tf.autograph.experimental.do_not_convert
        def one_step(data):
            outputs = strategy.run(replica_step, args=(data,))
            return reduce_per_replica(outputs, strategy, reduction="auto")

        if not model.run_eagerly:
            one_step = tf.function(one_step, reduce_retracing=True,
                                   jit_compile=bool(model.jit_compile))

        @tf.autograph.experimental.do_not_convert
        def multi_step(iterator, count):
            def body(index):
                one_step(next(iterator))
                return index + 1

            tf.while_loop(lambda index: index < count - 1, body, [tf.constant(0)],
                          parallel_iterations=1)
            return one_step(next(iterator))

        if not model.run_eagerly:
            multi_step = tf.function(multi_step, reduce_retracing=True)

        # For data of unknown length Keras' own loop (which stops at the data's
        # end with `get_next_as_optional`) is the right one on a single replica.
        keras_loop = model._make_function(replica_step)
        replicas = strategy.num_replicas_in_sync

        def train_function(iterator):
            try:
                return run_steps(iterator)
            except tf.errors.OpError as error:
                for feature in self.features:
                    clearer = feature.explain_error(error)
                    if clearer is not None:
                        raise clearer from error
                raise

        def run_steps(iterator):
            count = self._steps_for_this_call()
            if count is None:
                if replicas > 1:
                    raise ValueError(
                        f"steps_per_execution={model.steps_per_execution} with "
                        f"{replicas} replicas needs the number of steps per epoch: pass "
                        "`steps_per_epoch` to fit, or give the dataset a known length "
                        "(`dataset.apply(tf.data.experimental.assert_cardinality(n))`; "
                        "`filter` and generators lose it)."
                    )
                return keras_loop(iterator)
            if model.run_eagerly:
                for _ in range(count - 1):
                    one_step(next(iterator))
                return one_step(next(iterator))
            return multi_step(iterator, tf.constant(count, tf.int32))

        return train_function

    def _steps_for_this_call(self) -> int | None:
        """Steps the next call runs; None when the epoch's length is unknown."""
        spe = int(self.model.steps_per_execution)
        begin, total = self._next_begin_step, self._steps_per_epoch
        self._next_begin_step = None
        if spe == 1:
            return 1
        if begin is None or not total:
            return None
        # The last call of an epoch runs the remainder (9 steps, N=4: 4, 4, 1).
        return max(1, min(spe, total - begin))


def _same_key(a, b) -> bool:
    """Compares cache keys; features by identity (the key holds them, so ids stay valid)."""
    return (len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0]))
            and a[1:] == b[1:])


def _batch_size(structure):
    """The batch size: a Python int when static, else a scalar tensor."""
    for tensor in tf.nest.flatten(structure):
        if tensor is not None and hasattr(tensor, "shape") and tensor.shape.rank:
            static = tensor.shape[0]
            return int(static) if static is not None else tf.shape(tensor)[0]
    raise ValueError("keras_tpu_mem's engine found no batched tensor in the data.")


#: The name of the reshape that splits a batch into micro-batches.
MICRO_BATCH_SPLIT = "ktm_micro_batch_split"


def _split(tensor, num_micro):
    """Reshapes [b, ...] into [num_micro, b / num_micro, ...]."""
    tensor = tf.convert_to_tensor(tensor)
    shape = tf.shape(tensor)
    new_shape = tf.concat([[num_micro, shape[0] // num_micro], shape[1:]], axis=0)
    # Named, so that a feature can recognise this reshape in XLA's error.
    return tf.reshape(tensor, new_shape, name=MICRO_BATCH_SPLIT)


class EngineCallback(keras.callbacks.Callback, Feature):
    """A Keras callback that is also an engine feature.

    Subclasses fill the `Feature` registration points they need. If they
    override `set_model`, `on_train_batch_begin`, `on_train_end`,
    `on_test_begin` or `on_predict_begin`, they must call `super()`.
    """

    def set_model(self, model):
        super().set_model(model)
        Engine.attach(model).register(self)

    def on_train_batch_begin(self, batch, logs=None):
        Engine.attach(self.model).note_batch_begin(batch, (self.params or {}).get("steps"))

    def on_train_end(self, logs=None):
        Engine.attach(self.model).release(self)

    # `evaluate(callbacks=[...])` and `predict(callbacks=[...])` call set_model
    # too: a feature registered there must not join the model's next `fit`.
    def on_test_begin(self, logs=None):
        Engine.attach(self.model).discard_pending(self)

    def on_predict_begin(self, logs=None):
        Engine.attach(self.model).discard_pending(self)


__all__ = [
    "Engine",
    "EngineCallback",
    "Feature",
    "StepContext",
    "logger",
    "scale_for_replicas",
    "unscale_for_replicas",
    "update_variable",
]
