"""The backend-neutral half of the engine: features, registration, lifetime.

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
  say *how many*, each backend's engine says *how* (a `tf.while_loop` on
  TensorFlow, a `lax.scan` on JAX), sums the gradients locally and applies
  them **once**.
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
* **`after_update(ctx)`** – runs inside the compiled step right after the
  optimizer update, on every replica (pruning masks). Written with Keras
  variables (`variable.value`, `variable.assign`) and `keras.ops`: on
  TensorFlow it writes the variables; on JAX the engine runs it inside a
  `keras.StatelessScope` that maps the model's, the optimizer's and the
  features' variables to their post-update values and takes its assignments
  as the step's new values (values in, values out: the jitted step stays pure).
  `optimizer.iterations` reads the count after the update; branch with
  `keras.ops.cond`, and assign outside the branches.
* **`step_variables()` / `frozen_variables()`** – Keras variables a feature
  owns outside the model that the step reads (both) and writes (the first:
  pruning masks, a temperature). On TensorFlow they are ordinary variables; on
  JAX the engine passes their values into the jitted step beside Keras' state
  (carried ones keep the sharding their value has, e.g. a mask its kernel's,
  and are written back after every step, so `steps_per_execution > 1` holds)
  and frozen ones (a teacher's weights) as inputs that are never returned.
* **`explain_error(error) -> Exception | None`** – when the step fails, each
  feature may return a clearer exception to raise instead (chained to the
  original).

Composition is independent of the order of the callbacks list: features are
sorted by their `order` attribute (then name) before the step is built, and a
feature `name` can be registered only once (a second one replaces the first).

**Lifetime.** A feature callback registers in `set_model`, which Keras calls
when `fit` builds its `CallbackList`, before it calls
`model.make_train_function()`. The engine overrides `make_train_function` on
the model instance: each call starts a new `fit`, takes the features
registered since the previous call, and builds the step with the backend's
engine (`engine/tensorflow.py`, `engine/jax.py`). A later `fit` without our
callbacks gets Keras' own step back.

**One owner of `model.train_function`.** Nothing else in the package writes
it. Callbacks that need to see the data `fit` iterates (`ThroughputMonitor`
reads the global batch size) ask the engine with `observe_first_batch`.
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from keras_tpu_mem import _compat
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import logger

_ = _compat  # the package docstring says where internals live

#: Backends with an engine.
SUPPORTED_BACKENDS = ("tensorflow", "jax")


def backend_name() -> str:
    return keras.backend.backend()


def require_engine_backend(what: str) -> str:
    """Returns the backend's name, or raises naming the backends that have an engine."""
    backend = backend_name()
    if backend not in SUPPORTED_BACKENDS:
        raise RuntimeError(
            f"{what} needs the Keras TensorFlow or JAX backend, but Keras is running on "
            f"{backend!r}. Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax before "
            "importing keras."
        )
    return backend


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


class StepContext:
    """What a feature sees inside the compiled step (one replica, one micro-batch).

    Attributes:
        model: The model being trained.
        x, y, sample_weight: The (micro-)batch as Keras unpacked it.
        y_pred: The model output for `x` (inside the gradient computation).
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
    #: Backends whose engine runs this feature's hooks.
    backends: tuple[str, ...] = ("tensorflow",)

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

    def batches_per_update(self) -> int | None:
        """Dataset batches (micro-batches) per optimizer update, or None."""
        return None

    def transform_loss(self, loss, ctx: StepContext):
        """Returns the loss to differentiate; `loss` is replica-scaled."""
        return loss

    def after_update(self, ctx: StepContext) -> None:
        """Runs inside the step after the optimizer update."""

    def step_variables(self) -> list:
        """Keras variables (outside the model) the step reads and writes."""
        return []

    def frozen_variables(self) -> list:
        """Keras variables (outside the model) the step only reads."""
        return []

    def explain_error(self, error: Exception) -> Exception | None:
        """A clearer exception for an error of the step, or None."""
        return None


def overrides(model, method: str) -> bool:
    """Whether the model's class overrides a method of Keras' backend trainer."""
    base = keras_compat.backend_trainer_class()
    return getattr(type(model), method) is not getattr(base, method)


def check_pulled_micro_batches(model, k: int) -> None:
    """The settings `GradientAccumulation(k, dataset_yields="micro_batches")` needs,
    checked alike by both engines: a built model, and a `steps_per_execution`
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


