"""The engine's lifetime: one owner of `model.train_function` per model.

The features (`engine/feature.py`) say what the step does; the running
backend's trainer builds it; this module decides when, for which features,
and what happens when the step fails.

**Lifetime.** A feature callback registers in `set_model`, which Keras calls
when `fit` builds its `CallbackList`, before it calls
`model.make_train_function()`. The engine overrides `make_train_function` on
the model instance: each call starts a new `fit`, takes the features
registered since the previous call, and builds the step with the running backend's
trainer (`backends.current().trainer.Step`: `backends/tensorflow/trainer.py`,
`backends/jax/trainer.py`). A later `fit` without our
callbacks gets Keras' own step back.

**One owner of `model.train_function`.** Nothing else in the package writes
it. Callbacks that need to see the data `fit` iterates (`ThroughputMonitor`
reads the global batch size) ask the engine with `observe_first_batch`.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import keras

from keras_tpu_mem import _compat, backends
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import check_positive_int, logger
from keras_tpu_mem.backends.step import batches_per_update, micro_batch_count
from keras_tpu_mem.engine.feature import Feature, in_step_order, overrides

_ = _compat  # the package docstring says where internals live

#: Called in turn after the features' own `explain_error` found nothing (see
#: `register_error_explainer`).
_ERROR_EXPLAINERS: list[Callable] = []

#: Modules whose import registers an explainer: the planner's out-of-memory
#: explanation (`planning/oom.py`). The engine loads them by name when a fit's
#: step fails, not at import: the planner imports the engine (no cycle), and
#: features imported from their own modules (`from keras_tpu_mem.sharding import
#: ShardedDataParallel`), never through the package facade, still get the
#: explanation.
_EXPLAINER_MODULES = ("keras_tpu_mem.planning.oom",)


def register_error_explainer(fn: Callable) -> None:
    """Adds `fn(model, features, global_batch_size, error) -> Exception | None`, asked
    for a clearer exception when a fit's step fails and no feature explained it.

    `features` are those of the failed fit, already taken off the model (an
    explainer may compile the step again with them); `global_batch_size` is
    the first step's global batch, or None where it was not static. The first
    explainer that returns an exception wins; registering the same function
    twice adds it once. The planner registers its out-of-memory explanation
    here, so the engine never imports the planner.

    Example:

    ```python
    def explain(model, features, global_batch_size, error):
        if "RESOURCE_EXHAUSTED" in str(error):
            return MemoryError(f"batch {global_batch_size} does not fit")
        return None

    register_error_explainer(explain)
    ```
    """
    if not callable(fn):
        raise TypeError(f"`fn` must be callable, got {type(fn).__name__}.")
    if fn not in _ERROR_EXPLAINERS:
        _ERROR_EXPLAINERS.append(fn)


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


class FitRefused(ValueError):
    """Raised by a first-batch observer (`observe_first_batch`) that refuses the fit it
    sees: the engine puts the model's state back as it was before the call, runs
    `undo` (if given), and lets it end the fit. Any other error of an observer is only
    logged: observing must never break training.

    Args:
        message: What was refused and how to fix it.
        undo: Optional callable run after the state is back (e.g. a callback's own
            changes to the model at `on_train_begin`).
    """

    def __init__(self, message: str, undo: Callable | None = None):
        super().__init__(message)
        self.undo = undo


class _StandIn:
    """Stands in for the train function `inner`; its attributes (`jitted_step` on JAX)
    read through."""

    def __init__(self, engine, inner):
        self.engine = engine
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)


class _FirstCallObserver(_StandIn):
    """Stands in for the train function until its first call, then hands it back.

    Only the engine creates it (see `observe_first_batch`).
    """

    def __call__(self, *args, **kwargs):
        model = self.engine.model
        if model.__dict__.get("train_function") is self:
            model.train_function = self.inner
        observers, self.engine._observers = self.engine._observers, []
        size = None
        step = self.engine.backend_step
        if hasattr(step, "peek_first_call"):
            # On JAX the call's data is an iterator: reading the first batch
            # consumes it, so the step hands back args that yield it again. It
            # never raises: a batch taken and then dropped here would be lost.
            size, args = step.peek_first_call(args)
        else:
            try:
                size = step.global_batch_size_of_call(args)
            except Exception as err:  # the observation must never break training
                logger.debug("could not read the batch size of the first step: %s", err)
        for fn in observers:
            try:
                fn(size)
            except FitRefused as refusal:
                step.abandon_call(args)
                if refusal.undo is not None:
                    refusal.undo()
                raise
            except Exception as err:
                logger.debug("first-batch observer failed: %s", err)
        return self.inner(*args, **kwargs)


class _SkippingTrainFunction(_StandIn):
    """Stands in for the train function of a resumed fit: a call the engine was told to
    skip (`Engine.skip_next_call`) reads its batches from the data and runs no step;
    every other call goes through. Only the engine creates it (`Engine.start_skipping`).
    """

    def __call__(self, *args, **kwargs):
        count, self.engine._skip_count = self.engine._skip_count, 0
        if count:
            self.engine.skipped_calls += 1
            return self.engine.backend_step.skip_call(args, count)
        return self.inner(*args, **kwargs)


class Engine:
    """Owns the train function of one model. Get it with `Engine.attach(model)`."""

    _ATTR = "_keras_tpu_mem_engine"

    def __init__(self, model):
        self.model = model
        #: The running backend's adapter; its trainer builds the step.
        self.backend = backends.current("keras_tpu_mem's training engine")
        self._pending: dict[str, Feature] = {}
        self.features: list[Feature] = []
        self._installed = False
        self._next_begin_step: int | None = None
        self._steps_per_epoch: int | None = None
        self._cache = None
        self._observers: list[Callable] = []
        self._window_position = 0
        self._skip_count = 0
        #: Train-function calls skipped so far (a resumed fit's earlier batches): a
        #: callback that counts steps tells a skipped call from a step by it.
        self.skipped_calls = 0
        self._engaged = False
        self.num_builds = 0
        #: Global batch of the first step of the current fit with features (for
        #: the OOM explanation; None where it is not static).
        self.last_global_batch_size: int | None = None
        self.backend_step = self.backend.trainer.Step(self)

    # ------------------------------------------------------------ attachment
    @classmethod
    def of(cls, model) -> Engine | None:
        """The model's engine if one is attached, else None (creates nothing)."""
        return getattr(model, cls._ATTR, None)

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

    def engage(self) -> None:
        """Makes every later `fit` of the model ask the backend whether its state needs
        the engine's step (`Step.owns_step()`: state sharded over the data axis on
        JAX), and run it then even with no feature callback (see `engage`)."""
        self._engaged = True
        self._take_over_make_train_function()

    def register(self, feature: Feature) -> None:
        """Adds a feature to the next `fit` of this model."""
        if not isinstance(feature, Feature):
            raise TypeError(f"Expected a keras_tpu_mem Feature, got {type(feature).__name__}.")
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

    def unobserve(self, fn: Callable) -> None:
        """Withdraws `fn` (`observe`) if it has not been called: a fit that ran no
        step (resumed at its end, or one that raised before it) must not hand its
        observer to the next fit's first batch."""
        while fn in self._observers:
            self._observers.remove(fn)

    # ------------------------------------------------------------ resuming
    def start_skipping(self) -> None:
        """Lets this fit skip calls (`skip_next_call`): a run resumed mid-epoch reads the
        epoch's first batches again, to reach its position, without training on them.
        Call it after Keras made the train function (`on_train_begin`); it holds until
        `stop_skipping`."""
        if self.model.__dict__.get("train_function") is None:
            raise RuntimeError("start_skipping() needs the fit's train function: call it "
                               "from on_train_begin or later.")
        inner = self._train_function_under_observer()
        if not isinstance(inner, _SkippingTrainFunction):
            self._set_train_function_under_observer(_SkippingTrainFunction(self, inner))

    def skip_next_call(self, count: int) -> None:
        """The next train-function call reads `count` batches (its steps) and runs no
        step; it returns no logs. Needs `start_skipping`."""
        self._skip_count = check_positive_int(count, "count")

    def stop_skipping(self) -> None:
        """Takes the skipping wrapper of `start_skipping` off the train function."""
        self._skip_count = 0
        inner = self._train_function_under_observer()
        if isinstance(inner, _SkippingTrainFunction):
            self._set_train_function_under_observer(inner.inner)

    def _train_function_under_observer(self):
        """The model's train function, or the one a waiting `_FirstCallObserver` holds."""
        current = self.model.__dict__.get("train_function")
        return current.inner if isinstance(current, _FirstCallObserver) else current

    def _set_train_function_under_observer(self, fn) -> None:
        """Replaces what `_train_function_under_observer` returns (the observer hands
        `fn` back at its call)."""
        current = self.model.__dict__.get("train_function")
        if isinstance(current, _FirstCallObserver):
            current.inner = fn
        else:
            self.model.train_function = fn

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
        features = in_step_order(self._pending.values())
        self._pending = {}
        previous = [f for f in self.features if f not in features]
        for feature in previous:  # features of an earlier, interrupted fit
            self._uninstall(feature)
        if not features and not (self._engaged and self.backend_step.owns_step()):
            # No feature in this fit: Keras' own step. The override stays only
            # while someone still waits for the first batch of a fit.
            if not self._observers and not self._engaged:
                del model.__dict__["make_train_function"]
            self.features = []
            force = force or self._installed
            self._installed = False
            if model.__dict__.get("train_function") is not None and isinstance(
                    model.__dict__["train_function"], _FirstCallObserver):
                model.train_function = model.__dict__["train_function"].inner
            # Keras' JAX trainer returns None (it sets the attribute); TensorFlow's
            # returns the function: read what it set, as the first-call observer wraps it.
            type(model).make_train_function(model, force=force)
            return model.train_function
        self.features = features
        self._window_position = 0
        train_function, loss = model.__dict__.get("train_function"), getattr(model, "loss", None)
        installed = []
        try:
            for feature in features:
                # Listed before its install: one that fails half-way is taken off too.
                installed.append(feature)
                feature.install(model)
            self._check_compatible()
            # Each fit starts from the features' `init_state` (also a fit that reuses
            # the step traced before).
            if self.backend_step.start_feature_states(features):
                self._cache = None  # the TensorFlow step read state carriers made anew
            # A later fit with the very same feature objects and compile settings
            # reuses the traced step instead of tracing (and compiling) it again.
            key = (tuple(features), model.steps_per_execution, model.jit_compile,
                   model.run_eagerly, self.backend_step.distribution_key(),
                   id(model.optimizer), id(keras_compat.compiled_loss_object(model)),
                   id(keras_compat.compiled_metrics_object(model)))
            cached = self._cache
            if cached is None or not _same_key(cached[0], key):
                self._cache = (key, self.backend_step.build_train_function())
                self.num_builds += 1
        except Exception:
            # The fit ends here (Keras calls this before `on_train_begin`, so no
            # `on_train_end` follows): leave the model as it was before it.
            self._roll_back(installed, train_function, loss)
            raise
        model.train_function = self._cache[1]
        self._installed = True
        return model.train_function

    def _roll_back(self, installed: list[Feature], train_function, loss) -> None:
        """Undoes a failed set-up: `uninstall` in reverse order of `install`, and
        the model's train function and loss as they were before the `fit`."""
        model = self.model
        for feature in reversed(installed):
            try:
                feature.uninstall(model)
            except Exception as err:  # the set-up's own error is the one to raise
                logger.warning("Could not take %s off the model after its fit's set-up "
                               "failed: %s", feature.name, err)
        self.features = []
        if model.__dict__.get("train_function") is not train_function:
            model.train_function = train_function
        if getattr(model, "loss", None) is not loss:
            model.loss = loss

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

    # ------------------------------------------------------- feature state
    def feature_state(self, feature: Feature):
        """`feature`'s state (what its `init_state` made, as the last step left it),
        between steps: on JAX the arrays the next step takes, on TensorFlow the values
        of the variables that carry it. None where it has none (or, on TensorFlow, where
        the step that makes its carriers has not run yet)."""
        return self.backend_step.feature_state(feature)

    def set_feature_state(self, feature: Feature, state) -> None:
        """Replaces `feature`'s state between steps (a schedule at an epoch's start, a
        resume): the next step takes it. The same structure and shapes as the state
        it holds; each value is cast to the held one's dtype.

        Raises:
            ValueError: The feature holds no state, or `state` has another structure
                or other shapes.
        """
        self.backend_step.set_feature_state(feature, state)

    def note_batch_begin(self, begin_step: int, steps_per_epoch: int | None) -> None:
        """Feature callbacks report the position in the epoch before each call."""
        self._next_begin_step = begin_step
        self._steps_per_epoch = steps_per_epoch

    # -------------------------------------------------------------- checks
    def _check_compatible(self) -> None:
        counts = [f for f in self.features
                  if self.has_hook(f, "micro_batches") or self.has_hook(f, "batches_per_update")]
        if len(counts) > 1:
            names = ", ".join(type(f).__name__ for f in counts)
            raise ValueError(f"Only one micro-batching feature per fit, got: {names}.")
        if self.batches_per_update() > 1 and not getattr(self.backend_step,
                                                         "pulls_micro_batches", False):
            raise NotImplementedError(
                "Micro-batches pulled from the dataset (GradientAccumulation("
                "dataset_yields='micro_batches')) are not supported by the "
                f"{self.backend.label} engine yet; use dataset_yields='global_batches'."
            )
        check_float16_replicas(self.model, self.backend_step.num_replicas())

    # ------------------------------------------------------------ the step
    def micro_batch_count(self, per_replica_batch):
        """The micro-batch count of this engine's features (`step.micro_batch_count`)."""
        return micro_batch_count(self.features, per_replica_batch)

    @staticmethod
    def has_hook(feature, method: str) -> bool:
        """Whether `feature` fills the registration point `method` (e.g. "after_update")."""
        return getattr(type(feature), method) is not getattr(Feature, method)

    def batches_per_update(self) -> int:
        """Dataset batches per update (1 unless a feature pulls micro-batches)."""
        return batches_per_update(self.features)

    def pending_micro_batches(self) -> int:
        """Micro-batches pulled since the last update (0 at a window's end)."""
        return self._window_position

    def advance_window(self, count: int, k: int) -> int:
        """Notes `count` more micro-batches pulled towards updates of `k` each (the
        backend's pulled-micro-batch train function, after the call ran); returns
        the new `pending_micro_batches()`."""
        self._window_position = (self._window_position + count) % k
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
        if not features:
            return None
        _load_explainers()
        for explainer in list(_ERROR_EXPLAINERS):
            clearer = explainer(self.model, features, self.last_global_batch_size, error)
            if clearer is not None:
                return clearer
        return None

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


