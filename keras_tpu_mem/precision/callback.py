"""`MixedBFloat16`: bfloat16 compute, float32 variables, for the `fit` it is attached to."""

from __future__ import annotations

import keras

from keras_tpu_mem._utils import logger
from keras_tpu_mem.engine import EngineCallback
from keras_tpu_mem.engine.compile import compiling_without_fit
from keras_tpu_mem.precision.notice import log_device_notice
from keras_tpu_mem.precision.output import Float32Forward, is_float, straight_through_ok
from keras_tpu_mem.precision.policies import (
    FLOAT32,
    LOW_PRECISION,
    MIXED_BF16,
    PolicyPlan,
    describe_plan,
    normalize_keep,
    plan_policies,
)

__all__ = ["MixedBFloat16"]


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
        self._names, self._types = normalize_keep(keep_float32)
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
        self._wrappers: list[Float32Forward] = []
        self._outputs_known = True
        self.plan: PolicyPlan | None = None

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
        plan = plan_policies(model, self._names, self._types)
        self._saved = [(layer, layer.dtype_policy)
                       for layer in [*plan.bf16, *(lay for lay, _ in plan.float32)]]
        for layer in plan.bf16:
            layer.dtype_policy = MIXED_BF16
        self._wrappers = []
        for layer, reason in plan.float32:
            layer.dtype_policy = FLOAT32
            if (reason == "output" and not self.exact_output_gradients
                    and any(layer is out for out in plan.outputs or ())
                    and straight_through_ok(layer)):
                wrapper = Float32Forward(layer)
                wrapper.install()
                self._wrappers.append(wrapper)
        self._outputs_known = plan.outputs is not None
        self.plan = plan
        _reset_traces(model)
        if compiling_without_fit():
            return  # a planning compile (compile_context): the log lines belong to a fit
        logger.info("MixedBFloat16: %s.", describe_plan(plan, [w.layer for w in self._wrappers]))
        log_device_notice(model)

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
        low = [t for t in keras.tree.flatten(ctx.y_pred) if is_float(t) and
               keras.backend.standardize_dtype(t.dtype) in LOW_PRECISION]
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
