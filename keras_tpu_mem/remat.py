"""`Rematerialize`: recompute chosen layers' activations in the backward pass."""

from __future__ import annotations

import keras

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.engine import EngineCallback, StepContext

_MODES = ("layers", "activations")


def output_layers(model) -> set:
    """`{id(layer)}` of the layers whose outputs are the model's (their output feeds the
    loss: nothing is saved for them)."""
    return {id(getattr(t, "_keras_history", (None,))[0])
            for t in keras.tree.flatten(getattr(model, "outputs", None) or [])}


class Rematerialize(EngineCallback):
    """Recomputes layers' activations in the backward pass instead of keeping them.

    Memory for compute: the forward pass of each chosen layer keeps only its
    inputs, and its activations are recomputed when the gradient needs them
    (`keras.remat`: `jax.checkpoint` on JAX, `tf.recompute_grad` on
    TensorFlow). Installed by the engine for the duration of `fit`, like every
    feature; `ktm.plan(..., search=True)` tries it and `compiled_memory(...,
    callbacks=[Rematerialize()])` compiles it.

    **Backends.** `mode="layers"` (each chosen layer's whole `call`) works on
    JAX only: on TensorFlow, recomputing a layer that reads variables crashes
    in `fit` (keras-team/keras#21207, the same failure as Keras' `RematScope`
    modes other than `"activations"`), so it is refused there.
    `mode="activations"` recomputes only the chosen layers' activation
    functions (what Keras' `RematScope(mode="activations")` does) and works on
    both backends; XLA often fuses an activation into its matmul already, so
    it saves less.

    Args:
        layers: Names of the layers to rematerialise, or None for every layer
            with weights except the model's output layers' (their output
            feeds the loss directly: nothing to save).
        mode: `"layers"` or `"activations"` (see above).

    Example:

    ```python
    model.fit(ds, callbacks=[ktm.Rematerialize(), ktm.GradientAccumulation(2)])
    ```
    """

    name = "rematerialize"
    order = 20

    def __init__(self, layers=None, *, mode: str = "layers"):
        super().__init__()
        if layers is not None:
            if isinstance(layers, str) or not all(isinstance(n, str) for n in layers):
                raise TypeError("`layers` must be None or a list of layer names, got "
                                f"{layers!r}.")
            layers = list(layers)
        if mode not in _MODES:
            raise ValueError(f"`mode` must be one of {_MODES}, got {mode!r}.")
        self.layers = layers
        self.mode = mode
        self._wrapped = []

    def get_config(self):
        return {"layers": self.layers, "mode": self.mode}

    @classmethod
    def from_config(cls, config):
        return cls(config.get("layers"), mode=config.get("mode", "layers"))

    def chosen_layers(self, model) -> list:
        """The layers of `model` this callback rematerialises: those named in `layers`,
        else every leaf layer with weights but the output layers.

        Raises:
            ValueError: `layers` names a layer `model` does not have.
        """
        layers = [layer for layer in keras_compat.flatten_layers(model, include_self=False)
                  if not isinstance(layer, keras.layers.InputLayer)]
        if self.layers is not None:
            by_name = {layer.name: layer for layer in layers}
            missing = [n for n in self.layers if n not in by_name]
            if missing:
                raise ValueError(f"Rematerialize: the model has no layer named "
                                 f"{', '.join(missing)}.")
            return [by_name[n] for n in self.layers]
        outputs = output_layers(model)
        # Leaf layers with weights (a Dense, an attention block), not containers.
        return [layer for layer in layers if layer.weights
                and not keras_compat.flatten_layers(layer, include_self=False)
                and id(layer) not in outputs]

    def install(self, model):
        self.uninstall(model)
        if self.mode == "layers":
            StepContext.outside(model).check_layer_remat()
        for layer in self.chosen_layers(model):
            if self.mode == "activations":
                activation = getattr(layer, "activation", None)
                if activation is None or activation is keras.activations.linear:
                    continue
                self._wrapped.append((layer, "activation", layer.__dict__.get("activation")))
                object.__setattr__(layer, "activation", keras.remat(activation))
            else:
                self._wrapped.append((layer, "call", layer.__dict__.get("call")))
                object.__setattr__(layer, "call", _remat_call(layer.call))

    def uninstall(self, model):
        for layer, attribute, previous in reversed(self._wrapped):
            if previous is None:
                object.__delattr__(layer, attribute)
            else:
                object.__setattr__(layer, attribute, previous)
        self._wrapped = []


def _remat_call(call):
    """`call` recomputed in the backward pass; non-tensor arguments stay static."""

    def rematerialized(*args, **kwargs):
        static = {k: v for k, v in kwargs.items() if not keras.ops.is_tensor(v)}
        tensors = {k: v for k, v in kwargs.items() if k not in static}

        def run(*a, **kw):
            return call(*a, **kw, **static)

        return keras.remat(run)(*args, **tensors)

    return rematerialized
