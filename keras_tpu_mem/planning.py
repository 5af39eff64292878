"""Know before you run: XLA's memory plan of the train step, and `plan()`.

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

import dataclasses
import math
import re
import textwrap
import weakref
from collections.abc import Callable, Sequence

from keras_tpu_mem import devices
from keras_tpu_mem._utils import check_positive_int, logger, require_tensorflow_backend

# Per-replica batches planned by compiling them directly: at most this.
_MAX_DIRECT_BATCH = 64
# Batches compiled to extrapolate larger ones. XLA's temp bytes are not
# linear at the smallest batches (a digits MLP's temporaries jump 5x from
# batch 1 to 2 and grow at half their later per-sample rate up to batch 32:
# kernels and fusions change), but grow linearly from a few dozen rows on, so
# the slope comes from two batches there.
_DEFAULT_COMPILE_BATCHES = (32, 64)
# A middle point further than this from the line through its neighbours
# gets a note in the plan.
_LINEARITY_TOLERANCE = 0.05

_BF16_NAMES = {"bf16", "bfloat16", "mixed_bfloat16"}
_F32_NAMES = {"float32", "f32", "fp32"}

_DEVICE_SIZE_RE = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB)\s*(?:[-x*]\s*(\d+))?\s*$", re.IGNORECASE
)
_UNITS = {"gib": devices.GIB, "gb": devices.GB, "mib": 1024**2, "mb": 1000**2}


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------
def _check_model(model, what: str):
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"{what}: `model` must be a keras.Model, got {type(model).__name__}.")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise ValueError(
            f"{what}: compile the model first (model.compile(optimizer=..., loss=...)): "
            "the train step it plans includes the loss, gradients and optimizer update."
        )


def _dtype_size(dtype) -> int:
    import numpy as np

    name = str(getattr(dtype, "name", dtype))
    if name == "bfloat16":
        return 2
    return int(np.dtype(name).itemsize)


def _variable_bytes(variables) -> int:
    total = 0
    for v in variables:
        total += int(math.prod(int(d) for d in v.shape)) * _dtype_size(v.dtype)
    return total


def _unique(variables):
    seen, out = set(), []
    for v in variables:
        key = id(getattr(v, "value", v))
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


# --------------------------------------------------------------------------
# data specs
# --------------------------------------------------------------------------
def _is_sparse_loss(loss) -> bool:
    """True for sparse categorical losses (integer class ids as labels)."""
    if loss is None:
        return False
    if isinstance(loss, str):
        return "sparse_categorical" in loss.lower()
    names = [
        getattr(loss, "__name__", ""),
        getattr(loss, "name", ""),
        getattr(getattr(loss, "fn", None), "__name__", ""),
        re.sub(r"(?<!^)(?=[A-Z])", "_", type(loss).__name__),
    ]
    return any("sparse_categorical" in str(n).lower() for n in names)


def _spec_for(tensor, batch_size: int, name: str):
    import tensorflow as tf

    shape = list(getattr(tensor, "shape", ()))
    dtype = getattr(tensor, "dtype", None)
    if not shape or dtype is None:
        raise ValueError(
            f"Cannot build a spec for {name}: {tensor!r} has no shape/dtype. Pass "
            f"`{name}` as a tf.TensorSpec (or nested structure of them) with the batch "
            "as the first dimension."
        )
    rest = shape[1:]
    if any(d is None for d in rest):
        raise ValueError(
            f"{name} has an unknown non-batch dimension (shape {tuple(shape)}); XLA needs "
            f"static shapes. Pass `{name}=tf.TensorSpec((None, ...), dtype)` with every "
            "dimension but the batch set."
        )
    dtype = getattr(dtype, "name", dtype)
    return tf.TensorSpec([batch_size, *[int(d) for d in rest]], tf.as_dtype(dtype))


def _map_specs(structure, batch_size: int, name: str):
    import keras

    return keras.tree.map_structure(lambda t: _spec_for(t, batch_size, name), structure)


def _label_spec(output, loss, batch_size: int):
    import tensorflow as tf

    shape = list(output.shape)
    if any(d is None for d in shape[1:]):
        raise ValueError(
            f"The model output has an unknown non-batch dimension (shape {tuple(shape)}); "
            "pass `y_spec=tf.TensorSpec(...)`."
        )
    if _is_sparse_loss(loss):
        return tf.TensorSpec([batch_size, *[int(d) for d in shape[1:-1]]], tf.int32)
    dtype = tf.as_dtype(getattr(output.dtype, "name", output.dtype))
    if dtype.is_floating:
        dtype = tf.float32  # labels come from the data, not the compute policy
    return tf.TensorSpec([batch_size, *[int(d) for d in shape[1:]]], dtype)


def _symbolic(model, which: str):
    """The model's symbolic inputs or outputs, in the structure `call` uses."""
    import keras

    functional = model
    if isinstance(model, keras.Sequential):
        functional = getattr(model, "_functional", None)
    struct = getattr(functional, f"_{which}_struct", None) if functional is not None else None
    if struct is None:
        struct = getattr(model, which)  # raises AttributeError/ValueError when unknown
    if struct is None:
        raise ValueError(f"the model has no symbolic {which}")
    if isinstance(struct, (list, tuple)) and len(struct) == 1:
        struct = struct[0]
    return struct


