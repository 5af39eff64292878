"""The features' own variables on JAX, carried between jitted calls as Keras
carries its state.

Keras' JAX `fit` keeps the model's state (weights, optimizer, metrics) out of
the variables during an epoch: each train-function call takes the previous
call's outputs, and the variables get them back only where something can read
them (`model.jax_state_sync()`; `model.state_sync()` from Keras 3.16): at the
end of each epoch, and whenever a callback reads its `model` property. The
features' step variables (pruning masks, a distillation temperature) are carried the same way by
`CarriedFeatureState`: the last call's outputs go straight into the next call,
and are written into the variables when Keras syncs its own state. A write to a
feature variable between calls (a temperature schedule in
`on_train_batch_begin`, the masks re-derived on resume) is seen by the
identity of the variable's value object and taken into the next call. Frozen
variables (a teacher's weights) are read once, then again only when written.
"""

from __future__ import annotations

from keras_tpu_mem._compat import jax as jax_compat


class CarriedFeatureState:
    """The carried and frozen feature values a train function hands its step.

    Args:
        model: The Keras model being fit; its `jax_state_sync()` also writes the
            carried values back into their variables (see `attach`).
        carried: Keras variables the step reads and returns (in step order).
        frozen: Keras variables the step only reads.

    Example:

    ```python
    state = CarriedFeatureState(model, carried, frozen).attach()
    logs, keras_state, values = step(keras_state, data, state.inputs())
    state.carry(values)   # the variables get them at the next sync
    ```
    """

    def __init__(self, model, carried, frozen):
        self.model = model
        self.carried = list(carried)
        self.frozen = list(frozen)
        self._values = self._seen = None  # the next step's carried values; objects seen
        self._frozen = self._frozen_seen = None
        self._pending = False  # the variables are behind `_values`

    @staticmethod
    def _read(variables, values, seen):
        """Refreshes `values` from the variables written since `seen` was taken."""
        if values is None:
            return [v.value for v in variables], [
                jax_compat.variable_value_object(v) for v in variables]
        for i, variable in enumerate(variables):
            current = jax_compat.variable_value_object(variable)
            if current is not seen[i]:  # assigned since (a callback, a resume)
                seen[i] = current
                values[i] = variable.value
        return values, seen

    def inputs(self):
        """`(carried values, frozen values)` for the next call: the last call's
        outputs, or a variable's value where something wrote it since."""
        self._values, self._seen = self._read(self.carried, self._values, self._seen)
        self._frozen, self._frozen_seen = self._read(self.frozen, self._frozen,
                                                     self._frozen_seen)
        return list(self._values), list(self._frozen)

    def carry(self, values) -> None:
        """Keeps a call's carried outputs for the next call (and the next sync)."""
        self._values = list(values)
        self._pending = True

    def sync(self) -> None:
        """Writes the carried values into their variables, except where a
        variable was written since the last call (that newer value stays, and
        the next call takes it)."""
        if not self._pending:
            return
        self._pending = False
        for i, variable in enumerate(self.carried):
            if jax_compat.variable_value_object(variable) is not self._seen[i]:
                continue  # written since the last call: `inputs()` will take it
            jax_compat.set_variable_value(variable, self._values[i])
            self._seen[i] = jax_compat.variable_value_object(variable)

    def attach(self) -> CarriedFeatureState:
        """Makes the model's state sync (`jax_state_sync()`; `state_sync()` from
        Keras 3.16) write these values too, before Keras' own state: it runs
        at every epoch's end, after `evaluate`/`predict`, and when a callback
        reads its `model` (checkpoints, `BackupAndRestore`, the pruning
        summaries). A state attached before (an earlier train function) is
        synced first and replaced."""
        model = self.model
        name = jax_compat.state_sync_name(model)
        previous = model.__dict__.get(name)
        if isinstance(previous, _Sync):
            previous.state.sync()
        # object.__setattr__ keeps Keras' attribute tracking out of it.
        object.__setattr__(model, name, _Sync(self, name))
        return self


class _Sync:
    """`model.jax_state_sync` with the features' carried values synced first."""

    def __init__(self, state: CarriedFeatureState, name: str):
        self.state = state
        self.name = name

    def __call__(self):
        self.state.sync()
        model = self.state.model
        return getattr(type(model), self.name)(model)
