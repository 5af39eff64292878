"""The TensorFlow trainer: the engine's composable step under tf.distribute.

`keras_tpu_mem.engine` holds what is backend-neutral (features, registration,
lifetime) and builds its step with `backends.current().trainer.Step(engine)`;
this module is that step on TensorFlow:

* one replica's step (`_replica_step`): forward pass and loss inside a
  `tf.GradientTape`, feature loss terms, one `apply_gradients`, the features'
  after-update hooks;
* **micro-batching**: the replica's batch is split into equal slices, run
  one after another inside a `tf.while_loop` (`parallel_iterations=1`, so only
  one slice's activations are alive), gradients summed locally, applied once;
* **the multi-step loop**: with `steps_per_execution = N` the engine owns the
  loop that runs N steps per call: a `tf.while_loop` of `strategy.run` calls
  (the pattern of TensorFlow's custom-training-loop guides) followed by one
  last step whose metrics are returned. Keras' own loop fails under
  MirroredStrategy (keras-team/keras#19246); this one works under every
  strategy. The step count of each call comes from the epoch's position (the
  last call of an epoch runs the remainder), which every engine callback
  reports in `on_train_batch_begin`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import keras
import tensorflow as tf

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._compat import tensorflow as tf_compat
from keras_tpu_mem.backends.step import MICRO_BATCH_SPLIT, StepContext, check_pulled_micro_batches
from keras_tpu_mem.backends.structure import leading_dim
from keras_tpu_mem.backends.tensorflow.feature_state import FeatureStates


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

    return tf_compat.maybe_merge_call(merged, tf.distribute.get_strategy(), *args)


class Step:
    """Builds the TensorFlow train function for an `Engine` (tf.distribute)."""

    #: Supports `Feature.batches_per_update` (Keras' accumulation convention).
    pulls_micro_batches = True

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.model
        #: Each feature's state, in variables (`Feature.init_state`).
        self.states = FeatureStates(self.model)

    @property
    def features(self):
        return self.engine.features

    def num_replicas(self) -> int:
        return self.model.distribute_strategy.num_replicas_in_sync

    def distribution_key(self):
        return id(self.model.distribute_strategy)

    def owns_step(self) -> bool:
        """False: no state layout on TensorFlow needs the engine's step without a
        feature (the JAX trainer's sharded state does)."""
        return False

    def global_batch_size_of_call(self, args):
        """The global batch of a train-function call `(iterator,)`, from its spec."""
        return leading_dim(getattr(args[0], "element_spec", None))

    def skip_call(self, args, count: int):
        """Runs a call `(iterator,)` of a resumed fit without its step: reads its
        `count` batches and returns no logs. The end of the data passes through as in
        a step (Keras ends the epoch on it)."""
        iterator = args[0]
        next(iterator)
        for _ in range(count - 1):
            try:
                next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):  # the data ended
                break
        return {}

    @staticmethod
    def split_over_processes(variables) -> list[str]:
        """None is: one TensorFlow process holds every replica's values (tf.distribute,
        TPUStrategy included, drives its devices from one client)."""
        return []

    @staticmethod
    def writes_checkpoints() -> bool:
        """Always True: one TensorFlow client drives every replica."""
        return True

    @staticmethod
    def preemption_sync():
        """None: one TensorFlow client drives every replica, and catches a preemption
        notice itself."""
        return None

    @staticmethod
    def state_reader():
        """`read(variables)`: `state_values` (nothing to prepare once a fit)."""
        return Step.state_values

    @staticmethod
    def state_copier():
        """`start(variables)`: reads them now (`state_values`: TensorFlow's reads wait
        for the steps in flight) and returns `collect()`, which gives the values."""
        return lambda variables: functools.partial(list, Step.state_values(variables))

    @staticmethod
    def state_values(variables) -> list:
        """The variables' values as numpy arrays, outside the step. A variable that
        syncs on read (a metric's total under a strategy) reads its aggregate over
        the replicas, which `assign` splits back among them."""
        values = []
        for variable in variables:
            value = variable.value
            if isinstance(value, tf.distribute.DistributedValues):
                value = value.read_value()
            values.append(keras.ops.convert_to_numpy(value))
        return values

    def abandon_call(self, args) -> None:
        """Nothing to put back: on TensorFlow the variables hold the state throughout."""

    # ------------------------------------------------------- feature state
    def start_feature_states(self, features) -> bool:
        """At a fit's start: the carriers there are take the features' `init_state`;
        True where some had to be dropped (the step must be traced again)."""
        return self.states.start(features)

    def feature_state(self, feature):
        """`feature`'s state: the values of its carriers (None: none yet)."""
        return self.states.get(feature)

    def set_feature_state(self, feature, state) -> None:
        """Between steps: `feature`'s carriers take `state`."""
        self.states.set(feature, state)

    # ------------------------------------------------------------ the step
    def _forward(self, x, y, sample_weight, extras, num_micro):
        """Forward pass and loss of one (micro-)batch, inside the caller's tape."""
        model = self.model
        if keras_compat.call_has_training_arg(model):
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
        loss = keras_compat.compute_loss(model, x, y, y_pred, sample_weight, training=True)
        ctx = StepContext(model, x, y, sample_weight, y_pred, extras, num_micro)
        for feature in self.features:
            ctx.state_carriers, ctx.state = self.states.in_step(feature, ctx)
            loss = feature.transform_loss(loss, ctx)
        return y_pred, loss

    def _after_update(self, ctx) -> None:
        """The features' `after_update` hooks, each with its state as `ctx.state`; the
        state a hook returns is written into its carriers."""
        for feature in self.features:
            carriers, ctx.state = self.states.in_step(feature, ctx)
            ctx.state_carriers, ctx.written = carriers, []
            new = feature.after_update(ctx)
            if new is not None:
                self.states.write(feature, carriers, ctx, new)

    def _track(self, x, y, y_pred, sample_weight, loss):
        """Updates the loss tracker and compiled metrics exactly as Keras' train_step."""
        model = self.model
        batch = tf.shape(next(i for i in keras.tree.flatten(x) if i is not None))[0]
        tracker = keras_compat.loss_tracker(model)
        tracker.update_state(keras_compat.unscale_loss_for_distribution(loss), sample_weight=batch)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _unpack(self, data):
        """`(x, y, sample_weight, extras)`: features' extras taken out, then Keras' unpacking."""
        extras = {}
        for feature in self.features:
            data, more = feature.split_extras(data)
            extras.update(more)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        return x, y, sample_weight, extras

    def _replica_step(self, data):
        model = self.model
        x, y, sample_weight, extras = self._unpack(data)
        num_micro = self._micro_batch_count(_batch_size((x, y, sample_weight, extras)))
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
        self._after_update(StepContext(model, x, y, sample_weight, None, extras, num_micro))
        return logs

    def _micro_batch_count(self, batch):
        """The micro-batch count for a per-replica batch: the features' Python int, or
        where only the run knows the batch (a scalar tensor), a tensor checked to
        split it evenly before it is split (a feature's `explain_error` words the
        check's failure: it is named `MICRO_BATCH_SPLIT`)."""
        if isinstance(batch, int):
            return self.engine.micro_batch_count(batch)
        size = next((s for s in (f.micro_batch_examples() for f in self.features)
                     if s is not None), None)
        if size is None:
            count = self.engine.micro_batch_count(None)
            if count == 1:
                return 1
            divisor = count
        else:
            count, divisor = batch // size, size
        check = tf.debugging.assert_equal(
            batch % divisor, 0,
            message=f"{MICRO_BATCH_SPLIT}: the batch does not split into micro-batches")
        with tf.control_dependencies([check]):  # checked before the batch is split
            return tf.identity(count)

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
        if not all(layer.built for layer in keras_compat.flatten_layers(model)):
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

    # ------------------------------------- micro-batches pulled from the data
    def _pulled_micro_step(self, data, apply: bool, accumulators, k: int):
        """One micro-batch of Keras' accumulation convention, on one replica.

        Adds this micro-batch's gradient (of its loss / k) to the replica's
        local accumulators; with `apply`, the last micro-batch of a window,
        applies the sum once (one all-reduce) and zeroes the accumulators.
        """
        model = self.model
        x, y, sample_weight, extras = self._unpack(data)
        with tf.GradientTape() as tape:
            y_pred, loss = self._forward(x, y, sample_weight, extras, k)
            scaled = model.optimizer.scale_loss(loss * tf.cast(1.0 / k, loss.dtype))
        logs = self._track(x, y, y_pred, sample_weight, loss)
        trainable = model.trainable_weights
        grads = tape.gradient(scaled, trainable)
        if not apply:
            for acc, grad in zip(accumulators, grads):
                if grad is not None:
                    acc.assign_add(tf.cast(grad, acc.dtype))
            return logs
        total = [None if g is None else tf.convert_to_tensor(acc) + tf.cast(g, acc.dtype)
                 for acc, g in zip(accumulators, grads)]
        if trainable:
            model.optimizer.apply_gradients(zip(total, trainable))
        for acc in accumulators:
            acc.assign(tf.zeros_like(acc))
        self._after_update(StepContext(model, x, y, sample_weight, None, extras, k))
        return logs

    def _make_accumulators(self, strategy):
        """One local (per-replica) zero accumulator per trainable weight.

        ON_READ variables: each replica adds into its own copy, and nothing is
        reduced until the optimizer's all-reduce of the applied sum. They are
        transient (zero at every window's end, and windows never span an
        epoch), so they are not part of checkpoints.
        """
        model = self.model
        with strategy.scope():
            return [tf.Variable(tf.zeros(w.shape, w.dtype), trainable=False,
                                synchronization=tf.VariableSynchronization.ON_READ,
                                aggregation=tf.VariableAggregation.SUM,
                                name="ktm_accumulator")
                    for w in model.trainable_weights]

    def _build_pulled_train_function(self, k: int) -> Callable:
        model = self.model
        strategy = model.distribute_strategy
        check_pulled_micro_batches(model, k)
        accumulators = self._make_accumulators(strategy)

        def replica_fn(apply):
            fn = lambda data: self._pulled_micro_step(data, apply, accumulators, k)  # noqa: E731
            return tf.autograph.experimental.do_not_convert(fn)

        def step_fn(apply):
            replica = replica_fn(apply)

            @tf.autograph.experimental.do_not_convert
            def step(data):
                outputs = strategy.run(replica, args=(data,))
                return tf_compat.reduce_per_replica(outputs, strategy, reduction="auto")

            if model.run_eagerly:
                return step
            # As in the plain step: the replica step is what XLA compiles.
            return tf.function(step, reduce_retracing=True, jit_compile=bool(model.jit_compile))

        steps = {False: step_fn(False), True: step_fn(True)}
        accumulate_replica, apply_replica = False, True

        def run(apply, data):
            return steps[apply](data)

        def repeat(count, body):
            if count <= 0:
                return
            if model.run_eagerly:
                for _ in range(count):
                    body()
                return
            tf.while_loop(lambda i: i < count, lambda i: (body(), i + 1)[1], [tf.constant(0)],
                          parallel_iterations=1)

        def program(iterator, lead, windows, final_apply):
            """`lead` accumulating micro-steps, then `windows` whole windows, then
            (if `final_apply`) the applying step: the static shape of one call."""
            repeat(lead, lambda: run(accumulate_replica, next(iterator)))
            if windows:
                def window():
                    repeat(k - 1, lambda: run(accumulate_replica, next(iterator)))
                    run(apply_replica, next(iterator))

                repeat(windows - 1, window)
                repeat(k - 1, lambda: run(accumulate_replica, next(iterator)))
                return run(apply_replica, next(iterator))
            if final_apply:
                return run(apply_replica, next(iterator))
            return run(accumulate_replica, next(iterator))

        traced: dict = {}

        def compiled(shape):
            if shape not in traced:
                fn = lambda iterator: program(iterator, *shape)  # noqa: E731
                fn = tf.autograph.experimental.do_not_convert(fn)
                if not model.run_eagerly:
                    fn = tf.function(fn, jit_compile=False)
                traced[shape] = fn
            return traced[shape]

        engine = self.engine

        def train_function(iterator):
            count = engine.steps_for_this_call() or 1
            phase = engine.pending_micro_batches()
            end = phase + count
            if phase == 0 and count % k == 0:
                shape = (0, count // k, False)      # whole windows
            elif end <= k:
                # Inside one window (k a multiple of steps_per_execution).
                apply = end == k
                shape = (count - 1, 0, True) if apply else (count - 1, 0, False)
            else:
                raise ValueError(
                    f"GradientAccumulation(steps={k}, dataset_yields='micro_batches'): a "
                    f"call of {count} micro-batches starting at position {phase} of a window "
                    "would span two updates; use a steps_per_execution that divides or is a "
                    "multiple of steps."
                )
            try:
                logs = compiled(shape)(iterator)
            except Exception as error:  # an OpError, or one raised while tracing
                clearer = engine.explain(error)
                if clearer is not None:
                    raise clearer from error
                raise
            engine.advance_window(count, k)
            return logs

        return train_function

    # -------------------------------------------------- the train function
    def build_train_function(self) -> Callable:
        model = self.model
        strategy = model.distribute_strategy
        pulled = self.engine.batches_per_update()
        if pulled > 1:
            return self._build_pulled_train_function(pulled)

        replica_step = tf.autograph.experimental.do_not_convert(self._replica_step)

        @tf.autograph.experimental.do_not_convert
        def one_step(data):
            outputs = strategy.run(replica_step, args=(data,))
            return tf_compat.reduce_per_replica(outputs, strategy, reduction="auto")

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
        keras_loop = tf_compat.make_keras_train_function(model, replica_step)
        replicas = strategy.num_replicas_in_sync

        def train_function(iterator):
            try:
                return run_steps(iterator)
            except Exception as error:  # an OpError, or one raised while tracing
                clearer = self.engine.explain(error)
                if clearer is not None:
                    raise clearer from error
                raise

        def run_steps(iterator):
            count = self.engine.steps_for_this_call()
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


def _batch_size(structure):
    """The batch size: a Python int when static, else a scalar tensor."""
    for tensor in tf.nest.flatten(structure):
        if tensor is not None and hasattr(tensor, "shape") and tensor.shape.rank:
            static = tensor.shape[0]
            return int(static) if static is not None else tf.shape(tensor)[0]
    raise ValueError("keras_tpu_mem's engine found no batched tensor in the data.")




def _split(tensor, num_micro):
    """Reshapes [b, ...] into [num_micro, b / num_micro, ...]."""
    tensor = tf.convert_to_tensor(tensor)
    shape = tf.shape(tensor)
    new_shape = tf.concat([[num_micro, shape[0] // num_micro], shape[1:]], axis=0)
    # Named, so that a feature can recognise this reshape in XLA's error.
    return tf.reshape(tensor, new_shape, name=MICRO_BATCH_SPLIT)