def infer_data_specs(model, batch_size: int, x_spec=None, y_spec=None):
    """Returns `(x_spec, y_spec)` as `tf.TensorSpec` structures for one batch.

    Inputs come from `model.input` (functional and Sequential models built with
    `keras.Input`); labels from the loss (sparse categorical losses take int32
    class ids of the output's shape without its last axis, other losses take
    float32 labels shaped like the output). `x_spec` / `y_spec` override either:
    a `tf.TensorSpec`, `keras.KerasTensor` or a nested structure of them, whose
    first dimension is the batch (it is replaced by `batch_size`).

    Raises:
        ValueError: if a shape cannot be inferred; the message says what to pass.
    """
    check_positive_int(batch_size, "batch_size")
    if x_spec is not None:
        xs = _map_specs(x_spec, batch_size, "x_spec")
    else:
        try:
            inputs = _symbolic(model, "inputs")
        except (AttributeError, ValueError) as err:
            raise ValueError(
                "Cannot infer the input shape: the model has no symbolic inputs (a "
                "subclassed model or a Sequential without keras.Input). Pass "
                "`x_spec=tf.TensorSpec((None, ...), dtype)`."
            ) from err
        xs = _map_specs(inputs, batch_size, "x_spec")
    if y_spec is not None:
        return xs, _map_specs(y_spec, batch_size, "y_spec")
    try:
        outputs = _symbolic(model, "outputs")
    except (AttributeError, ValueError) as err:
        raise ValueError(
            "Cannot infer the label shape: the model has no symbolic outputs. Pass "
            "`y_spec=tf.TensorSpec((None, ...), dtype)`."
        ) from err
    import keras

    loss = getattr(model, "loss", None)
    flat_outputs = keras.tree.flatten(outputs)
    if len(flat_outputs) == 1:
        single_loss = loss
        if isinstance(loss, (list, tuple)) and len(loss) == 1:
            single_loss = loss[0]
        elif isinstance(loss, dict) and len(loss) == 1:
            single_loss = next(iter(loss.values()))
        return xs, _label_spec(flat_outputs[0], single_loss, batch_size)
    if isinstance(loss, dict) and isinstance(outputs, dict):
        ys = {k: _label_spec(v, loss.get(k), batch_size) for k, v in outputs.items()}
    elif isinstance(loss, (list, tuple)) and len(loss) == len(flat_outputs):
        ys = [_label_spec(o, lo, batch_size) for o, lo in zip(flat_outputs, loss)]
    elif isinstance(loss, dict):
        names = getattr(model, "output_names", None) or []
        if len(names) != len(flat_outputs):
            raise ValueError(
                "Cannot match the dict of losses to the outputs; pass `y_spec`."
            )
        ys = {n: _label_spec(o, loss.get(n), batch_size) for n, o in zip(names, flat_outputs)}
    else:
        ys = keras.tree.map_structure(lambda o: _label_spec(o, loss, batch_size), outputs)
    return xs, ys


