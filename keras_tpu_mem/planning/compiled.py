"""Compile readers: XLA's buffer assignment of the train step (`compiled_memory`).

Two public functions live here:

* `compiled_memory(model, batch_size)` compiles one Keras train step with XLA
  for symbolic inputs of that per-replica batch (nothing runs, no weight or
  optimizer slot changes) and reads XLA's *buffer assignment* out of the
  compiled `HloProto`: how many bytes the arguments (weights, optimizer state,
  the batch), the temporaries (activations, gradients, workspace) and the
  live-out results take. These are the numbers XLA itself plans with; JAX's
  `compile().memory_analysis()` reports the same quantities.
* `plan(model, global_batch_size, device="v3-8")` turns a few such compiles
  into a per-replica budget for a TPU slice (or any device size), says whether
  it fits with some headroom, and which gradient-accumulation split (and what
  bfloat16 compute) would make it fit.

How the buffer assignment maps to the numbers (see docs/planning.md):

* arguments   = sum of allocations with `is_entry_computation_parameter`
* live-out    = sum of allocations with `maybe_live_out`
* aliased     = parameter allocations updated in place (variables: counted in
  arguments and live-out, held once): `is_parameter_aliased_with_output`,
  or the module's `input_output_alias` where the proto lacks that flag (TF 2.19)
* temporaries = every other allocation that is neither thread-local (stack)
  nor constant: XLA's preallocated temp buffer(s), packed by its heap
  simulator, holding activations, gradients and workspace
* total       = arguments + temporaries + live-out - aliased + constants
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import weakref

from keras_tpu_mem import devices
from keras_tpu_mem._utils import check_positive_int, logger
from keras_tpu_mem.backends.require import require_tensorflow_backend
from keras_tpu_mem.planning.specs import (
    _check_model,
    _spec_bytes,
    _unique,
    _variable_bytes,
    infer_data_specs,
)


# --------------------------------------------------------------------------
# compiled_memory
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's buffer assignment of one compiled train step, in bytes.

    Attributes:
        batch_size: The per-replica batch the step was compiled for.
        argument_bytes: Entry parameters: weights, optimizer slots, metric
            state and the batch itself.
        data_bytes: The part of `argument_bytes` that is the batch (x, y).
        temp_bytes: XLA's temporaries: activations kept for the backward pass,
            gradients and fusion workspace, packed by liveness.
        live_out_bytes: Results that outlive the step (updated variables,
            metric values).
        alias_bytes: Parameters updated in place (in both arguments and live-out).
        constant_bytes: Constants baked into the program.
        weight_bytes: Bytes of `model.weights` (for reference).
        optimizer_bytes: Bytes of the optimizer's variables (for reference).
        module_name: The HLO module's name.
        platform: Where the compile ran, e.g. `"CPU"`.
        features: Names of the feature callbacks whose engine step was
            compiled (empty: Keras' own `train_step`).
        micro_batches: Micro-batches per update in that step (1: none).
        accumulator_bytes: The gradient accumulators of the micro-batch loop
            (one per trainable weight, in the weights' dtype), 0 without
            accumulation. They are loop state, so XLA counts them inside
            `temp_bytes`; reported apart so that a plan can name them.
        hlo_text: The optimized HLO text of the compiled step (which
            collectives, inside which loop), `""` where the reader has none.
        backend: `"tensorflow"` or `"jax"`.
        devices: Devices the step was compiled for (JAX under a
            `keras.distribution`; 1 on TensorFlow, whose compile is one
            replica's); every byte count is one device's.
    """

    batch_size: int
    argument_bytes: int
    data_bytes: int
    temp_bytes: int
    live_out_bytes: int
    alias_bytes: int
    constant_bytes: int
    weight_bytes: int
    optimizer_bytes: int
    module_name: str = ""
    platform: str = "CPU"
    features: tuple[str, ...] = ()
    micro_batches: int = 1
    accumulator_bytes: int = 0
    hlo_text: str = dataclasses.field(default="", repr=False)
    backend: str = "tensorflow"
    devices: int = 1

    @property
    def total_bytes(self) -> int:
        """Everything the step holds at once: arguments, temporaries, results."""
        return (
            self.argument_bytes
            + self.temp_bytes
            + self.live_out_bytes
            - self.alias_bytes
            + self.constant_bytes
        )

    @property
    def state_bytes(self) -> int:
        """Arguments that are not the batch: weights, optimizer and metric state."""
        return self.argument_bytes - self.data_bytes

    def table(self) -> str:
        fb = devices.format_bytes
        rows = [
            ("arguments", self.argument_bytes,
             f"weights {fb(self.weight_bytes)}, optimizer {fb(self.optimizer_bytes)}, "
             f"batch {fb(self.data_bytes)}, other state "
             f"{fb(self.state_bytes - self.weight_bytes - self.optimizer_bytes)}"),
            ("temporaries", self.temp_bytes,
             "activations, gradients, workspace"
             + (f"; incl. accumulators {fb(self.accumulator_bytes)} "
                f"({self.micro_batches} micro-batches)" if self.accumulator_bytes else "")),
            ("live-out", self.live_out_bytes,
             f"{fb(self.alias_bytes)} of it aliases arguments (in-place updates)"),
            ("constants", self.constant_bytes, ""),
            ("total", self.total_bytes, "arguments + temporaries + live-out - aliased"),
        ]
        step = (f"the engine's step for {', '.join(self.features)}" if self.features
                else "one train step")
        per = "per device" if self.backend == "jax" else "per-replica"
        head = (f"XLA buffer assignment of {step}, {per} batch "
                f"{self.batch_size} ({self.platform} compile)")
        lines = [head]
        for name, value, note in rows:
            lines.append(f"  {name:<12}{fb(value):>12}  {note}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _hlo_proto_class():
    try:  # TensorFlow 2.16 - 2.21 ship the XLA protos under tensorflow.compiler.
        from tensorflow.compiler.xla.service import hlo_pb2
    except ImportError:  # pragma: no cover - other layouts
        try:
            from xla.service import hlo_pb2  # type: ignore[no-redef]
        except ImportError as err:
            raise RuntimeError(
                "compiled_memory needs XLA's HloProto definitions "
                "(tensorflow.compiler.xla.service.hlo_pb2), which this TensorFlow "
                "does not ship."
            ) from err
    return hlo_pb2.HloProto


def _buffer_stats(serialized: bytes) -> dict:
    proto = _hlo_proto_class()()
    proto.ParseFromString(serialized)
    stats = dict(argument=0, temp=0, live_out=0, alias=0, constant=0)
    # Parameters updated in place. Newer XLA marks the allocation
    # (`is_parameter_aliased_with_output`); every version lists the module's
    # input/output aliases, which is what TensorFlow 2.19's proto offers.
    aliased = {
        (int(e.parameter_number), tuple(e.parameter_shape_index))
        for e in proto.hlo_module.input_output_alias.entries
    }
    for alloc in proto.buffer_assignment.buffer_allocations:
        size = int(alloc.size)
        if alloc.is_entry_computation_parameter:
            stats["argument"] += size
            number = int(alloc.parameter_number)
            flag = getattr(alloc, "is_parameter_aliased_with_output", False)
            if flag or (number, tuple(alloc.parameter_shape_index)) in aliased:
                stats["alias"] += size
        if alloc.maybe_live_out:
            stats["live_out"] += size
        if alloc.is_constant:
            stats["constant"] += size
        if not (alloc.is_entry_computation_parameter or alloc.maybe_live_out
                or alloc.is_thread_local or alloc.is_constant):
            stats["temp"] += size
    stats["module_name"] = proto.hlo_module.name
    return stats


def _non_default_strategy(model):
    """The strategy a model was built under, or None for the default strategy.

    Keras' TensorFlow trainer records the strategy only when the model is
    created inside a `strategy.scope()`.
    """
    from keras_tpu_mem._compat import keras as keras_compat

    return keras_compat.model_strategy(model)


def _host_copy(model):
    """A default-strategy copy of a model built under a tf.distribute strategy.

    XLA cannot compile a step whose variables live on several devices (a
    MirroredStrategy's per-replica copies, TPU variables) for the host, so the
    step is compiled on a clone: same layers and compile config, fresh
    variables, the user's model untouched.
    """
    import keras
    import tensorflow as tf

    if tf.distribute.has_strategy():
        raise RuntimeError(
            "compiled_memory/plan: call it outside `strategy.scope()`; it compiles one "
            "replica's step for the host on a copy of the model."
        )
    try:
        with tf.device("/CPU:0"):
            clone = keras.models.clone_model(model)
            clone.compile_from_config(model.get_compile_config())
    except Exception as err:
        raise RuntimeError(
            f"The model was built under {type(model.distribute_strategy).__name__}, whose "
            "variables XLA cannot compile for the host, and copying it failed "
            f"({type(err).__name__}: {err}). Build and compile the same model outside "
            "the strategy scope (plain weights are enough) and plan that one."
        ) from err
    if clone.optimizer is None:
        raise RuntimeError(
            "Could not recompile a host copy of the model (its `compile` is custom). "
            "Build and compile the same model outside the strategy scope and plan that."
        )
    return clone


def _build_for(model, xs, ys):
    """Creates any missing model, metric, loss and optimizer state, symbolically."""
    import keras

    def to_keras(s):
        return keras.KerasTensor(tuple(s.shape), s.dtype.name)

    data = (keras.tree.map_structure(to_keras, xs), keras.tree.map_structure(to_keras, ys))
    from keras_tpu_mem._compat import keras as keras_compat

    if keras_compat.has_symbolic_build(model):
        keras_compat.symbolic_build(model, data)
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def _compile_step(model, xs, ys, features=(), hlo_text=False):
    """Compiles one train step with XLA; returns `(HloProto bytes, HLO text or "")`.

    Without features this is Keras' own `train_step`. With features it is the
    engine's per-replica step (`TensorFlowStep._replica_step`) with those
    features installed, exactly what `fit` would run on each replica, traced
    with `jit_compile=True` as a TPU compiles it.
    """
    import keras
    import tensorflow as tf

    from keras_tpu_mem.engine.compile import compile_context

    # experimental_get_compiler_ir takes flat TensorSpecs only: pass the
    # leaves and rebuild (x, y) inside.
    structure = (xs, ys)
    flat = keras.tree.flatten(structure)
    with contextlib.ExitStack() as stack:
        if features:
            step = stack.enter_context(compile_context(model, features))
            train_step = tf.autograph.experimental.do_not_convert(step._replica_step)
        else:
            train_step = model.train_step

        @tf.function(jit_compile=True, reduce_retracing=False)
        def one_train_step(*leaves):
            x, y = keras.tree.pack_sequence_as(structure, list(leaves))
            return train_step((x, y))

        try:
            generator = one_train_step.experimental_get_compiler_ir(*flat)
            proto = generator(stage="optimized_hlo_proto_serialized")
            # A second XLA compile of the same graph: only when asked.
            text = generator(stage="optimized_hlo") if hlo_text else ""
        except Exception as err:
            what = (f"the engine's step for {', '.join(type(f).__name__ for f in features)}"
                    if features else "the model's train step")
            raise RuntimeError(
                f"XLA could not compile {what} for the host "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
                "A TPU compiles every step with XLA too, so the same op would fail there; "
                "see the full error above."
            ) from err
    return proto, text


def _platform(model) -> str:
    try:
        device = model.trainable_variables[0].value.device or ""
    except (IndexError, AttributeError):
        device = ""
    match = re.search(r"device:([A-Z]+):", device)
    return match.group(1) if match else "CPU"


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
    import keras

    from keras_tpu_mem._compat import keras as keras_compat

    specs = tuple((tuple(s.shape), s.dtype.name) for s in keras.tree.flatten((xs, ys)))
    variables = tuple((getattr(v, "path", v.name), tuple(v.shape), str(v.dtype))
                      for v in model.variables)
    policy = tuple(str(getattr(layer, "compute_dtype", ""))
                   for layer in keras_compat.flatten_layers(model, include_self=True))
    return (id(model.optimizer), type(model).train_step, specs, variables, policy,
            tuple(feature_key(f) for f in features))


class _Compiler:
    """Compiles one model's train step at several batches, caching the results."""

    def __init__(self, model, x_spec=None, y_spec=None, what="compiled_memory"):
        require_tensorflow_backend(what)
        _check_model(model, what)
        self.user_model = model
        self.what = what
        self.x_spec, self.y_spec = x_spec, y_spec
        self.copied = _non_default_strategy(model) is not None
        self._model = None
        self._built = False

    @property
    def model(self):
        """The model compiled: the user's, or a host copy of a distributed one."""
        if self._model is None:
            strategy = _non_default_strategy(self.user_model)
            if strategy is None:
                self._model = self.user_model
            else:
                logger.info(
                    "%s: the model was built under %s; compiling one replica's step on a "
                    "host copy (the model itself is not touched).", self.what,
                    type(strategy).__name__)
                self._model = _host_copy(self.user_model)
        return self._model

    def specs(self, batch_size: int):
        return infer_data_specs(self.user_model, batch_size, self.x_spec, self.y_spec)

    def __call__(self, batch_size: int, features=(), hlo_text: bool = False) -> CompiledMemory:
        import tensorflow as tf

        from keras_tpu_mem.engine.feature import Feature

        if tf.distribute.has_strategy():
            raise RuntimeError(
                f"{self.what}: call it outside `strategy.scope()`: it compiles one replica's "
                "step for the host, whatever strategy the model trains under."
            )
        features = tuple(features)
        for feature in features:
            if (type(feature).batches_per_update is not Feature.batches_per_update
                    and (feature.batches_per_update() or 1) > 1):
                raise ValueError(
                    f"{self.what}: {type(feature).__name__} with micro-batches pulled from "
                    "the dataset compiles a different step per window position; plan "
                    "GradientAccumulation(steps) (dataset_yields='global_batches') at the "
                    "per-replica batch of one update instead: its memory is the same "
                    "micro-batch loop's.")
        xs, ys = self.specs(batch_size)
        try:
            cache = _CACHE.setdefault(self.user_model, {})
        except TypeError:  # not weak-referenceable: no cache
            cache = {}
        key = _state_key(self.user_model, xs, ys, features)
        cached = cache.get(key)
        if cached is not None and (cached.hlo_text or not hlo_text):
            return cached
        model = self.model
        if not self._built:
            _build_for(model, xs, ys)
            self._built = True
            key = _state_key(self.user_model, xs, ys, features)  # building may add variables
            cached = cache.get(key)
            if cached is not None and (cached.hlo_text or not hlo_text):
                return cached
        # Before the compile: a batch the features cannot split is their own
        # clear error, not a failed trace.
        micro = _micro_batches(model, features, batch_size)
        serialized, text = _compile_step(model, xs, ys, features, hlo_text)
        stats = _buffer_stats(serialized)
        data_bytes = _spec_bytes((xs, ys))
        trainable = _variable_bytes(_unique(model.trainable_weights))
        result = CompiledMemory(
            batch_size=batch_size,
            argument_bytes=stats["argument"],
            data_bytes=data_bytes,
            temp_bytes=stats["temp"],
            live_out_bytes=stats["live_out"],
            alias_bytes=stats["alias"],
            constant_bytes=stats["constant"],
            weight_bytes=_variable_bytes(_unique(model.weights)),
            optimizer_bytes=_variable_bytes(_unique(model.optimizer.variables)),
            module_name=stats["module_name"],
            platform=_platform(model),
            features=tuple(type(f).__name__ for f in _sorted(features)),
            micro_batches=micro,
            accumulator_bytes=trainable if micro > 1 else 0,
            hlo_text=text,
        )
        cache[key] = result
        return result


def _sorted(features):
    return sorted(features, key=lambda f: (f.order, f.name))


def _micro_batches(model, features, per_replica_batch: int) -> int:
    """The micro-batch count the engine's step uses for these features (1: none)."""
    from keras_tpu_mem.engine.compile import compile_context

    if not features:
        return 1
    with compile_context(model, features):
        for feature in _sorted(features):
            count = feature.micro_batches(per_replica_batch)
            if count is not None:
                return int(count)
    return 1


def check_callbacks(callbacks, what: str) -> tuple:
    """The engine features among `callbacks` (a list as passed to `fit`).

    Callbacks that are not engine features (monitors, Keras' own) do not
    change the compiled step, so they take no part in it.

    Raises:
        TypeError: `callbacks` is not a list/tuple of Keras callbacks.
    """
    import keras

    from keras_tpu_mem.engine.feature import Feature

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


def compiled_memory(model, batch_size: int, *, callbacks=None, x_spec=None, y_spec=None,
                    hlo_text: bool = True) -> CompiledMemory:
    """Compiles the train step with XLA and returns its memory breakdown.

    Without `callbacks` the step is Keras' own `model.train_step` (forward,
    loss, gradients, optimizer update, metrics). With `callbacks`, the list you
    pass to `fit`, it is **the step the engine installs for them**: their
    features (gradient accumulation, bf16 compute, rematerialisation, pruning
    masks, distillation) are installed on the model, the engine's per-replica
    step is traced on symbolic inputs of `batch_size` examples and compiled with
    XLA (`jit_compile=True`, as on a TPU), and the features are uninstalled
    again. Callbacks that are not engine features (monitors) do not change the
    step and take no part. Nothing is executed: weights, optimizer slots,
    `optimizer.iterations` and dtype policies keep their values, and the
    callbacks are ready for a later `fit`. Missing state is created first (an
    unbuilt optimizer gets its slots, as `fit` would). A model built under a
    `tf.distribute` strategy is compiled on a host copy (one replica's step).

    On JAX (`KERAS_BACKEND=jax`) the engine's step is lowered with
    `jax.jit(...).lower(...).compile()` and read through `memory_analysis()`;
    called inside a `keras.distribution`'s `scope()`, it compiles for that
    distribution and reports the bytes one device holds (`batch_size` is then
    the global batch).

    Args:
        model: A compiled `keras.Model`.
        batch_size: Per-replica batch to compile for (TensorFlow); the global
            batch on JAX.
        callbacks: Optional list of callbacks as passed to `fit`.
        x_spec, y_spec: Optional `tf.TensorSpec` structures (batch first) for
            inputs / labels the model cannot tell (subclassed models, dynamic
            shapes, unusual losses).
        hlo_text: Keep the optimized HLO text in `CompiledMemory.hlo_text`
            (on TensorFlow a second XLA compile of the same step; False skips it).

    Returns:
        A `CompiledMemory`; `print` it for a table.

    Raises:
        TypeError: `callbacks` is not a list of Keras callbacks.
        ValueError: bad `batch_size`, or a feature that cannot split it.

    Example:

    ```python
    plain = ktm.compiled_memory(model, batch_size=8192)
    accumulated = ktm.compiled_memory(model, batch_size=8192,
                                      callbacks=[ktm.GradientAccumulation(8)])
    print(accumulated)      # arguments / temporaries (incl. accumulators) / total
    accumulated.temp_bytes < plain.temp_bytes
    "while" in accumulated.hlo_text     # the micro-batch loop
    ```
    """
    check_positive_int(batch_size, "batch_size")
    if not isinstance(hlo_text, bool):
        raise TypeError(f"`hlo_text` must be True or False, got {hlo_text!r}.")
    features = check_callbacks(callbacks, "compiled_memory")
    import keras

    if keras.backend.backend() == "jax":
        from keras_tpu_mem.planning.compiled_jax import JaxCompiler

        return JaxCompiler(model, x_spec, y_spec).compile_global(batch_size, features,
                                                                 hlo_text)
    return _Compiler(model, x_spec, y_spec)(batch_size, features, hlo_text)
