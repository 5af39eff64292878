"""Compiling the engine's step without a fit (for the planner).

Kept apart from the fit lifetime (`engine/core.py`): it installs features for
one trace and takes them off again, leaving the engine as it found it.
"""

from __future__ import annotations

import contextlib
import contextvars

import keras

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.engine.core import Engine
from keras_tpu_mem.engine.feature import Feature, in_step_order, overrides

# True while `compile_context` installs features for a trace (a planning compile,
# not a fit): what a feature says about its install in the log belongs to a fit.
_COMPILING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "keras_tpu_mem_compiling", default=False)


def compiling_without_fit() -> bool:
    """Whether features are being installed by `compile_context` (the planner), not a fit.

    A feature's `install` reads it to keep quiet what only a real `fit` should
    log (e.g. `MixedBFloat16`'s line naming the layers that compute in bfloat16,
    which the planner would otherwise log once per compiled candidate).

    Example:

    ```python
    def install(self, model):
        ...
        if not compiling_without_fit():
            logger.info("MyFeature: installed on %s.", model.name)
    ```
    """
    return _COMPILING.get()


@contextlib.contextmanager
def compile_context(model, features):
    """Installs `features` on `model` as a `fit` would, for tracing the step, then undoes it.

    Yields the model's backend step (the running backend's `trainer.Step`), whose
    per-replica step then traces exactly what `fit` would install for these
    features. Nothing runs. On exit every feature is uninstalled, every
    layer's dtype policy is put back (even for features that keep theirs after
    a `fit`), each callback's `model` is what it was, and the engine holds the
    features it held before (none outside a `fit`). While it is open,
    `compiling_without_fit()` is True: features log nothing only a `fit` should log.

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
    if features and overrides(model, "train_step"):
        raise TypeError(
            f"{type(model).__name__} overrides `train_step`, so keras_tpu_mem cannot "
            "install its step; there is no engine step to compile for these features.")
    if engine._installed and engine.features:
        raise RuntimeError("The model is inside a fit with keras_tpu_mem features; "
                           "compile its step before or after the fit.")
    features = in_step_order({f.name: f for f in features}.values())
    layers = keras_compat.flatten_layers(model, include_self=True)
    policies = [(layer, layer.dtype_policy) for layer in layers]
    # Keras callbacks keep their model in `_model`; set it without `set_model`,
    # which would register the feature for the model's next fit.
    models = [(f, f.__dict__.get("_model", None)) for f in features
              if isinstance(f, keras.callbacks.Callback)]
    held = engine.features
    installed = []
    compiling = _COMPILING.set(True)
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
            _COMPILING.reset(compiling)