def check_float16_replicas(model, replicas: int) -> None:
    """float16 training over several replicas is refused (see the message)."""
    if replicas <= 1:
        return
    uses_float16 = any(
        getattr(layer.dtype_policy, "compute_dtype", None) == "float16"
        for layer in keras_compat.flatten_layers(model, include_self=True)
    ) or isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    if uses_float16:
        raise ValueError(
            "float16 training (mixed_float16 / LossScaleOptimizer) with "
            f"{replicas} replicas is refused: Keras' LossScaleOptimizer checks only "
            "replica 0's gradients for overflow, so another replica's inf/nan could "
            "reach the weights. Use bfloat16 (ktm.MixedBFloat16), which needs no loss "
            "scaling."
        )


class _FirstCallObserver:
    """Stands in for the train function until its first call, then hands it back.

    Only the engine creates it (see `observe_first_batch`).
    """

    def __init__(self, engine, inner):
        self.engine = engine
        self.inner = inner

    def __getattr__(self, name):
        # Attributes of the train function (`jitted_step` on JAX) read through.
        return getattr(self.__dict__["inner"], name)

    def __call__(self, *args, **kwargs):
        model = self.engine.model
        if model.__dict__.get("train_function") is self:
            model.train_function = self.inner
        observers, self.engine._observers = self.engine._observers, []
        size = None
        step = self.engine.backend_step
        try:
            # On JAX the call's data is an iterator: reading the first batch
            # consumes it, so the step hands back args that yield it again.
            if hasattr(step, "peek_first_call"):
                size, args = step.peek_first_call(args)
            else:
                size = step.global_batch_size_of_call(args)
        except Exception as err:  # the observation must never break training
            logger.debug("could not read the batch size of the first step: %s", err)
        for fn in observers:
            try:
                fn(size)
            except Exception as err:
                logger.debug("first-batch observer failed: %s", err)
        return self.inner(*args, **kwargs)