def _spec_bytes(structure) -> int:
    import keras

    return sum(
        int(math.prod(int(d) for d in s.shape)) * _dtype_size(s.dtype)
        for s in keras.tree.flatten(structure)
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
            ("temporaries", self.temp_bytes, "activations, gradients, workspace"),
            ("live-out", self.live_out_bytes,
             f"{fb(self.alias_bytes)} of it aliases arguments (in-place updates)"),
            ("constants", self.constant_bytes, ""),
            ("total", self.total_bytes, "arguments + temporaries + live-out - aliased"),
        ]
        head = (f"XLA buffer assignment of one train step, per-replica batch "
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


def _compile_step(model, xs, ys):
    import keras
    import tensorflow as tf

    # experimental_get_compiler_ir takes flat TensorSpecs only: pass the
    # leaves and rebuild (x, y) inside.
    structure = (xs, ys)
    flat = keras.tree.flatten(structure)

    @tf.function(jit_compile=True, reduce_retracing=False)
    def one_train_step(*leaves):
        x, y = keras.tree.pack_sequence_as(structure, list(leaves))
        return model.train_step((x, y))

    try:
        generator = one_train_step.experimental_get_compiler_ir(*flat)
        return generator(stage="optimized_hlo_proto_serialized")
    except Exception as err:
        raise RuntimeError(
            "XLA could not compile the model's train step for the host "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            "A TPU compiles every step with XLA too, so the same op would fail there; "
            "see the full error above."
        ) from err


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


def _state_key(model, xs, ys) -> tuple:
    import keras

    from keras_tpu_mem._compat import keras as keras_compat

    specs = tuple((tuple(s.shape), s.dtype.name) for s in keras.tree.flatten((xs, ys)))
    variables = tuple((getattr(v, "path", v.name), tuple(v.shape), str(v.dtype))
                      for v in model.variables)
    policy = tuple(str(getattr(layer, "compute_dtype", ""))
                   for layer in keras_compat.flatten_layers(model, include_self=True))
    return (id(model.optimizer), type(model).train_step, specs, variables, policy)


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

    def __call__(self, batch_size: int) -> CompiledMemory:
        import tensorflow as tf

        if tf.distribute.has_strategy():
            raise RuntimeError(
                f"{self.what}: call it outside `strategy.scope()`: it compiles one replica's "
                "step for the host, whatever strategy the model trains under."
            )
        xs, ys = self.specs(batch_size)
        try:
            cache = _CACHE.setdefault(self.user_model, {})
        except TypeError:  # not weak-referenceable: no cache
            cache = {}
        key = _state_key(self.user_model, xs, ys)
        if key in cache:
            return cache[key]
        model = self.model
        if not self._built:
            _build_for(model, xs, ys)
            self._built = True
            key = _state_key(self.user_model, xs, ys)  # building may add variables
            if key in cache:
                return cache[key]
        serialized = _compile_step(model, xs, ys)
        stats = _buffer_stats(serialized)
        data_bytes = _spec_bytes((xs, ys))
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
        )
        cache[key] = result
        return result


def compiled_memory(model, batch_size: int, *, x_spec=None, y_spec=None) -> CompiledMemory:
    """Compiles the model's train step with XLA and returns its memory breakdown.

    The step (forward, loss, gradients, optimizer update, metrics: whatever
    `model.train_step` does) is traced on symbolic inputs of `batch_size`
    examples and compiled with XLA for the device holding the model's variables
    (the host CPU for a model built outside any strategy). Nothing is executed:
    weights, optimizer slots and `optimizer.iterations` keep their values. Missing
    state is created first (an unbuilt optimizer gets its slots, as `fit` would).
    A model built under a `tf.distribute` strategy is compiled on a host copy.

    Args:
        model: A compiled `keras.Model`.
        batch_size: Per-replica batch to compile for.
        x_spec, y_spec: Optional `tf.TensorSpec` structures (batch first) for
            inputs / labels the model cannot tell (subclassed models, dynamic
            shapes, unusual losses).

    Returns:
        A `CompiledMemory`; `print` it for a table.

    Example:

    ```python
    mem = ktm.compiled_memory(model, batch_size=128)
    print(mem)              # arguments / temporaries / live-out / total
    mem.temp_bytes          # activations + gradients + workspace, in bytes
    ```
    """
    check_positive_int(batch_size, "batch_size")
    return _Compiler(model, x_spec, y_spec)(batch_size)


# --------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceBudget:
    """Where a plan is meant to run: per-replica memory and replica count."""

    name: str
    capacity_bytes: int
    replicas: int
    source: str


