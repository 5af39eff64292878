"""`compiled_memory`: XLA's buffer assignment of the train step, compiled, not run.

`compiled_memory(model, batch_size)` compiles one Keras train step with XLA for
symbolic inputs of that batch (nothing runs, no weight or optimizer slot
changes) and reads how many bytes the arguments (weights, optimizer state, the
batch), the temporaries (activations, gradients, workspace) and the live-out
results take: the numbers XLA itself plans with (`memory.CompiledMemory`).

`Compiler` is the one compile path behind it and behind `plan`: the checks,
the cache, the byte counts of the model's state. The compile itself is the
backend's (`backends.current().compiled`: TensorFlow's `HloProto` buffer
assignment, JAX's `memory_analysis()`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
import weakref

import keras

from keras_tpu_mem import backends
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import check_positive_int, logger
from keras_tpu_mem.backends.contracts import CompileRefused
from keras_tpu_mem.backends.step import batches_per_update
from keras_tpu_mem.devices.units import dtype_bytes
from keras_tpu_mem.engine.compile import compile_context
from keras_tpu_mem.engine.core import Engine
from keras_tpu_mem.engine.feature import Feature, in_step_order
from keras_tpu_mem.planning.budget import check_headroom
from keras_tpu_mem.planning.memory import CompiledMemory
from keras_tpu_mem.planning.specs import (
    _check_model,
    _unique,
    infer_data_specs,
    sample_structures,
)
from keras_tpu_mem.planning.target import compiling_for, host_label
from keras_tpu_mem.planning.target import resolve as resolve_target
from keras_tpu_mem.shapes import deferring, is_shapes_only, reading_shapes

# Compiles are deterministic for a given model state, batch and data spec, and
# cost seconds to minutes: remember them per model (weakly, so models are
# still freed). The key changes with the optimizer, variables and dtypes.
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def feature_key(feature) -> tuple:
    """A cache key for a feature: its class and configuration where it has one that
    names no live object (a fresh `GradientAccumulation(8)` compiles as the last
    one did), else the object itself."""
    get_config = getattr(feature, "get_config", None)
    try:
        config = repr(get_config()) if get_config is not None else None
    except Exception:  # a feature whose config cannot be built: by identity
        config = None
    if config is None or " at 0x" in config:
        return (type(feature).__qualname__, id(feature))
    return (type(feature).__module__, type(feature).__qualname__, config)


def _state_key(model, xs, ys, features=()) -> tuple:
    specs = tuple((tuple(s.shape), s.dtype.name) for s in keras.tree.flatten((xs, ys)))
    variables = tuple((getattr(v, "path", v.name), tuple(v.shape), str(v.dtype))
                      for v in model.variables)
    policy = tuple(str(getattr(layer, "compute_dtype", ""))
                   for layer in keras_compat.flatten_layers(model, include_self=True))
    return (id(model.optimizer), type(model).train_step, specs, variables, policy,
            tuple(feature_key(f) for f in features))


def _build_for(model, xs, ys):
    """Creates any missing model, metric, loss and optimizer state, symbolically."""
    def to_keras(s):
        return keras.KerasTensor(tuple(s.shape), s.dtype.name)

    data = (keras.tree.map_structure(to_keras, xs), keras.tree.map_structure(to_keras, ys))
    if keras_compat.has_symbolic_build(model):
        keras_compat.symbolic_build(model, data)
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def _sorted(features):
    return in_step_order(features)


def _micro_batches(model, features, per_replica_batch: int) -> int:
    """The micro-batches of one update for these features (1: none): the engine's
    split of the batch, or the batches pulled from the dataset (the compiled step is
    then one of them, and holds the accumulators)."""
    if not features:
        return 1
    with compile_context(model, features):
        split = int(Engine.attach(model).micro_batch_count(per_replica_batch))
    return max(split, batches_per_update(features))


def _device_bytes(items, backend, variables: bool = True) -> int:
    """Bytes one device holds of variables (deduplicated) or of data specs."""
    items = _unique(items) if variables else items
    return sum(int(math.prod(backend.device_shape(item.shape, item if variables else None)))
               * dtype_bytes(item.dtype) for item in items)


class Compiler:
    """Compiles one model's train step at several batches, caching the results.

    Attributes:
        user_model: The model asked about.
        copied: Whether the step is compiled on a host copy (a model built
            under a `tf.distribute` strategy).

    Example:

    ```python
    compiler = Compiler(model, what="plan")
    small, large = compiler(32), compiler(64)   # per-replica batches
    ```
    """

    def __init__(self, model, x_spec=None, y_spec=None, what="compiled_memory",
                 sample_batch=None, target=None):
        self.backend_name = backends.current(what).name
        self.backend = backends.get(self.backend_name).compiled
        _check_model(model, what)
        if sample_batch is not None and (x_spec is not None or y_spec is not None):
            raise ValueError(f"{what}: pass either `sample_batch` or `x_spec`/`y_spec`, not "
                             "both: the sample batch's arrays already define the specs.")
        if not self.backend.compiles_deferred() and is_shapes_only(model):
            raise ValueError(
                f"{what}: the model was built in ktm.shapes_only(), and the "
                f"{backends.current(what).label} backend compiles a step from the variables "
                "themselves. Plan it with plan(..., device='v5e-8', compiler='tpu') (its JAX "
                "lowering, compiled by XLA:TPU), or call ktm.materialize(model) first.")
        self.user_model = model
        self.what = what
        self.x_spec, self.y_spec = x_spec, y_spec
        # Only its shapes and dtypes are kept (`specs.sample_structures`), not the data.
        self.sample_batch = (None if sample_batch is None
                             else sample_structures(sample_batch))
        self.copied = self.backend.distributed_strategy(model) is not None
        # The TPU slice XLA:TPU compiles for (`target.CompileTarget`), None: the host.
        self.target = target
        self._model = None
        self._built = False
        self._scope_args = None
        self._prepared = None  # (cache key, the backend's prepared step): `prepare`

    @contextlib.contextmanager
    def targeting(self):
        """The block in which this compiler compiles: deferred variables (a model built
        in `ktm.shapes_only()`) read as shapes, the state a compile creates for such a
        model (optimizer slots, feature state) is deferred too, and with a `target`
        every compile is for the slice: the model's missing state is built on the host
        first (a slice's devices hold no values), then its layouts on the slice's mesh
        are proposed to the compiles.

        Example:

        ```python
        with compiler.targeting():
            compiler.compile_batch(256)     # XLA:TPU's compile for the slice
        ```
        """
        deferred = is_shapes_only(self.user_model)
        with reading_shapes(), (deferring() if deferred else contextlib.nullcontext()):
            if self.target is None:
                yield
                return
            if not self._built:
                xs, ys = self.specs(len(self.target.devices))
                _build_for(self.model, xs, ys)
                self._built = True
            active = keras.distribution.distribution()
            self._scope_args = (self.model, self.target, active, self.what)
            try:
                with compiling_for(*self._scope_args):
                    yield
            finally:
                self._scope_args = None

    def scope_factory(self):
        """A callable giving a context in which a later compile is this one's (a
        `CompiledMemory.by_layer()` after the plan has returned)."""
        deferred = is_shapes_only(self.user_model)
        if self._scope_args is not None:
            args = self._scope_args
            return lambda: _reading(compiling_for(*args), deferred)
        scope = self.backend.compile_scope()
        return lambda: _reading(scope(), deferred)

    @property
    def label(self) -> str:
        """Which compiler answers: `"XLA:TPU (TPU v5 lite, v5e:4x4, 16 devices, libtpu
        0.0.42.1)"`, else the host's, named from its first compile."""
        return self.target.label if self.target is not None else ""

    @property
    def reserved_bytes(self) -> int:
        """HBM per device XLA:TPU's compiles leave free (`CompileTarget.reserved_bytes`);
        0 on the host."""
        return self.target.reserved_bytes if self.target is not None else 0

    @property
    def model(self):
        """The model compiled: the user's, or a host copy of a distributed one."""
        if self._model is None:
            strategy = self.backend.distributed_strategy(self.user_model)
            if strategy is None:
                self._model = self.user_model
            else:
                logger.info(
                    "%s: the model was built under %s; compiling one replica's step on a "
                    "host copy (the model itself is not touched).", self.what,
                    type(strategy).__name__)
                self._model = self.backend.host_copy(self.user_model)
        return self._model

    def specs(self, batch_size: int):
        return infer_data_specs(self.user_model, batch_size, self.x_spec, self.y_spec,
                                self.sample_batch)

    @property
    def replicas(self) -> int:
        """Replicas a global batch splits over: the batch-axis devices of the active
        `keras.distribution` (JAX), the model's `tf.distribute` replicas (TensorFlow)."""
        return int(self.backend.replicas(self.user_model))

    def compile_batch(self, global_batch: int, features=(),
                      hlo_text: bool = False) -> CompiledMemory:
        """The step at a global batch: `global_batch / replicas` examples per replica (a
        `CompiledMemory` whose `batch_size` is the global batch)."""
        replicas = self.replicas
        if global_batch % replicas:
            raise ValueError(
                f"{self.what}: `batch_size` {global_batch} (the global batch) does not split "
                f"over the {replicas} replicas the model trains on; use a multiple of "
                f"{replicas}.")
        per_replica = global_batch // replicas
        result = self.compile_global(per_replica * self.backend.compile_shards(), features,
                                     hlo_text)
        return dataclasses.replace(result, batch_size=global_batch, replicas=replicas)

    def __call__(self, per_replica: int, features=(), hlo_text: bool = False,
                 meanwhile=None) -> CompiledMemory:
        """The step at a per-replica batch (one data-parallel shard's, see `compile_global`)."""
        result = self.compile_global(per_replica * self.backend.compile_shards(), features,
                                     hlo_text, meanwhile=meanwhile)
        if result.batch_size != per_replica:
            return dataclasses.replace(result, batch_size=per_replica)
        return result

    def prepare(self, per_replica: int, features=()) -> None:
        """Does now what a later `self(per_replica, features)` does before XLA compiles
        (the backend's `prepare_step`: on JAX the trace and lowering), under the
        distribution and layouts active now, so that it can overlap a compile in
        progress (`meanwhile=`). Nothing where that step is cached or the backend has
        nothing to prepare; only the last prepared step is kept."""
        global_batch = per_replica * self.backend.compile_shards()
        features = tuple(features)
        xs, ys = self.specs(global_batch)
        if not self._built:
            return  # the first compile builds the model's state
        key = self._key(xs, ys, features, None)
        if key in self._cache():
            return
        prepared = self.backend.prepare_step(self.model, xs, ys, features, compile_context)
        self._prepared = None if prepared is None else (key, prepared)

    def _cache(self) -> dict:
        try:
            return _CACHE.setdefault(self.user_model, {})
        except TypeError:  # not weak-referenceable: no cache
            return {}

    def _key(self, xs, ys, features, keras_step) -> tuple:
        # XLA:TPU's peak depends on the HBM it may use.
        return (_state_key(self.user_model, xs, ys, features), self.backend.cache_scope(),
                keras_step, self.reserved_bytes)

    def compile_global(self, global_batch: int, features=(),
                       hlo_text: bool = False, keras_step: bool | None = None,
                       meanwhile=None) -> CompiledMemory:
        """The step at the batch one compile takes: one replica's on TensorFlow, the
        global batch over the active `keras.distribution`'s devices on JAX.
        `meanwhile`: work to overlap with XLA's compile (`Compiled.compile_step`)."""
        self.backend.check_context(self.what)
        features = tuple(features)
        shards = self.backend.compile_shards()
        if global_batch % shards:
            raise ValueError(
                f"{self.what}: the batch {global_batch} does not split over the {shards} "
                "data-parallel devices of the active keras.distribution; use a multiple "
                f"of {shards}.")
        xs, ys = self.specs(global_batch)
        cache = self._cache()
        key = self._key(xs, ys, features, keras_step)
        cached = cache.get(key)
        if cached is not None and (cached.hlo_text or not hlo_text):
            return cached
        model = self.model
        if not self._built:
            _build_for(model, xs, ys)
            self._built = True
            # Building may add variables.
            key = self._key(xs, ys, features, keras_step)
            cached = cache.get(key)
            if cached is not None and (cached.hlo_text or not hlo_text):
                return cached
        # Before the compile: a batch the features cannot split is their own
        # clear error, not a failed trace.
        micro = _micro_batches(model, features, global_batch // shards)
        description = (f"the engine's step for {', '.join(type(f).__name__ for f in features)}"
                       if features else "the model's train step")
        try:
            prepared, self._prepared = self._prepared, None
            stats = self.backend.compile_step(
                model, xs, ys, features, compile_context, hlo_text, description,
                keras_step=keras_step, meanwhile=meanwhile,
                prepared=prepared[1] if prepared is not None and prepared[0] == key else None)
        except CompileRefused as verdict:
            stats = self._refused_stats(model, xs, ys, verdict)
        trainable = _device_bytes(model.trainable_weights, self.backend)
        result = CompiledMemory(
            batch_size=global_batch,
            argument_bytes=stats["argument"],
            data_bytes=_device_bytes(keras.tree.flatten((xs, ys)), self.backend, variables=False),
            temp_bytes=stats["temp"],
            live_out_bytes=stats["live_out"],
            alias_bytes=stats["alias"],
            constant_bytes=stats["constant"],
            laid_out_bytes=stats.get("laid_out", 0),
            weight_bytes=_device_bytes(model.weights, self.backend),
            optimizer_bytes=_device_bytes(model.optimizer.variables, self.backend),
            module_name=stats["module_name"],
            platform=stats["platform"],
            features=tuple(type(f).__name__ for f in _sorted(features)),
            micro_batches=micro,
            accumulator_bytes=trainable if micro > 1 else 0,
            pulled=batches_per_update(features) > 1,
            hlo_text=stats["hlo_text"],
            backend=self.backend_name,
            devices=stats["devices"],
            compiler=self.label or host_label(stats["platform"], stats["devices"]),
            refused=stats.get("refused", ""),
            reserved_bytes=self.reserved_bytes,
            capacity_bytes=self.target.capacity_bytes if self.target is not None else 0,
            layer_source=(None if stats.get("refused") else
                          _LayerSource(self, xs, ys, features, description)),
        )
        cache[key] = result
        logger.debug("%s: compiled the step at batch %d: %s", self.what, global_batch, result)
        return result


    def _refused_stats(self, model, xs, ys, verdict) -> dict:
        """The figures of a step XLA refused as too large for the device: the state and
        the batch as laid out, the rest of what XLA said it required as temporaries."""
        state = (_device_bytes(model.variables, self.backend)
                 + _device_bytes(model.optimizer.variables, self.backend)
                 + _device_bytes(keras.tree.flatten((xs, ys)), self.backend, variables=False))
        required = verdict.required_bytes or 0
        return dict(argument=state, temp=max(0, required - state), live_out=0, alias=0,
                    constant=0, module_name="", platform=verdict.platform,
                    devices=verdict.devices,
                    hlo_text="", refused=verdict.message)


@contextlib.contextmanager
def _reading(scope, deferred: bool):
    with reading_shapes(), (deferring() if deferred else contextlib.nullcontext()), scope:
        yield


class _LayerSource:
    """Builds `CompiledMemory.by_layer()`'s table on demand: the same step compiled again
    with XLA's buffer assignment written out, under the distribution it was compiled
    for."""

    def __init__(self, compiler, xs, ys, features, description):
        # The user's model weakly (the cache is keyed by it); a host copy (a model built
        # under a tf.distribute strategy) strongly: nothing else keeps it.
        model = compiler.model
        self.model = (lambda: model) if compiler.copied else weakref.ref(model)
        self.backend_name = compiler.backend_name
        self.scope = compiler.scope_factory()
        self.args = (xs, ys, tuple(features), description)
        self.table = None

    def __deepcopy__(self, memo):
        return self  # holds no values of its own worth copying (a model reference, specs)

    def __call__(self):
        if self.table is not None:
            return self.table
        from keras_tpu_mem.planning.by_layer import LayerTable

        backend = backends.get(self.backend_name)
        layers = backend.compiled_layers
        layers.require()
        model = self.model()
        if model is None:
            raise ValueError("by_layer(): the model this step was compiled for is gone.")
        xs, ys, features, description = self.args
        with self.scope():
            stats = backend.compiled.compile_step(model, xs, ys, features, compile_context,
                                                  False, description, dump=True)
            rows, peak = layers.layer_rows(model, stats["dump"], backend.compiled.device_shape)
        total = (stats["argument"] + stats["temp"] + stats["live_out"] - stats["alias"]
                 + stats["constant"])
        self.table = LayerTable(rows, peak, total)
        return self.table


def check_callbacks(callbacks, what: str) -> tuple:
    """The engine features among `callbacks` (a list as passed to `fit`).

    Callbacks that are not engine features (monitors, Keras' own) do not
    change the compiled step, so they take no part in it.

    Raises:
        TypeError: `callbacks` is not a list/tuple of Keras callbacks.
    """
    if callbacks is None:
        return ()
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"{what}: `callbacks` must be a list of Keras callbacks (as passed "
                        f"to fit), got {type(callbacks).__name__}.")
    features = []
    for i, callback in enumerate(callbacks):
        if isinstance(callback, Feature):
            features.append(callback)
        elif not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(f"{what}: `callbacks[{i}]` must be a keras.callbacks.Callback, "
                            f"got {type(callback).__name__}.")
    names = [f.name for f in features]
    doubles = sorted({n for n in names if names.count(n) > 1})
    if doubles:
        raise ValueError(f"{what}: `callbacks` has more than one feature of kind "
                         f"{', '.join(doubles)}; a fit would keep only the last.")
    return tuple(features)


