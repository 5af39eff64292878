"""bfloat16 mixed precision for models that already exist.

Keras applies a dtype policy only to layers built after
`keras.config.set_dtype_policy`, so a model that is already built (or loaded
from a checkpoint) has no drop-in path to bfloat16, and under a global
`mixed_bfloat16` policy the last layer emits bfloat16 logits unless someone
remembers `dtype="float32"`. This module gives three tools:

* `MixedBFloat16`, a `fit` callback: bfloat16 compute with float32 variables
  for the training it is attached to; the layers that produce the model's
  outputs stay float32; the model is handed back in its own policies at the
  end of `fit`.
* `to_mixed_bfloat16(model)`: a new model with the same policy assignment,
  built into its config (it saves and loads as such), and the same weights bit
  for bit; `enable_mixed_bfloat16()` sets the global policy for models built
  afterwards.
* `precision_report(model)`: which layer computes in which dtype, with the
  risky spots flagged.

Why the output layers get a bfloat16 *backward* (see `MixedBFloat16`,
`exact_output_gradients`): a float32 output layer fed by bfloat16 activations
keeps a float32 copy of its input for its weight gradient and produces a
float32 gradient of that input, both alive at the start of the backward pass,
which is where activation memory peaks. Our output layers compute their
forward pass in float32 (logits and loss are float32 values) and their
backward pass in bfloat16, like every hidden layer, which removes both copies.
That is also the arithmetic of a TPU, whose matrix unit multiplies float32
operands as bfloat16 with float32 accumulation by default
(cloud.google.com/tpu/docs/bfloat16).
"""

from __future__ import annotations

import dataclasses

import keras

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import logger
from keras_tpu_mem.engine import EngineCallback

MIXED_BF16 = "mixed_bfloat16"
FLOAT32 = "float32"
_LOW_PRECISION = ("bfloat16", "float16")
# Policies we switch: those whose variables are float32 and whose compute is a
# float type. Others ("float16", "bfloat16", "float64" variables, quantized
# policies) are left exactly as they are: switching them would change weights.
_SWITCHABLE = ("float32", "mixed_float16", "mixed_bfloat16")


# ------------------------------------------------------------------ helpers
def _graph_container(layer) -> bool:
    """Functional and Sequential models: their policy does not cast anything."""
    return isinstance(layer, (keras_compat.functional_class(), keras.Sequential))


def _input_layer(layer) -> bool:
    return isinstance(layer, keras.layers.InputLayer)


def _sublayers(layer) -> list:
    return [sub for sub in keras_compat.flatten_layers(layer, include_self=False)
            if not _input_layer(sub)]


def _all_layers(model) -> list:
    """Every layer of the model, depth first, the model itself first."""
    return [layer for layer in keras_compat.flatten_layers(model, include_self=True)
            if not _input_layer(layer)]


def _policy_name(layer) -> str:
    return getattr(layer.dtype_policy, "name", str(layer.dtype_policy))


def _switchable(layer) -> str | None:
    """None if we may switch the layer's policy, else why not."""
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return "DTypePolicyMap"
    if getattr(policy, "quantization_mode", None) is not None:
        return f"quantized ({_policy_name(layer)})"
    if _policy_name(layer) not in _SWITCHABLE:
        return f"policy {_policy_name(layer)!r}"
    return None