def resolve_device(device) -> DeviceBudget:
    """Parses `device` for `plan`.

    Accepts a TPU accelerator type (`"v3-8"`, `"v5litepod-16"`, `"v4-32"`: HBM
    per replica from `HBM_TABLE`), a memory size for other devices (`"12GiB"`
    for one device, `"16GB-4"` or `"16GB x4"` for four), or a `DeviceBudget`.

    Raises:
        ValueError / TypeError naming the accepted forms.
    """
    if isinstance(device, DeviceBudget):
        return device
    if not isinstance(device, str):
        raise TypeError(
            "`device` must be a TPU type such as 'v3-8', a size such as '12GiB' or "
            f"'16GB-4', or a DeviceBudget; got {type(device).__name__}."
        )
    match = _DEVICE_SIZE_RE.match(device)
    if match:
        amount, unit, count = match.groups()
        capacity = int(float(amount) * _UNITS[unit.lower()])
        replicas = int(count) if count else 1
        if capacity <= 0 or replicas < 1:
            raise ValueError(f"`device` {device!r} must name a positive size and count.")
        name = f"{amount} {unit}" + (f" x {replicas}" if replicas > 1 else "")
        return DeviceBudget(name, capacity, replicas, "given")
    try:
        spec, replicas = devices.parse_accelerator_type(device)
    except ValueError as err:
        raise ValueError(
            f"Unknown `device` {device!r}: pass a TPU type such as 'v3-8', 'v4-32', "
            "'v5litepod-16' (known generations: " + ", ".join(sorted(devices.HBM_TABLE))
            + "), or a memory size such as '12GiB' (one device) or '16GB-4' (four)."
        ) from err
    return DeviceBudget(device.strip(), spec.hbm_bytes_per_replica, replicas, spec.source)


def _normalise_precision(precision) -> str | None:
    if precision is None:
        return None
    if isinstance(precision, str):
        key = precision.strip().lower()
        if key in _BF16_NAMES:
            return "mixed_bfloat16"
        if key in _F32_NAMES:
            return "float32"
    raise ValueError(
        f"`precision` must be None (the model's own), 'float32' or 'mixed_bfloat16' "
        f"(also 'bf16', 'bfloat16'); got {precision!r}."
    )


def model_precision(model) -> str:
    """`"mixed_bfloat16"` if any layer computes in bfloat16, else `"float32"`."""
    from keras_tpu_mem._compat import keras as keras_compat

    for layer in keras_compat.flatten_layers(model, include_self=True):
        if str(getattr(layer, "compute_dtype", "float32")) == "bfloat16":
            return "mixed_bfloat16"
    return "float32"