def _load_explainers() -> None:
    """Imports `_EXPLAINER_MODULES` (each registers itself; a second import is free)."""
    for name in _EXPLAINER_MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:  # the step's own error is the one to raise
            logger.warning("could not load the error explanation %s: %s", name, err)


def _is_end_of_data(error: Exception) -> bool:
    """StopIteration (JAX, PyDataset) or TensorFlow's OutOfRangeError: Keras' loop ends
    the epoch on them; they are not failures."""
    return isinstance(error, StopIteration) or type(error).__name__ == "OutOfRangeError"


def _same_key(a, b) -> bool:
    """Compares cache keys; features by identity (the key holds them, so ids stay valid)."""
    return (len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0]))
            and a[1:] == b[1:])


def engage(model) -> None:
    """Hands the model's `fit` to the engine wherever its backend needs it without a
    feature callback: on JAX, state (weights, optimizer slots) split over the data
    axis runs the engine's sharded step (`backends/jax/reducers.py`, `ShardedShardMap`), not
    Keras' own. Keras gives a distribution no hook on the models built under it, so
    whatever lays a model's state out sharded (`reshard`, a sharded distribution's
    helpers) calls this; a feature callback in the `fit` does the same by itself.

    Args:
        model: A `keras.Model`.

    Example:

    ```python
    with distribution.scope():  # one that splits the state over its batch axis
        model = make_model()
        engage(model)
        model.fit(x, y, batch_size=1024)  # the engine's sharded step
    ```
    """
    Engine.attach(model).engage()


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