def _output_layers(model) -> list | None:
    """The layers that produce the model's outputs, or None if unknowable.

    Walks back from each output through weightless layers (an `Activation`, a
    `Reshape`) and plain `keras.ops` calls to the first layer with weights, so
    that `Dense(10) -> Activation("softmax")` counts both: the logits are the
    Dense layer's output. Nested Functional/Sequential models on the output
    path contribute their own output layers. Subclassed models have no graph
    to read: None.
    """
    found: list = []

    def add(layer):
        if all(layer is not f for f in found):
            found.append(layer)

    def add_outputs_of(container) -> bool:
        inner = _output_layers(container)
        if inner is None:
            return False
        for f in inner:
            add(f)
        return True

    def from_sequential(seq) -> bool:
        for layer in reversed([lay for lay in seq.layers if not _input_layer(lay)]):
            if _graph_container(layer):
                return add_outputs_of(layer)
            add(layer)
            if layer.weights or _sublayers(layer):
                return True
        return True

    def from_tensor(tensor) -> bool:
        history = getattr(tensor, "_keras_history", None)
        if history is None:
            return True
        op = history.operation
        if _input_layer(op):
            return True
        if _graph_container(op):
            return add_outputs_of(op)
        is_layer = isinstance(op, keras.layers.Layer)
        if is_layer:
            add(op)
            if op.weights or _sublayers(op):
                return True
        node = keras_compat.inbound_node(op, history.node_index)
        inputs = list(node.input_tensors)
        if is_layer and len(inputs) != 1:
            return True  # Add/Concatenate cast their own inputs to their policy
        return all(from_tensor(t) for t in inputs)

    if isinstance(model, keras.Sequential):
        return found if from_sequential(model) else None
    if isinstance(model, keras_compat.functional_class()):
        ok = all(from_tensor(t) for t in keras.tree.flatten(model.outputs))
        return found if ok else None
    return None


def _normalize_keep(keep_float32):
    """Returns (names, types) from the `keep_float32` argument."""
    if keep_float32 is None:
        return (), ()
    items = [keep_float32] if isinstance(keep_float32, (str, type)) else keep_float32
    try:
        items = list(items)
    except TypeError:
        raise TypeError(
            "`keep_float32` must be None, a layer name (str), a layer class, or a "
            f"list of them; got {keep_float32!r} ({type(keep_float32).__name__})."
        ) from None
    names, types = [], []
    for item in items:
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, type) and issubclass(item, keras.layers.Layer):
            types.append(item)
        else:
            raise TypeError(
                "`keep_float32` entries must be layer names (str) or keras Layer "
                f"classes; got {item!r} ({type(item).__name__})."
            )
    return tuple(names), tuple(types)


@dataclasses.dataclass
class _Plan:
    """Which policy each layer gets: the shared core of the callback and converter."""

    bf16: list
    float32: list  # (layer, reason)
    outputs: list | None
    unchanged: list  # (layer, why)


def _plan(model, names, types) -> _Plan:
    if not isinstance(model, keras.Model):
        raise TypeError(f"Expected a keras.Model, got {type(model).__name__}.")
    layers = _all_layers(model)
    by_name = {layer.name for layer in layers}
    missing = [name for name in names if name not in by_name]
    if missing:
        known = ", ".join(sorted(by_name))
        raise ValueError(
            f"`keep_float32` names {missing}, which are not layers of model "
            f"{model.name!r}. Its layers are: {known}."
        )
    outputs = _output_layers(model)
    kept: list = []
    for layer in layers:
        if layer.name in names or (types and isinstance(layer, types)):
            kept.append(layer)
            kept.extend(_sublayers(layer))
    heads: list = []
    for layer in outputs or ():
        heads.append(layer)
        heads.extend(_sublayers(layer))

    def member(layer, group):
        return any(layer is other for other in group)

    plan = _Plan([], [], outputs, [])
    for layer in layers:
        if _graph_container(layer):
            continue
        why = _switchable(layer)
        if why is not None:
            plan.unchanged.append((layer, why))
        elif member(layer, kept):
            plan.float32.append((layer, "keep_float32"))
        elif member(layer, heads):
            plan.float32.append((layer, "output"))
        else:
            plan.bf16.append(layer)
    return plan


def _describe(plan: _Plan, straight_through) -> str:
    count = len(plan.bf16)
    parts = [f"{count} layer{'s' if count != 1 else ''} compute{'s' if count == 1 else ''} "
             "in bfloat16"]
    if plan.float32:
        kept = []
        for layer, reason in plan.float32:
            note = reason
            if any(layer is s for s in straight_through):
                note += ", bfloat16 backward"
            kept.append(f"{layer.name} ({note})")
        parts.append("float32: " + ", ".join(kept))
    if plan.unchanged:
        parts.append("unchanged: " + ", ".join(f"{lay.name} ({why})"
                                               for lay, why in plan.unchanged))
    return "; ".join(parts)


# ------------------------------------------------------- device awareness
_NOTICES: set[str] = set()