class Engine:
    """Owns the train function of one model. Get it with `Engine.attach(model)`."""

    _ATTR = "_keras_tpu_mem_engine"

    def __init__(self, model):
        self.model = model
        self.backend = require_engine_backend("keras_tpu_mem's training engine")
        self._pending: dict[str, Feature] = {}
        self.features: list[Feature] = []
        self._installed = False
        self._next_begin_step: int | None = None
        self._steps_per_epoch: int | None = None
        self._cache = None
        self._observers: list[Callable] = []
        self._window_position = 0
        self.num_builds = 0
        #: Global batch of the first step of the current fit with features (for
        #: the OOM explanation; None where it is not static).
        self.last_global_batch_size: int | None = None
        if self.backend == "tensorflow":
            from keras_tpu_mem.engine.tensorflow import TensorFlowStep as step_class
        else:
            from keras_tpu_mem.engine.jax import JaxStep as step_class
        self.backend_step = step_class(self)

    # ------------------------------------------------------------ attachment
    @classmethod
    def attach(cls, model) -> Engine:
        """Returns the model's engine, creating it on first use."""
        if not isinstance(model, keras.Model):
            raise TypeError(f"Expected a keras.Model, got {type(model).__name__}.")
        engine = model.__dict__.get(cls._ATTR)
        if engine is None:
            engine = cls(model)
            # object.__setattr__ keeps Keras' attribute tracking out of it.
            object.__setattr__(model, cls._ATTR, engine)
        return engine

    def _take_over_make_train_function(self) -> None:
        if "make_train_function" not in self.model.__dict__:
            object.__setattr__(self.model, "make_train_function", self._make_train_function)

    def register(self, feature: Feature) -> None:
        """Adds a feature to the next `fit` of this model."""
        if not isinstance(feature, Feature):
            raise TypeError(f"Expected a keras_tpu_mem Feature, got {type(feature).__name__}.")
        if self.backend not in feature.backends:
            raise RuntimeError(
                f"{type(feature).__name__} works on the Keras "
                f"{' and '.join(feature.backends)} backend(s); Keras is running on "
                f"{self.backend!r}."
            )
        if overrides(self.model, "train_step"):
            raise TypeError(
                f"{type(self.model).__name__} overrides `train_step`, so keras_tpu_mem "
                f"cannot install its step ({type(feature).__name__} would silently do "
                "nothing). Remove the override, or move custom logic into "
                "`compute_loss` / `compute_metrics`, which the engine calls."
            )
        self._pending[feature.name] = feature
        self._take_over_make_train_function()

    def observe(self, fn: Callable) -> None:
        """See `observe_first_batch`."""
        self._observers.append(fn)
        self._take_over_make_train_function()
        current = self.model.__dict__.get("train_function")
        if current is not None and not isinstance(current, _FirstCallObserver):
            # Registered after the train function was made (on_train_begin):
            # watch the one this fit will call.
            self.model.train_function = _FirstCallObserver(self, current)

    # ------------------------------------------------------- fit boundaries
    def _record_batch(self, size) -> None:
        self.last_global_batch_size = size

    def _make_train_function(self, force: bool = False):
        # The OOM explanation needs the batch of the failed step: read it at the
        # first call of a fit with features (the step's data is not at hand when
        # it fails), through the same first-call observer monitors use.
        if self._record_batch in self._observers:
            self._observers.remove(self._record_batch)
        if self._pending:
            self.last_global_batch_size = None
            self._observers.append(self._record_batch)
        fn = self._make_inner_train_function(force)
        if self._observers:
            fn = _FirstCallObserver(self, fn)
            self.model.train_function = fn
        return fn

    def _make_inner_train_function(self, force: bool):
        model = self.model
        features = sorted(self._pending.values(), key=lambda f: (f.order, f.name))
        self._pending = {}
        previous = [f for f in self.features if f not in features]
        for feature in previous:  # features of an earlier, interrupted fit
            self._uninstall(feature)
        if not features:
            # No feature in this fit: Keras' own step. The override stays only
            # while someone still waits for the first batch of a fit.
            if not self._observers:
                del model.__dict__["make_train_function"]
            self.features = []
            force = force or self._installed
            self._installed = False
            if model.__dict__.get("train_function") is not None and isinstance(
                    model.__dict__["train_function"], _FirstCallObserver):
                model.train_function = model.__dict__["train_function"].inner
            return type(model).make_train_function(model, force=force)
        self.features = features
        self._window_position = 0
        for feature in features:
            feature.install(model)
        self._check_compatible()
        # A later fit with the very same feature objects and compile settings
        # reuses the traced step instead of tracing (and compiling) it again.
        key = (tuple(features), model.steps_per_execution, model.jit_compile,
               model.run_eagerly, self.backend_step.distribution_key(), id(model.optimizer),
               id(keras_compat.compiled_loss_object(model)),
               id(keras_compat.compiled_metrics_object(model)))
        cached = self._cache
        if cached is None or not _same_key(cached[0], key):
            self._cache = (key, self.backend_step.build_train_function())
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
        counts = [f for f in self.features
                  if type(f).micro_batches is not Feature.micro_batches
                  or type(f).batches_per_update is not Feature.batches_per_update]
        if len(counts) > 1:
            names = ", ".join(type(f).__name__ for f in counts)
            raise ValueError(f"Only one micro-batching feature per fit, got: {names}.")
        if self.batches_per_update() > 1 and not getattr(self.backend_step,
                                                         "pulls_micro_batches", False):
            raise NotImplementedError(
                "Micro-batches pulled from the dataset (GradientAccumulation("
                "dataset_yields='micro_batches')) are not supported by the "
                f"{self.backend} engine yet; use dataset_yields='global_batches'."
            )
        check_float16_replicas(self.model, self.backend_step.num_replicas())

    # ------------------------------------------------------------ the step
    def micro_batch_count(self, per_replica_batch):
        for feature in self.features:
            count = feature.micro_batches(per_replica_batch)
            if count is not None:
                return count
        return 1

    def batches_per_update(self) -> int:
        """Dataset batches per update (1 unless a feature pulls micro-batches)."""
        for feature in self.features:
            count = feature.batches_per_update()
            if count is not None:
                return count
        return 1

    def pending_micro_batches(self) -> int:
        """Micro-batches pulled since the last update (0 at a window's end)."""
        return self._window_position

    def explain(self, error: Exception) -> Exception | None:
        """A clearer exception for an error of the step, or None; ends the fit.

        An error out of the step ends the `fit` (Keras catches only the end of
        the data, which is passed through untouched), and `on_train_end` never
        runs: the fit's features are taken off here as they would be there, so
        that right after the error the model can be planned
        (`ktm.compiled_memory`, `ktm.plan`), compiled or fit again.
        """
        if _is_end_of_data(error):
            return None
        features = list(self.features)
        self.end_failed_fit()
        for feature in features:
            clearer = feature.explain_error(error)
            if clearer is not None:
                return clearer
        return self._explain_out_of_memory(error, features)

    def end_failed_fit(self) -> None:
        """Takes off the features of a fit that an error ended (see `explain`).

        `_installed` stays set, so the next `fit` builds its train function anew
        (Keras' own step without features) instead of reusing this one.
        """
        for feature in reversed(list(self.features)):
            try:
                self._uninstall(feature)
            except Exception as err:  # the step's own error is the one to raise
                logger.debug("uninstalling %s after a failed fit: %s", feature.name, err)
        self.features = []

    def _explain_out_of_memory(self, error: Exception, features) -> Exception | None:
        """For RESOURCE_EXHAUSTED: the compiled breakdown and the smallest change that
        fits (`planning.oom`), else None. `features`: those of the failed fit, already
        taken off the model (the explanation compiles the step again with them)."""
        from keras_tpu_mem.planning import oom

        if not features or not oom.is_resource_exhausted(error):
            return None
        return oom.explain_out_of_memory(self.model, features, self.last_global_batch_size,
                                         error)

    def steps_for_this_call(self) -> int | None:
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