def _how_to_compile_for_tpu() -> str:
    """What a refusal that needs XLA:TPU's compile tells the user to do, on this backend."""
    backend = backends.current("compiled_memory")
    if backend.compiles_for_tpu():
        return "pass a TPU `device` such as 'v5e-8' with libtpu installed"
    return (f"XLA:TPU's compile runs on the JAX backend (KERAS_BACKEND=jax), and this is "
            f"the {backend.label} backend")


def compiled_memory(model, batch_size: int | None = None, *, callbacks=None, x_spec=None,
                    y_spec=None, sample_batch=None, hlo_text: bool = True,
                    per_replica_batch_size: int | None = None, device=None,
                    compiler: str = "auto", mesh: dict | None = None,
                    headroom: float = 0.0) -> CompiledMemory:
    """Compiles the train step with XLA and returns its memory breakdown.

    Without `callbacks` the step is Keras' own `model.train_step` (forward,
    loss, gradients, optimizer update, metrics). With `callbacks`, the list you
    pass to `fit`, it is **the step the engine installs for them**: their
    features (gradient accumulation, bf16 compute, rematerialisation, pruning
    masks, distillation) are installed on the model, the engine's per-replica
    step is traced on symbolic inputs and compiled with XLA (`jit_compile=True`,
    as on a TPU), and the features are uninstalled again. Callbacks that are
    not engine features (monitors) do not change the step and take no part.
    Nothing is executed: weights, optimizer slots, `optimizer.iterations` and
    dtype policies keep their values, and the callbacks are ready for a later
    `fit`. Missing state is created first (an unbuilt optimizer gets its slots,
    as `fit` would).

    `batch_size` is the **global** batch, as `fit` and `plan` take it, on both
    backends: on TensorFlow a model built under a `tf.distribute` strategy of R
    replicas is compiled on a host copy for one replica's `batch_size / R`
    examples; on JAX (`KERAS_BACKEND=jax`) the step is lowered with
    `jax.jit(...).lower(...).compile()` and read through `memory_analysis()`,
    and called inside a `keras.distribution`'s `scope()` it compiles for that
    distribution, `batch_size` split over its batch-axis devices. Every byte
    count is what one replica (one device on JAX) holds.

    Args:
        model: A compiled `keras.Model`.
        batch_size: The global batch to compile for; it must split evenly over
            the replicas.
        callbacks: Optional list of callbacks as passed to `fit`.
        x_spec, y_spec: Optional specs (`tf.TensorSpec` on TensorFlow,
            `jax.ShapeDtypeStruct` on JAX, or `keras.KerasTensor`; structures of
            them, batch first) for inputs / labels the model cannot tell
            (subclassed models, unknown sequence lengths, unusual losses).
        sample_batch: Instead of specs, one batch as `fit` takes it (an array, a
            dict of arrays, `(x, y)` or `(x, y, sample_weight)`), of any batch
            size: its arrays' shapes past the batch axis and dtypes define the
            specs (labels from the loss where it has none). The step is compiled
            without sample weights.
        hlo_text: Keep the optimized HLO text in `CompiledMemory.hlo_text`
            (on TensorFlow a second XLA compile of the same step; False skips it).
        device: A TPU slice to compile for with XLA:TPU ahead of time, e.g.
            `"v5e-16"`, `"v3-8"` (no TPU needed: `pip install
            "keras-tpu-mem[tpu-plan]"` adds libtpu); None (default): the host's XLA.
            See `plan` for how the model is laid out on the slice.
        compiler: `"auto"` (XLA:TPU when `device` names a slice and libtpu loads,
            else the host's, with a log line), `"tpu"` (XLA:TPU or a ValueError),
            `"host"`. `CompiledMemory.compiler` says which answered; a step XLA:TPU
            refuses as too large comes back with `refused` set (XLA's message).
        mesh: Axis sizes of the slice's mesh instead of the rule (see `plan`).
        headroom: Fraction of each device's HBM XLA:TPU's compile leaves free, as
            `plan`'s headroom is (0.0, default: the whole chip). XLA:TPU schedules a
            step to the memory it is given, so a step that fits the chip may be
            refused, or compile to a lower peak, with part of it reserved;
            `CompiledMemory.reserved_bytes` says how much was. Only XLA:TPU's compile
            takes one: with the host's compiler a non-zero headroom is a ValueError.
        per_replica_batch_size: Deprecated: the per-replica batch, the meaning
            `batch_size` had on TensorFlow before; use `batch_size` = this x the
            replicas.

    Returns:
        A `CompiledMemory`; `print` it for a table, `.by_layer()` for the same step's
        memory by Keras layer.

    Raises:
        TypeError: `callbacks` is not a list of Keras callbacks.
        ValueError: bad `batch_size` (or one that does not split over the
            replicas), `sample_batch` with `x_spec`/`y_spec`, a model whose
            input shapes are unknown without either, or a feature that cannot
            split the batch.

    Example:

    ```python
    plain = ktm.compiled_memory(model, batch_size=8192)
    accumulated = ktm.compiled_memory(model, batch_size=8192,
                                      callbacks=[ktm.GradientAccumulation(8)])
    print(accumulated)      # arguments / temporaries (incl. accumulators) / total
    accumulated.temp_bytes < plain.temp_bytes
    "while" in accumulated.hlo_text     # the micro-batch loop
    # Unknown sequence length: one real batch says the shapes.
    ktm.compiled_memory(text_model, 64, sample_batch=(tokens[:2], labels[:2]))
    ```
    """
    if per_replica_batch_size is not None:
        if batch_size is not None:
            raise ValueError("compiled_memory: pass `batch_size` (the global batch) or the "
                             "deprecated `per_replica_batch_size`, not both.")
        check_positive_int(per_replica_batch_size, "per_replica_batch_size")
        warnings.warn(
            "compiled_memory(per_replica_batch_size=...) is deprecated: `batch_size` is the "
            "global batch on every backend (split over the replicas); pass "
            "batch_size=per_replica_batch_size x replicas.", DeprecationWarning, stacklevel=2)
    elif batch_size is None:
        raise TypeError("compiled_memory() needs `batch_size` (the global batch).")
    else:
        check_positive_int(batch_size, "batch_size")
    if not isinstance(hlo_text, bool):
        raise TypeError(f"`hlo_text` must be True or False, got {hlo_text!r}.")
    features = check_callbacks(callbacks, "compiled_memory")
    headroom = check_headroom(headroom)
    target, note = resolve_target(device, compiler, "compiled_memory", mesh)
    if note is not None:
        logger.info("compiled_memory: %s", note)
    if headroom:
        if target is None:
            raise ValueError(
                f"compiled_memory: `headroom` ({headroom}) reserves HBM in XLA:TPU's "
                f"compile, and this step compiles with the host's XLA (device={device!r}, "
                f"compiler={compiler!r}); {_how_to_compile_for_tpu()}, or headroom=0.0.")
        target = target.with_headroom(headroom)
    compiler = Compiler(model, x_spec, y_spec, sample_batch=sample_batch, target=target)
    with compiler.targeting():
        if per_replica_batch_size is not None:
            batch_size = per_replica_batch_size * compiler.replicas
        return compiler.compile_batch(batch_size, features, hlo_text)