def _cpu_bf16_flags() -> list[str] | None:
    """bfloat16 instruction sets of this CPU, or None where unknown (not Linux x86)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    except OSError:
        return None
    return None


def _device_types(strategy) -> list[str]:
    import tensorflow as tf

    from keras_tpu_mem.devices import replica_device_names

    return sorted({tf.DeviceSpec.from_string(d).device_type or "CPU"
                   for d in replica_device_names(strategy)})


def device_notice(strategy=None) -> str | None:
    """What bfloat16 means on the devices of `strategy` (None on a TPU: native).

    Args:
        strategy: On TensorFlow, a `tf.distribute.Strategy`; on JAX, a
            `keras.distribution.Distribution`. The current one if None (on JAX
            without a distribution: the default device).

    Returns:
        A one-line notice for CPUs and for GPUs without bfloat16 tensor cores
        (compute capability below 8.0), or None where bfloat16 is native.
    """
    if keras.backend.backend() == "jax":
        return _jax_device_notice(strategy)
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    kinds = _device_types(strategy)
    if "TPU" in kinds:
        return None
    if "GPU" in kinds:
        slow = []
        for gpu in tf.config.list_physical_devices("GPU"):
            details = tf.config.experimental.get_device_details(gpu)
            capability = details.get("compute_capability")
            if capability is not None and tuple(capability) < (8, 0):
                name = details.get("device_name", gpu.name)
                slow.append(f"{name} (compute capability {capability[0]}.{capability[1]})")
        if not slow:
            return None
        return ("bfloat16 on " + ", ".join(slow) + ", which has no bfloat16 tensor "
                "cores: it runs and halves activation memory, but matrix products are "
                "not faster than float32 there.")
    flags = _cpu_bf16_flags()
    if flags:
        return ("bfloat16 on CPU (this CPU has " + ", ".join(flags) + "): it runs and "
                "halves activation memory; on a TPU it is native. XLA on CPU "
                "(jit_compile=True) upcasts bfloat16 matrix products to float32.")
    what = ("this CPU has no bfloat16 instructions" if flags is not None
            else "bfloat16 support of this CPU unknown")
    return (f"bfloat16 on CPU ({what}): it runs, emulated, usually slower than "
            "float32; on a TPU it is native.")


def _jax_device_notice(distribution) -> str | None:
    from keras_tpu_mem.backends.jax.trainer import data_parallel_devices

    devices = data_parallel_devices(distribution)
    kinds = {device.platform for device in devices}
    if "tpu" in kinds:
        return None
    if "gpu" in kinds:
        slow = sorted({f"{device.device_kind} (compute capability {capability})"
                       for device in devices
                       for capability in [getattr(device, "compute_capability", None)]
                       if capability is not None
                       and tuple(int(p) for p in str(capability).split(".")[:2]) < (8, 0)})
        if not slow:
            return None
        return ("bfloat16 on " + ", ".join(slow) + ", which has no bfloat16 tensor "
                "cores: it runs and halves activation memory, but matrix products are "
                "not faster than float32 there.")
    flags = _cpu_bf16_flags()
    what = (f"this CPU has {', '.join(flags)}" if flags else
            "this CPU has no bfloat16 instructions" if flags is not None
            else "bfloat16 support of this CPU unknown")
    return (f"bfloat16 on CPU ({what}): it runs and halves activation memory; XLA on "
            "CPU computes bfloat16 matrix products in float32, so it is not faster "
            "there. On a TPU it is native.")


def _log_device_notice(strategy) -> None:
    message = device_notice(strategy)
    if message and message not in _NOTICES:
        _NOTICES.add(message)
        logger.info(message)


# --------------------------------------------------- the float32 output layer
def _is_float(tensor, dtype=None) -> bool:
    if not hasattr(tensor, "dtype") or not keras.ops.is_tensor(tensor):
        return False
    name = keras.backend.standardize_dtype(tensor.dtype)
    return keras.backend.is_float_dtype(name) and (dtype is None or name == dtype)


def _join(exact, low):
    """`exact` as the value, the gradient of `low` as the gradient."""
    if not _is_float(exact) or low is None:
        return exact
    low = keras.ops.cast(low, exact.dtype)
    return keras.ops.stop_gradient(exact) + (low - keras.ops.stop_gradient(low))


class _Float32Forward:
    """Replaces an output layer's `call` while `MixedBFloat16` is installed.

    With a bfloat16 input, the layer runs twice: in float32 on the upcast input
    (the value it returns, exactly that of a float32 layer) and in bfloat16 (the
    path gradients flow through). Nothing of the float32 pass is kept for the
    backward pass, so no float32 copy of the activation is alive at the memory
    peak. Only for leaf layers without non-trainable state or random seeds, so
    running the layer twice has no side effect.
    """

    def __init__(self, layer):
        self.layer = layer
        self.original = layer.__dict__.get("call")
        self.convert = keras_compat.convert_input_args(layer)
        self.call = layer.call

    def install(self):
        layer = self.layer
        # Keras would cast the bfloat16 input to float32 before `call`; we cast
        # ourselves, so the bfloat16 tensor reaches the bfloat16 pass.
        keras_compat.set_convert_input_args(layer, False)
        object.__setattr__(layer, "call", self)

    def uninstall(self):
        layer = self.layer
        keras_compat.set_convert_input_args(layer, self.convert)
        if self.original is None:
            layer.__dict__.pop("call", None)
        else:
            object.__setattr__(layer, "call", self.original)

    def _cast(self, structure, dtype):
        """What Keras' `__call__` does to the inputs, to `dtype` (floats only)."""
        policy = self.layer.dtype_policy

        def convert(x):
            if keras.ops.is_tensor(x) or (hasattr(x, "__array__") and hasattr(x, "dtype")):
                return policy.convert_input(x, self.layer.autocast, dtype)
            return x

        return keras.tree.map_structure(convert, structure)

    def __call__(self, *args, **kwargs):
        exact_args, exact_kwargs = self._cast((args, kwargs), self.layer.compute_dtype)
        exact = self.call(*exact_args, **exact_kwargs)
        if not any(_is_float(x, "bfloat16") for x in keras.tree.flatten((args, kwargs))):
            return exact
        low_args, low_kwargs = self._cast((args, kwargs), "bfloat16")
        with keras_compat.autocast_scope("bfloat16"):
            low = self.call(*low_args, **low_kwargs)
        return keras.tree.map_structure(_join, exact, low)


