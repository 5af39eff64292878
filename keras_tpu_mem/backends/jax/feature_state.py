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

from typing import NamedTuple

import keras
import numpy as np

from keras_tpu_mem._compat import jax as jax_compat


class FeatureValues(NamedTuple):
    """The features' own variables' values as a step takes them (its third argument).

    Attributes:
        carried: Values of the `step_variables` (the step returns their new values).
        frozen: Values of the `frozen_variables` (read only).
    """

    carried: list
    frozen: list


def feature_variables(features):
    """`(carried, frozen)` Keras variables the features own (see
    `Feature.step_variables` / `Feature.frozen_variables`), in feature order."""
    carried, frozen = [], []
    for feature in features:
        carried.extend(feature.step_variables())
        frozen.extend(feature.frozen_variables())
    return carried, frozen


def feature_mapping(features, values: FeatureValues) -> list:
    """`(variable, value)` pairs of the features' variables for a `keras.StatelessScope`.

    Raises:
        ValueError: `values` do not match the features' variables in number.
    """
    carried, frozen = feature_variables(features)
    if len(values.carried) != len(carried) or len(values.frozen) != len(frozen):
        raise ValueError(
            f"The step got {len(values.carried)} carried and {len(values.frozen)} frozen "
            f"feature values for {len(carried)} and {len(frozen)} feature variables; pass "
            "`Step.feature_state()` as the step's third argument.")
    return [*zip(carried, values.carried), *zip(frozen, values.frozen)]


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


class UpdateCounter:
    """`optimizer.iterations` on the host, update by update, without waiting for the device.

    Read from a step's input state when that state is not the one the last step
    returned (the first call; Keras re-read its state from the variables: a new
    `fit`, a restore, a callback that wrote it), which waits for the device once;
    then counted, one per update.

    Args:
        model: The model being fit; its optimizer's `iterations` is counted.
    """

    def __init__(self, model):
        optimizer = model.optimizer
        self._index = next(i for i, v in enumerate(optimizer.variables)
                           if v is optimizer.iterations)
        self._last = self._count = None  # the iterations array last seen; its value

    def next_update(self, state) -> int:
        """`optimizer.iterations` after the update the step is about to make of `state`."""
        iterations = state[2][self._index]
        if iterations is not self._last:
            # A replicated value: its first local shard is the whole (also multi-host).
            self._count = int(np.asarray(iterations.addressable_data(0)))
            self._last = iterations
        return self._count + 1

    def advance(self, state, update: int) -> None:
        """The step made update `update` and returned `state`."""
        self._last, self._count = state[2][self._index], update


def quiet_steps_possible(model, features, has_hook) -> bool:
    """Whether a quiet step (`Feature.quiet_update`) can be chosen: every feature with
    step variables fills `quiet_update` (`has_hook(feature, "quiet_update")`), and
    `optimizer.iterations` advances by one a step (a `LossScaleOptimizer` skips the
    updates with non-finite gradients)."""
    carriers = [f for f in features if f.step_variables()]
    return (bool(carriers) and all(has_hook(f, "quiet_update") for f in carriers)
            and not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer))


def carrying_step(model, features, carried, frozen, step, quiet_step=None):
    """The train function's `(state, data) -> (logs, state)` around a step that takes
    the features' carried and frozen values and returns the carried ones.

    With `quiet_step` (the same step compiled with `quiet=True`, which returns no
    carried values), each update that every feature with step variables calls quiet
    (`Feature.quiet_update`) runs it instead.

    Returns:
        `(train_step, on_error)`: `on_error()` writes the carried values into their
        variables (for an error of the step).
    """
    values = CarriedFeatureState(model, carried, frozen).attach()
    carriers = [f for f in features if f.step_variables()]
    counter = UpdateCounter(model) if quiet_step is not None else None

    def train_step(state, data):
        inputs = values.inputs()
        update = None if counter is None else counter.next_update(state)
        if update is not None and all(f.quiet_update(update) for f in carriers):
            logs, state = quiet_step(state, data, inputs)
        else:
            logs, state, outputs = step(state, data, inputs)
            values.carry(outputs)
        if counter is not None:
            counter.advance(state, update)
        return logs, state

    return train_step, values.sync


def check_quiet(features, given, returned) -> None:
    """A quiet step's features left their carried values as given (`Feature.quiet_update`)."""
    if any(new is not old for old, new in zip(given, returned)):
        names = ", ".join(type(f).__name__ for f in features if f.step_variables())
        raise ValueError(
            f"A feature among {names} assigned a step variable in an update its "
            "quiet_update(update) called quiet; return False there, or assign nothing "
            "when ctx.quiet is True.")