def step_memory(model, batch_size: int, *, step: str, device=None, compiler: str = "auto",
                mesh: dict | None = None) -> CompiledMemory:
    """`compiled_memory` of a chosen step for state split over the batch axis (JAX):
    `step="keras"`, Keras' own `train_step` with the layouts left to XLA's SPMD
    partitioner, or `"engine"`, the engine's `shard_map` step (`fit` runs the first on a
    TPU mesh, the second elsewhere). For comparing the two (`benchmarks/tpu_plans.py`).

    Example:

    ```python
    with ktm.ShardedDataParallel().scope():
        spmd = step_memory(model, 256, step="keras", device="v5e-8")
        engine = step_memory(model, 256, step="engine", device="v5e-8")
    ```
    """
    check_positive_int(batch_size, "batch_size")
    if step not in ("keras", "engine"):
        raise ValueError(f"`step` must be 'keras' or 'engine', got {step!r}.")
    target, _ = resolve_target(device, compiler, "step_memory", mesh)
    compiler = Compiler(model, what="step_memory", target=target)
    with compiler.targeting():
        replicas = compiler.replicas
        if batch_size % replicas:
            raise ValueError(f"step_memory: `batch_size` {batch_size} does not split over "
                             f"the {replicas} replicas; use a multiple of {replicas}.")
        result = compiler.compile_global(batch_size, (), True, keras_step=step == "keras")
        return dataclasses.replace(result, replicas=replicas)