def _straight_through_ok(layer) -> bool:
    return not _sublayers(layer) and not layer.non_trainable_variables


# --------------------------------------------------------------- callback
class MixedBFloat16(EngineCallback):
    """bfloat16 compute, float32 variables, for the `fit` it is attached to.

    On `fit`, before the training step is traced, every layer of the already
    built model switches to the `mixed_bfloat16` policy (bfloat16 compute,
    float32 variables), except:

    * the layers that produce the model's outputs: walking back from each output
      through weightless layers (`Activation`, `Reshape`, `keras.ops` calls) to
      the first layer with weights, so a `Dense(10) -> Activation("softmax")`
      head keeps both, and the model's outputs are float32;
    * the layers named or typed in `keep_float32` (and their sublayers);
    * layers whose variables are not float32 or that are quantized, which are
      left as they are (a log line lists them).

    Weights are never changed or re-initialised: the variables are float32
    under `mixed_bfloat16`, and each layer casts them to bfloat16 inside its
    computation. Normalisation layers (`BatchNormalization`,
    `LayerNormalization`) compute their statistics in float32 under that policy
    and keep their moving statistics in float32; losses and metrics compute in
    float32 (their dtype is `keras.config.floatx()`). `mixed_float16` layers are
    switched to `mixed_bfloat16` too (their variables are float32 already).

    **Output layers: float32 forward, bfloat16 backward.** An output layer
    returns exactly what a float32 layer returns (logits and loss are float32
    values), but its gradients are computed in bfloat16 like every hidden
    layer's, so no float32 copy of the last activation and of its gradient is
    alive when memory peaks (at the start of the backward pass). This applies to
    output layers without sublayers, non-trainable state or random seeds
    (`Dense`, `EinsumDense`, `Activation`...); others stay plain float32. Set
    `exact_output_gradients=True` for plain float32 output layers everywhere.

    **After `fit`** the model gets its own policies back: `model.predict`,
    `evaluate` and `save` see the model as it was built (float32 unless it was
    built otherwise), with the trained float32 weights, and the cached
    predict/test functions are retraced. Validation inside `fit` runs in
    bfloat16, like the training. For a model that *stays* bfloat16 (serving,
    saving as bf16), convert it with `to_mixed_bfloat16`. If `fit` stops with an
    exception, Keras calls no `on_train_end`: the model keeps the bfloat16
    policies until its next `fit`, which undoes them first (or call
    `callback.restore(model)`).

    **Subclassed models** have no graph from which to read the output layers:
    name them in `keep_float32`; the first training step raises a `ValueError`
    if the model's output is not float32.

    **Devices.** bfloat16 is native on TPUs; on CPUs and on GPUs without
    bfloat16 tensor cores it runs, and the callback says so once in the log.
    `mixed_float16` under more than one replica is refused by the engine
    (Keras' `LossScaleOptimizer` checks only replica 0's gradients).

    Works with every strategy, `jit_compile=True`, `steps_per_execution > 1`,
    `BackupAndRestore` (it keeps no training state: the policy is its
    configuration) and the other keras_tpu_mem callbacks, in any order; on the
    JAX backend the same, under any `keras.distribution` (`DataParallel`,
    `ModelParallel`), with the same arguments.

    With `keep_after_fit=True` the model keeps the bfloat16 policies after
    `fit` (hidden layers compute in bfloat16, output layers in float32, every
    variable float32) until `callback.restore(model)`; `predict` then runs in
    bfloat16 too.

    Args:
        keep_float32: Layers to keep in float32: a layer name, a layer class
            (matched with `isinstance`), or a list of them. Names must exist in
            the model.
        exact_output_gradients: If True, output layers are plain float32 layers
            (float32 backward pass too), at the cost of a float32 copy of their
            input and of its gradient at the memory peak.
        keep_after_fit: If True, the model keeps the bfloat16 policies after
            `fit` instead of getting its own back.

    Example:

    ```python
    import numpy as np, keras
    import keras_tpu_mem as ktm

    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.random.rand(256, 16), np.random.randint(0, 3, 256)
    model.fit(x, y, batch_size=64, epochs=1, callbacks=[ktm.MixedBFloat16()])
    print(model.layers[0].compute_dtype)   # float32 again after fit
    ```
    """

    name = "compute_policy"
    order = 10

    def __init__(self, keep_float32=None, *, exact_output_gradients: bool = False,
                 keep_after_fit: bool = False):
        super().__init__()
        self._names, self._types = _normalize_keep(keep_float32)
        if not isinstance(keep_after_fit, bool):
            raise TypeError(
                f"`keep_after_fit` must be True or False, got {keep_after_fit!r} "
                f"({type(keep_after_fit).__name__})."
            )
        self.keep_after_fit = keep_after_fit
        if not isinstance(exact_output_gradients, bool):
            raise TypeError(
                "`exact_output_gradients` must be True or False, got "
                f"{exact_output_gradients!r} ({type(exact_output_gradients).__name__})."
            )
        self.exact_output_gradients = exact_output_gradients
        self._saved: list | None = None
        self._wrappers: list[_Float32Forward] = []
        self._outputs_known = True
        self.plan: _Plan | None = None

    @property
    def keep_float32(self) -> list:
        return [*self._names, *self._types]

    def get_config(self):
        """Layer names as given; layer classes as importable `module.QualName` paths."""
        return {
            "keep_float32": list(self._names),
            "keep_float32_classes": [f"{t.__module__}.{t.__qualname__}" for t in self._types],
            "exact_output_gradients": self.exact_output_gradients,
            "keep_after_fit": self.keep_after_fit,
        }

    @classmethod
    def from_config(cls, config):
        import importlib

        types = []
        for path in config.get("keep_float32_classes") or ():
            module, _, qualname = path.rpartition(".")
            try:
                types.append(getattr(importlib.import_module(module), qualname))
            except (ImportError, AttributeError, ValueError) as err:
                raise ValueError(f"keep_float32 class {path!r} cannot be imported.") from err
        keep = [*(config.get("keep_float32") or ()), *types]
        return cls(keep or None,
                   exact_output_gradients=config.get("exact_output_gradients", False),
                   keep_after_fit=config.get("keep_after_fit", False))

    # ---------------------------------------------------------------- engine
    def install(self, model):
        if self._saved is not None:  # the same callback, again, after an interrupted fit
            self.restore(model)
        plan = _plan(model, self._names, self._types)
        self._saved = [(layer, layer.dtype_policy)
                       for layer in [*plan.bf16, *(lay for lay, _ in plan.float32)]]
        for layer in plan.bf16:
            layer.dtype_policy = MIXED_BF16
        self._wrappers = []
        for layer, reason in plan.float32:
            layer.dtype_policy = FLOAT32
            if (reason == "output" and not self.exact_output_gradients
                    and any(layer is out for out in plan.outputs or ())
                    and _straight_through_ok(layer)):
                wrapper = _Float32Forward(layer)
                wrapper.install()
                self._wrappers.append(wrapper)
        self._outputs_known = plan.outputs is not None
        self.plan = plan
        _reset_traces(model)
        logger.info("MixedBFloat16: %s.", _describe(plan, [w.layer for w in self._wrappers]))
        # TensorFlow: the model's strategy; JAX: the active keras.distribution.
        _log_device_notice(model.distribute_strategy if keras.backend.backend() == "tensorflow"
                           else None)

    def uninstall(self, model):
        if not self.keep_after_fit:
            self.restore(model)
            return
        # Keep the bf16 policies, but give output layers their plain float32
        # call back: outside training the bf16 gradient path only costs time.
        for wrapper in self._wrappers:
            wrapper.uninstall()
        self._wrappers = []
        _reset_traces(model)

    def restore(self, model) -> None:
        """Gives `model` its own policies back (done for you at the end of `fit`)."""
        if self._saved is None:
            return
        for wrapper in self._wrappers:
            wrapper.uninstall()
        for layer, policy in self._saved:
            layer.dtype_policy = policy
        self._saved = None
        self._wrappers = []
        _reset_traces(model)

    def transform_loss(self, loss, ctx):
        # Runs at trace time: the one place where the model's real output dtype
        # is visible, whatever the model's kind.
        low = [t for t in keras.tree.flatten(ctx.y_pred) if _is_float(t) and
               keras.backend.standardize_dtype(t.dtype) in _LOW_PRECISION]
        if low:
            why = ("" if self._outputs_known else
                   f" {type(ctx.model).__name__} is a subclassed model, whose output "
                   "layers cannot be read from a graph.")
            raise ValueError(
                f"MixedBFloat16: the model's output is {low[0].dtype.name}, so the loss "
                f"would see low-precision logits.{why} Name the layer that produces "
                "the output in `keep_float32`, e.g. MixedBFloat16(keep_float32=['head'])."
            )
        return loss