@dataclasses.dataclass(frozen=True)
class ActivationModel:
    """XLA temporaries as a function of the per-replica batch.

    Compiled batches are used as they are; other batches are interpolated
    linearly between the nearest compiled ones, or extrapolated along the line
    through the two largest (or two smallest) compiled batches.
    """

    points: tuple[tuple[int, int], ...]  # (batch, temp bytes), sorted

    def __call__(self, batch: int) -> float:
        pts = self.points
        for b, t in pts:
            if b == batch:
                return float(t)
        if len(pts) == 1:
            (b, t), = pts
            return float(t) * batch / b
        if batch > pts[-1][0]:
            i = len(pts) - 2
        elif batch < pts[0][0]:
            i = 0
        else:
            i = next(j for j in range(len(pts) - 1) if pts[j][0] < batch < pts[j + 1][0])
        (b0, t0), (b1, t1) = pts[i], pts[i + 1]
        value = t1 + (batch - b1) * (t1 - t0) / (b1 - b0)
        return max(0.0, value)

    @property
    def per_sample_bytes(self) -> float:
        """Slope between the two largest compiled batches."""
        if len(self.points) < 2:
            b, t = self.points[0]
            return t / b
        (b0, t0), (b1, t1) = self.points[-2], self.points[-1]
        return (t1 - t0) / (b1 - b0)

    @property
    def fixed_bytes(self) -> float:
        """Batch-independent part: the line's value at batch 0 (gradients, workspace)."""
        b1, t1 = self.points[-1]
        return max(0.0, t1 - self.per_sample_bytes * b1)

    def scaled(self, factor: float, extra_fixed: float = 0.0) -> ActivationModel:
        """Per-sample part scaled by `factor`, `extra_fixed` bytes added (bf16 estimates)."""
        fixed = self.fixed_bytes
        return ActivationModel(tuple(
            (b, int(round(max(0.0, min(t, fixed) + max(0.0, t - fixed) * factor
                              + extra_fixed))))
            for b, t in self.points
        ))

    def linearity_error(self) -> float | None:
        """Relative miss of the middle of the three largest points off their chord."""
        if len(self.points) < 3:
            return None
        (b0, t0), (bm, tm), (b1, t1) = self.points[-3:]
        predicted = t0 + (bm - b0) * (t1 - t0) / (b1 - b0)
        return abs(predicted - tm) / max(tm, 1)


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The smallest gradient-accumulation split that fits."""

    accumulation_steps: int
    micro_batch: int
    total_bytes: int


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-replica memory budget of a training configuration.

    All byte counts are per replica. `activation_bytes` are XLA's temporaries
    of the train step at the micro-batch (activations kept for the backward
    pass, the gradients XLA keeps live, workspace). `gradient_bytes` is one
    full set of gradients, the most of them that can be live at once; XLA
    computes them inside its temporaries (often fused into the update), so they
    are reported but not added to the total a second time.
    """

    device: DeviceBudget
    global_batch_size: int
    per_replica_batch: int
    accumulation_steps: int
    micro_batch: int
    precision: str
    model_precision: str
    headroom: float
    weight_bytes: int
    trainable_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    accumulator_bytes: int
    activation_bytes: int
    data_bytes: int
    other_bytes: int
    activations_per_sample: float
    activations_fixed: float
    compiled_batches: tuple[int, ...]
    extrapolated: bool
    recommendation: Recommendation | None
    bf16_activation_bytes: int | None
    bf16_total_bytes: int | None
    bf16_recommendation: Recommendation | None
    largest_batch: int = 0
    bf16_largest_batch: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def capacity_bytes(self) -> int:
        return self.device.capacity_bytes

    @property
    def usable_bytes(self) -> int:
        """Capacity minus the headroom kept for what the plan does not model."""
        return int(self.device.capacity_bytes * (1.0 - self.headroom))

    @property
    def total_bytes(self) -> int:
        return (self.weight_bytes + self.optimizer_bytes + self.accumulator_bytes
                + self.activation_bytes + self.data_bytes + self.other_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    @property
    def bf16_fits(self) -> bool | None:
        if self.bf16_total_bytes is None:
            return None
        return self.bf16_total_bytes <= self.usable_bytes

    def table(self) -> str:
        fb = devices.format_bytes
        k = self.accumulation_steps
        d = self.device
        batch = (f"global batch {self.global_batch_size} = {d.replicas} replica(s) x "
                 f"{self.per_replica_batch}")
        if k > 1:
            batch += f" = {k} micro-batches of {self.micro_batch}"
        how = ("compiled at this batch" if not self.extrapolated else
               f"extrapolated from XLA compiles at batches "
               f"{', '.join(map(str, self.compiled_batches))}")
        if self.precision != self.model_precision:
            how += f"; {self.precision} estimated from the {self.model_precision} compiles"
        lines = [
            f"Memory plan on {d.name} ({fb(d.capacity_bytes)} per replica), {self.precision}",
            f"  {batch}",
            f"  {'weights':<24}{fb(self.weight_bytes):>12}",
            f"  {'optimizer slots':<24}{fb(self.optimizer_bytes):>12}",
            f"  {'gradient accumulators':<24}{fb(self.accumulator_bytes):>12}"
            + ("" if k > 1 else "  (no accumulation)"),
            f"  {'activations+workspace':<24}{fb(self.activation_bytes):>12}  "
            f"XLA temporaries at batch {self.micro_batch}: "
            f"{fb(self.activations_per_sample)}/sample + {fb(self.activations_fixed)} fixed "
            f"({how})",
            f"  {'  incl. gradients':<24}{fb(self.gradient_bytes):>12}  at most, "
            "one per trainable weight",
            f"  {'input batch':<24}{fb(self.data_bytes):>12}",
            f"  {'other':<24}{fb(self.other_bytes):>12}  metric state, results, constants",
            f"  {'total':<24}{fb(self.total_bytes):>12}  of {fb(self.usable_bytes)} usable "
            f"({fb(d.capacity_bytes)} - {self.headroom:.0%} headroom)",
            f"  fits: {'yes' if self.fits else 'NO'}; largest per-replica batch that fits "
            f"without accumulation: {self.largest_batch}",
        ]
        rec = self.recommendation
        if self.fits:
            pass
        elif rec is not None:
            lines.append(
                f"  -> fits with accumulation_steps={rec.accumulation_steps} "
                f"(micro-batch {rec.micro_batch}): {fb(rec.total_bytes)}"
            )
        else:
            lines.append("  -> does not fit even with one example per micro-batch")
        if self.bf16_total_bytes is not None:
            line = (f"  bf16 compute (mixed_bfloat16, estimate): activations "
                    f"{fb(self.bf16_activation_bytes)}, total {fb(self.bf16_total_bytes)}, "
                    f"fits: {'yes' if self.bf16_fits else 'no'}, largest per-replica batch "
                    f"{self.bf16_largest_batch}")
            brec = self.bf16_recommendation
            if not self.bf16_fits and brec is not None:
                line += (f"; with accumulation_steps={brec.accumulation_steps} "
                         f"(micro-batch {brec.micro_batch}): {fb(brec.total_bytes)}")
            lines.append(line)
        for note in self.notes:
            lines.extend(textwrap.wrap(note, width=96, initial_indent="  note: ",
                                       subsequent_indent="        "))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


_NOT_MODELLED = (
    "XLA's CPU compile is the reference: it does not apply TPU layout padding "
    "(TPU tiles the two minor dimensions to multiples of 8 x 128 for float32, "
    "16 x 128 for bfloat16, so small or odd feature sizes grow), the TPU compiler's "
    "own fusion and scheduling, nor the runtime's reserved HBM and fragmentation; "
    "the headroom covers these. Keep feature sizes multiples of 128."
)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _recommend(per_replica, budget, fixed_state, trainable, act, data, other):
    for k in _divisors(per_replica):
        micro = per_replica // k
        accum = trainable if k > 1 else 0
        total = int(fixed_state + accum + act(micro) + data + other)
        if total <= budget:
            return Recommendation(k, micro, total)
    return None


def _bf16_estimate(act: ActivationModel, trainable_bytes: int) -> ActivationModel:
    """Temporaries under mixed_bfloat16, estimated from a float32 compile.

    Activations (the per-sample part) are stored in bfloat16: half the bytes.
    The batch-independent part (gradients, which stay float32 because the
    variables do, and workspace) is kept, plus a bfloat16 copy of the weights,
    which Keras' autocast makes for the forward and backward pass. This is
    what a TPU computes natively; XLA on the host CPU keeps many bfloat16
    intermediates in float32, so a CPU compile of a bf16 model shows more.
    """
    return act.scaled(0.5, trainable_bytes / 2)


def _largest_batch(budget, fixed_state, act, data_per_sample, other, limit=1 << 24) -> int:
    """Largest batch b with fixed_state + act(b) + data(b) + other <= budget (0: none)."""
    def fits(b):
        return fixed_state + act(b) + data_per_sample * b + other <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _validate_plan_args(global_batch_size, headroom, accumulation_steps, compile_batches):
    check_positive_int(global_batch_size, "global_batch_size")
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)):
        raise TypeError(f"`headroom` must be a float in [0, 1), got {headroom!r}.")
    if not 0.0 <= float(headroom) < 1.0:
        raise ValueError(
            f"`headroom` must be in [0, 1) (a fraction of capacity kept free), got {headroom}."
        )
    if accumulation_steps is not None:
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
            raise TypeError(
                "`accumulation_steps` must be None or an int >= 1, got "
                f"{accumulation_steps!r}."
            )
        if accumulation_steps < 1:
            raise ValueError(
                f"`accumulation_steps` must be None or an int >= 1, got {accumulation_steps}."
            )
    if compile_batches is not None:
        if not isinstance(compile_batches, Sequence) or not compile_batches:
            raise TypeError(
                "`compile_batches` must be None or a non-empty sequence of positive ints, "
                f"got {compile_batches!r}."
            )
        for b in compile_batches:
            check_positive_int(b, "compile_batches[i]")