def _is_end_of_data(error: Exception) -> bool:
    """StopIteration (JAX, PyDataset) or TensorFlow's OutOfRangeError: Keras' loop ends
    the epoch on them; they are not failures."""
    return isinstance(error, StopIteration) or type(error).__name__ == "OutOfRangeError"


def _same_key(a, b) -> bool:
    """Compares cache keys; features by identity (the key holds them, so ids stay valid)."""
    return (len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0]))
            and a[1:] == b[1:])


def observe_first_batch(model, fn: Callable) -> None:
    """Calls `fn(global_batch_size)` once, on the first train-function call of `fit`.

    For callbacks that need to know the data `fit` iterates without owning the
    train function (the engine is its only owner). `global_batch_size` is the
    static batch dimension of the first step's data, summed over replicas, or
    `None` where it is not static (`drop_remainder=False`). Register from
    `set_model` or `on_train_begin`; `fn` runs before the first step, whether
    or not engine features take part in that `fit`.

    Example:

    ```python
    class BatchSize(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            observe_first_batch(self.model, lambda size: print("global batch", size))
    ```
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
    Engine.attach(model).observe(fn)


class EngineCallback(keras.callbacks.Callback, Feature):
    """A Keras callback that is also an engine feature.

    Subclasses fill the `Feature` registration points they need. If they
    override `set_model`, `on_train_batch_begin`, `on_train_end`,
    `on_test_begin` or `on_predict_begin`, they must call `super()`.
    """

    def set_model(self, model):
        super().set_model(model)
        # Our own reference: Keras' `model` property syncs the JAX training
        # state into the variables on every read, which per batch costs time.
        self._engine_model = model
        Engine.attach(model).register(self)

    def on_train_batch_begin(self, batch, logs=None):
        Engine.attach(self._engine_model).note_batch_begin(batch,
                                                          (self.params or {}).get("steps"))

    def on_train_end(self, logs=None):
        Engine.attach(self.model).release(self)

    # `evaluate(callbacks=[...])` and `predict(callbacks=[...])` call set_model
    # too: a feature registered there must not join the model's next `fit`.
    def on_test_begin(self, logs=None):
        Engine.attach(self.model).discard_pending(self)

    def on_predict_begin(self, logs=None):
        Engine.attach(self.model).discard_pending(self)


# ---------------------------------------------------------------------------
# Compiling the step without a fit (planning; issue 16). Kept apart from the
# fit lifetime above: it installs features for one trace and takes them off.
# ---------------------------------------------------------------------------
import contextlib  # noqa: E402  (kept with the code it serves)


@contextlib.contextmanager
def compile_context(model, features):
    """Installs `features` on `model` as a `fit` would, for tracing the step, then undoes it.

    Yields the model's backend step (`TensorFlowStep` / `JaxStep`), whose
    per-replica step then traces exactly what `fit` would install for these
    features. Nothing runs. On exit every feature is uninstalled, every
    layer's dtype policy is put back (even for features that keep theirs after
    a `fit`), each callback's `model` is what it was, and the engine holds the
    features it held before (none outside a `fit`).

    Args:
        model: A compiled `keras.Model`.
        features: `Feature` objects (feature callbacks), in any order.

    Example:

    ```python
    with compile_context(model, [ktm.GradientAccumulation(8)]) as step:
        traced = tf.function(step._replica_step, jit_compile=True)
    ```
    """
    engine = Engine.attach(model)
    features = list(features)
    for feature in features:
        if not isinstance(feature, Feature):
            raise TypeError(f"Expected keras_tpu_mem Features, got {type(feature).__name__}.")
        if engine.backend not in feature.backends:
            raise RuntimeError(
                f"{type(feature).__name__} works on the Keras "
                f"{' and '.join(feature.backends)} backend(s); Keras is running on "
                f"{engine.backend!r}.")
    if features and overrides(model, "train_step"):
        raise TypeError(
            f"{type(model).__name__} overrides `train_step`, so keras_tpu_mem cannot "
            "install its step; there is no engine step to compile for these features.")
    if engine._installed and engine.features:
        raise RuntimeError("The model is inside a fit with keras_tpu_mem features; "
                           "compile its step before or after the fit.")
    features = sorted({f.name: f for f in features}.values(), key=lambda f: (f.order, f.name))
    layers = keras_compat.flatten_layers(model, include_self=True)
    policies = [(layer, layer.dtype_policy) for layer in layers]
    # Keras callbacks keep their model in `_model`; set it without `set_model`,
    # which would register the feature for the model's next fit.
    models = [(f, f.__dict__.get("_model", None)) for f in features
              if isinstance(f, keras.callbacks.Callback)]
    held = engine.features
    installed = []
    try:
        for feature in features:
            if isinstance(feature, keras.callbacks.Callback):
                keras.callbacks.Callback.set_model(feature, model)
        engine.features = features
        for feature in features:
            feature.install(model)
            installed.append(feature)
        engine._check_compatible()
        yield engine.backend_step
    finally:
        try:
            for feature in reversed(installed):
                feature.uninstall(model)
        finally:
            for layer, policy in policies:
                if layer.dtype_policy is not policy:
                    layer.dtype_policy = policy
            for feature, previous in models:
                feature._model = previous
            engine.features = held