def _reset_traces(model) -> None:
    """Drops Keras' cached predict/test functions: they were traced with other policies."""
    model.test_function = None
    model.predict_function = None


# -------------------------------------------------------------- converter
def to_mixed_bfloat16(model, keep_float32=None):
    """Returns a new model computing in bfloat16, with the same weights bit for bit.

    The policy assignment is `MixedBFloat16`'s (hidden layers `mixed_bfloat16`,
    output layers and `keep_float32` layers `float32`), but built into the new
    model's config: it saves and loads as a mixed-precision model, and its
    output layers are plain float32 layers. The original model is not changed.
    The new model is not compiled: compile it as you compiled the original.

    Functional and Sequential models (nested ones too) are cloned layer by layer
    with `keras.models.clone_model`. A subclassed model is recreated from its
    config and the policies are set on its built layers, as `MixedBFloat16`
    does; they are part of a later save only if its `get_config` passes
    `dtype` on to its layers, and its output layers must be named in
    `keep_float32`.

    Args:
        model: A built Keras model.
        keep_float32: Layer names or classes to keep in float32 (see
            `MixedBFloat16`).

    Returns:
        The new model.

    Raises:
        ValueError: if `model` is not built, `keep_float32` names a layer the
            model does not have, or a subclassed model's output would not be
            float32 (its output layer is not in `keep_float32`).

    Example:

    ```python
    import numpy as np, keras
    import keras_tpu_mem as ktm

    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(3)])
    bf16 = ktm.to_mixed_bfloat16(model)
    print(bf16.layers[0].compute_dtype, bf16.layers[-1].compute_dtype)
    # bfloat16 float32
    print(bf16.predict(np.random.rand(4, 16), verbose=0).dtype)   # float32
    ```
    """
    names, types = _normalize_keep(keep_float32)
    plan = _plan(model, names, types)
    if not model.built:
        raise ValueError(f"Model {model.name!r} is not built: call it on data or build "
                         "it with an Input before converting it.")
    target = {id(layer): MIXED_BF16 for layer in plan.bf16}
    target.update({id(layer): FLOAT32 for layer, _ in plan.float32})

    if _graph_container(model):
        def clone_layer(layer):
            config = layer.get_config()
            if id(layer) in target:
                config["dtype"] = target[id(layer)]
            return layer.__class__.from_config(config)

        new = keras.models.clone_model(model, clone_function=clone_layer, recursive=True)
    else:
        build_config = model.get_build_config()
        if not build_config:
            raise ValueError(f"Model {model.name!r} has no build config to rebuild "
                             "it from; build it with a known input shape first.")
        new = keras.models.clone_model(model)
        new.build_from_config(build_config)
        old_layers, new_layers = _all_layers(model), _all_layers(new)
        if [type(a) for a in old_layers] != [type(b) for b in new_layers]:
            raise ValueError(f"The clone of {model.name!r} does not have the same layers; "
                             "its get_config/from_config do not round-trip.")
        for old, layer in zip(old_layers, new_layers):
            if id(old) in target:
                layer.dtype_policy = target[id(old)]
        _check_subclassed_output(new, build_config)
    new.set_weights(model.get_weights())
    return new