def plan(
    model,
    global_batch_size: int,
    *,
    device="v3-8",
    accumulation_steps: int | None = None,
    precision: str | None = None,
    headroom: float = 0.10,
    compile_batches: Sequence[int] | None = None,
    x_spec=None,
    y_spec=None,
    progress: Callable[[int, int, int | None], None] | None = None,
) -> MemoryPlan:
    """Plans one replica's memory for training `model` at `global_batch_size`.

    Weights and optimizer slots are counted from the model's variables (the
    optimizer is built if it is not yet). Activations are XLA's temporaries of
    the compiled train step (see `compiled_memory`) at the per-replica
    micro-batch: compiled directly when that batch is at most 64, else
    extrapolated per sample from compiles at `compile_batches` (default 32 and
    64: XLA's temp bytes are not linear at the smallest batches, which is why
    1 and 2 are not the default). With `accumulation_steps=k` the step
    holds the activations of one micro-batch (per-replica batch / k) plus one
    set of gradient accumulators as large as the trainable weights, as
    `ktm.GradientAccumulation` does.

    Args:
        model: A compiled `keras.Model` (built under any strategy, or none).
        global_batch_size: Examples per step over all replicas.
        device: A TPU type (`"v3-8"`, `"v4-32"`, `"v5litepod-16"`: capacity per
            replica from `ktm.HBM_TABLE`), a size (`"12GiB"`, `"16GB-4"`), or a
            `DeviceBudget`.
        accumulation_steps: Micro-batches per replica step (None or 1: none).
            Must divide the per-replica batch.
        precision: None (as the model is), `"float32"` or `"mixed_bfloat16"`;
            a precision other than the model's is estimated by scaling the
            per-sample activations (x0.5 to bf16, x2 to float32), weights,
            gradients and slots unchanged (mixed_bfloat16 keeps float32
            variables).
        headroom: Fraction of capacity kept free for what the plan does not
            model (TPU layout padding, fragmentation, runtime buffers).
        compile_batches: Batches to compile for the extrapolation (more
            compile time for big models is spent here; e.g. `(1, 2)` for a
            model whose every example is already a long sequence).
        x_spec, y_spec: Data specs where the model cannot tell (see
            `compiled_memory`).
        progress: Optional callable `progress(done, total, batch_size)`, for
            long compiles: called before each XLA compile with the compiles
            finished so far, the number planned and the batch about to be
            compiled, and once after the last with `done == total` and
            `batch_size=None`. `keras-tpu-mem plan` prints a line from it.

    Returns:
        A `MemoryPlan`; `print` it for the table and the recommendation.

    Raises:
        ValueError / TypeError for bad arguments, naming what is accepted.
    """
    _validate_plan_args(global_batch_size, headroom, accumulation_steps, compile_batches)
    budget_device = resolve_device(device)
    wanted_precision = _normalise_precision(precision)
    replicas = budget_device.replicas
    if global_batch_size % replicas:
        raise ValueError(
            f"`global_batch_size` {global_batch_size} does not split evenly over the "
            f"{replicas} replicas of {budget_device.name}; use a multiple of {replicas}."
        )
    per_replica = global_batch_size // replicas
    k = accumulation_steps or 1
    if per_replica % k:
        raise ValueError(
            f"`accumulation_steps`={k} must divide the per-replica batch {per_replica} "
            f"(global {global_batch_size} / {replicas} replicas); divisors: "
            f"{', '.join(map(str, _divisors(per_replica)))}."
        )
    micro = per_replica // k

    compiler = _Compiler(model, x_spec, y_spec, what="plan")
    if compile_batches is not None:
        batches = sorted(set(compile_batches))
    elif micro <= _MAX_DIRECT_BATCH:
        batches = sorted({micro, *_DEFAULT_COMPILE_BATCHES})
    else:
        batches = list(_DEFAULT_COMPILE_BATCHES)
    if progress is not None and not callable(progress):
        raise TypeError(f"`progress` must be None or a callable, got {progress!r}.")
    results = []
    for done, batch in enumerate(batches):
        if progress is not None:
            progress(done, len(batches), batch)
        results.append(compiler(batch))
    if progress is not None:
        progress(len(batches), len(batches), None)
    act = ActivationModel(tuple((r.batch_size, r.temp_bytes) for r in results))
    ref = results[-1]
    own_precision = model_precision(compiler.user_model)
    precision_used = wanted_precision or own_precision
    trainable = _variable_bytes(_unique(compiler.user_model.trainable_weights))
    notes = []
    if precision_used != own_precision:
        to_bf16 = precision_used == "mixed_bfloat16"
        act = _bf16_estimate(act, trainable) if to_bf16 else act.scaled(2.0, -trainable / 2)
        notes.append(
            f"{precision_used} estimated from the {own_precision} compile (per-sample "
            f"activations x{0.5 if to_bf16 else 2.0:g}, a bfloat16 copy of the weights "
            f"{'added' if to_bf16 else 'removed'}); compile a {precision_used} model "
            "for XLA's own numbers."
        )
    err = act.linearity_error()
    if err is not None and err > _LINEARITY_TOLERANCE:
        notes.append(
            f"XLA temp bytes are not linear over batches {batches[-3:]} (middle point "
            f"{err:.0%} off the line); the extrapolation is less certain."
        )
    if compiler.copied:
        notes.append("compiled on a host copy of the model (it was built under a "
                     "tf.distribute strategy).")

    weights = ref.weight_bytes
    optimizer = ref.optimizer_bytes
    other = (ref.state_bytes - weights - optimizer) + (ref.live_out_bytes - ref.alias_bytes) \
        + ref.constant_bytes
    other = max(0, int(other))
    data_bytes = _spec_bytes(compiler.specs(per_replica))
    accum = trainable if k > 1 else 0
    activation = int(round(act(micro)))
    usable = int(budget_device.capacity_bytes * (1.0 - float(headroom)))
    state = weights + optimizer
    recommendation = _recommend(per_replica, usable, state, trainable, act, data_bytes, other)

    per_sample_data = data_bytes / per_replica
    largest = _largest_batch(usable, state, act, per_sample_data, other)
    bf16_act = bf16_total = bf16_rec = bf16_largest = None
    if precision_used == "float32":
        bf16_model = _bf16_estimate(act, trainable)
        bf16_act = int(round(bf16_model(micro)))
        bf16_total = state + accum + bf16_act + data_bytes + other
        bf16_rec = _recommend(per_replica, usable, state, trainable, bf16_model,
                              data_bytes, other)
        bf16_largest = _largest_batch(usable, state, bf16_model, per_sample_data, other)
    notes.append(_NOT_MODELLED)
    return MemoryPlan(
        device=budget_device,
        global_batch_size=global_batch_size,
        per_replica_batch=per_replica,
        accumulation_steps=k,
        micro_batch=micro,
        precision=precision_used,
        model_precision=own_precision,
        headroom=float(headroom),
        weight_bytes=weights,
        trainable_bytes=trainable,
        gradient_bytes=trainable,
        optimizer_bytes=optimizer,
        accumulator_bytes=accum,
        activation_bytes=activation,
        data_bytes=data_bytes,
        other_bytes=other,
        activations_per_sample=act.per_sample_bytes,
        activations_fixed=act.fixed_bytes,
        compiled_batches=tuple(batches),
        extrapolated=micro not in batches,
        recommendation=recommendation,
        bf16_activation_bytes=bf16_act,
        bf16_total_bytes=bf16_total,
        bf16_recommendation=bf16_rec,
        largest_batch=largest,
        bf16_largest_batch=bf16_largest,
        notes=tuple(notes),
    )


def load_model_factory(spec: str):
    """Imports `MODULE:FUNCTION` (a dotted module or a .py path) and returns FUNCTION."""
    import importlib
    import importlib.util
    import os

    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(
            f"--model must be MODULE:FUNCTION (e.g. 'examples.bert_memory:build_model' or "
            f"'path/to/file.py:build'), got {spec!r}."
        )
    module_name, _, func_name = spec.rpartition(":")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.exists(module_name):
            raise ValueError(f"--model: no such file {module_name!r}.")
        mod_spec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(module_name))[0], module_name)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        import sys

        if os.getcwd() not in sys.path:  # console scripts do not put "." on sys.path
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"--model: cannot import {module_name!r}: {err}") from err
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"--model: {module_name!r} has no callable {func_name!r}.")
    return func