def _check_subclassed_output(model, build_config) -> None:
    """Raises if a converted subclassed model's output is not float32."""
    shape = build_config.get("input_shape")
    try:
        spec = model.compute_output_spec(keras.KerasTensor(tuple(shape)))
    except Exception as err:  # a call that needs more than one plain input
        raise ValueError(
            f"to_mixed_bfloat16 could not check the output dtype of {model.name!r} "
            f"({type(err).__name__}: {err}); convert a Functional version of the model."
        ) from err
    low = [t.dtype for t in keras.tree.flatten(spec)
           if keras.backend.standardize_dtype(t.dtype) in _LOW_PRECISION]
    if low:
        raise ValueError(
            f"{type(model).__name__} is a subclassed model, whose output layers cannot "
            f"be read from a graph, and its output would be {low[0]}: name the layer "
            "that produces it in `keep_float32`, e.g. "
            "to_mixed_bfloat16(model, keep_float32=['head'])."
        )


def enable_mixed_bfloat16():
    """Sets the global policy to `mixed_bfloat16`; returns the previous policy.

    Only layers built afterwards are affected. Give the layer that produces the
    model's output `dtype="float32"` (check with `precision_report`), or convert
    an existing model with `to_mixed_bfloat16` instead.

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm

    previous = ktm.enable_mixed_bfloat16()
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(3, dtype="float32")])
    keras.config.set_dtype_policy(previous)   # back to what it was
    ```
    """
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(MIXED_BF16)
    return previous


# ------------------------------------------------------------------ report
@dataclasses.dataclass(frozen=True)
class PrecisionRow:
    """One layer of a `PrecisionReport`.

    Attributes:
        path: The layer's path in the model (`layer.path`, or its name).
        class_name: The layer's class.
        policy: Its dtype policy's name.
        compute_dtype: The dtype it computes in.
        variable_dtype: The dtypes of its own weights (`"-"` if it has none).
        role: `"output"` (produces a model output), `"container"` (a Functional
            or Sequential model) or `"hidden"`.
        flags: Risky spots, as sentences (empty when none).
    """

    path: str
    class_name: str
    policy: str
    compute_dtype: str
    variable_dtype: str
    role: str
    flags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What `precision_report` returns: rows, model-level notes and a printable table."""

    model_name: str
    global_policy: str
    rows: tuple[PrecisionRow, ...]
    notes: tuple[str, ...] = ()

    @property
    def flagged(self) -> list[PrecisionRow]:
        """The rows with at least one flag."""
        return [row for row in self.rows if row.flags]

    def to_string(self) -> str:
        header = ("layer", "class", "policy", "compute", "variables", "role")
        table = [header] + [(r.path, r.class_name, r.policy, r.compute_dtype,
                             r.variable_dtype, r.role) for r in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        lines = [f"Precision report for {self.model_name!r} "
                 f"(global policy: {self.global_policy})"]
        for index, line in enumerate(table):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
            if index and self.rows[index - 1].flags:
                lines.extend(f"    ! {flag}" for flag in self.rows[index - 1].flags)
        counts: dict[str, int] = {}
        for row in self.rows:
            if row.role != "container":
                counts[row.compute_dtype] = counts.get(row.compute_dtype, 0) + 1
        summary = ", ".join(f"{n} {dtype}" for dtype, n in sorted(counts.items()))
        lines.append(f"compute dtypes: {summary}; "
                     f"{sum(len(r.flags) for r in self.rows)} flag(s).")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_string()


def _is_softmax(layer) -> bool:
    if isinstance(layer, keras.layers.Softmax):
        return True
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None) in ("softmax", "log_softmax")


def precision_report(model) -> PrecisionReport:
    """Every layer's compute and variable dtype, with the risky spots flagged.

    Flags:

    * bfloat16/float16 logits feeding the loss: an output layer (see
      `MixedBFloat16`) computing in low precision;
    * a softmax computing in bfloat16/float16;
    * float16 compute without a `LossScaleOptimizer`;
    * a policy that differs from the global one (`keras.config.dtype_policy()`),
      which layers built later would not share.

    Args:
        model: A Keras model.

    Returns:
        A `PrecisionReport`: `.rows` (one `PrecisionRow` per layer), `.flagged`,
        `.notes`, and `str(report)` a printable table.

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm

    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(3)])
    print(ktm.precision_report(ktm.to_mixed_bfloat16(model)))
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"Expected a keras.Model, got {type(model).__name__}.")
    global_policy = keras.config.dtype_policy().name
    outputs = _output_layers(model)
    heads = list(outputs or ())
    optimizer = getattr(model, "optimizer", None)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    rows = []
    for layer in _all_layers(model):
        container = _graph_container(layer)
        compute = layer.compute_dtype
        forward_only = isinstance(layer.__dict__.get("call"), _Float32Forward)
        flags = []
        is_head = any(layer is h for h in heads)
        if is_head and compute in _LOW_PRECISION:
            flags.append(f"{compute} logits feed the loss: give this layer dtype='float32'")
        if not container and compute in _LOW_PRECISION and _is_softmax(layer):
            flags.append(f"softmax in {compute}: compute it in float32")
        if not container and compute == "float16" and not scaled:
            flags.append("float16 compute without a LossScaleOptimizer (gradients may "
                         "underflow)")
        if not container and _policy_name(layer) != global_policy:
            flags.append(f"policy differs from the global {global_policy!r}")
        weights = sorted({keras.backend.standardize_dtype(w.dtype) for w in layer.weights})
        role = "container" if container else ("output" if is_head else "hidden")
        if forward_only:
            role = "output (bfloat16 backward)"
        rows.append(PrecisionRow(
            path=getattr(layer, "path", None) or layer.name,
            class_name=type(layer).__name__,
            policy=_policy_name(layer),
            compute_dtype=compute,
            variable_dtype=",".join(weights) or "-",
            role=role,
            flags=tuple(flags),
        ))
    notes = []
    if outputs is None:
        notes.append(f"{type(model).__name__} is a subclassed model: its output layers "
                     "cannot be read from a graph, so bfloat16 logits are not checked.")
    return PrecisionReport(model.name, global_policy, tuple(rows), tuple(notes))


__all__ = [
    "MixedBFloat16",
    "PrecisionReport",
    "PrecisionRow",
    "device_notice",
    "enable_mixed_bfloat16",
    "precision_report",
    "to_mixed_bfloat16",
]
