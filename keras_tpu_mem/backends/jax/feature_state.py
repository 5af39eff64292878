"""The features' state on JAX, carried beside Keras' state from jitted call to call.

Keras' JAX `fit` keeps the model's state (weights, optimizer, metrics) out of
the variables during an epoch: each train-function call takes the previous
call's outputs. The features' state (each feature's `init_state`: pruning masks,
a distillation temperature) is carried the same way, as values the engine holds
(`FeatureStates`): a train function hands them to its step and keeps what the
step returns; `Engine.feature_state(feature)` reads them between calls and
`Engine.set_feature_state(feature, state)` replaces them (a temperature schedule
at an epoch's start, the masks re-derived on a resume), for the next call. No
variable holds them, so nothing is synced back. Frozen variables (a teacher's
weights) are read from their variables at every call: attribute reads, no copy.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.backends.step import StepContext, check_state_replacement


class FeatureValues(NamedTuple):
    """The features' values as a step takes them (its third argument).

    Attributes:
        carried: Feature name -> its state (the step returns the new states).
        frozen: Values of the `frozen_variables` (read only).
    """

    carried: dict
    frozen: list


def frozen_variables(features) -> list:
    """The Keras variables the features read in the step and never write
    (`Feature.frozen_variables`), in feature order."""
    return [v for feature in features for v in feature.frozen_variables()]


def frozen_mapping(features, values: FeatureValues) -> list:
    """`(variable, value)` pairs of the features' frozen variables for a
    `keras.StatelessScope`.

    Raises:
        ValueError: `values` do not match the features' frozen variables in number.
    """
    frozen = frozen_variables(features)
    if len(values.frozen) != len(frozen):
        raise ValueError(
            f"The step got {len(values.frozen)} frozen feature values for {len(frozen)} "
            "frozen variables; pass `Step.feature_values()` as the step's third argument.")
    return list(zip(frozen, values.frozen))


def _placed(value, like=None):
    """`value` as a JAX array where the step takes it: `like`'s dtype and sharding when
    given (a state replaced between calls keeps its leaf's); else, under a
    `keras.distribution`, its own sharding if it is laid out over a mesh (a mask made
    like its kernel) or replicated over the distribution's mesh; uncommitted
    without one, like Keras' own state."""
    if like is not None:
        value = jax.numpy.asarray(value, dtype=like.dtype)
        if isinstance(like.sharding, NamedSharding):
            return jax.device_put(value, like.sharding)
        return value
    value = jax.numpy.asarray(value)
    distribution = keras.distribution.distribution()
    if distribution is None or isinstance(value.sharding, NamedSharding):
        return value
    mesh = jax_compat.backend_mesh(distribution.device_mesh)
    return jax.device_put(value, NamedSharding(mesh, PartitionSpec()))


class FeatureStates:
    """Each feature's state between jitted calls (see the module docstring).

    Args:
        model: The model whose engine holds them.

    Example:

    ```python
    states = FeatureStates(model)
    states.start(features)                 # each feature's init_state, at a fit's start
    logs, keras_state, new = step(keras_state, data, states.inputs(features))
    states.carry(new)
    ```
    """

    def __init__(self, model):
        self.model = model
        self.values: dict = {}

    def start(self, features) -> None:
        """Each feature's `init_state`, for a new fit."""
        ctx = StepContext.outside(self.model)
        values = {}
        for feature in features:
            state = feature.init_state(ctx)
            if state is not None:
                values[feature.name] = keras.tree.map_structure(_placed, state)
        self.values = values

    def for_step(self, features) -> dict:
        """The states a step of `features` takes: the held ones, or `init_state`'s for a
        feature that has none held (a step compiled outside a fit: planning)."""
        ctx, values = None, {}
        for feature in features:
            state = self.values.get(feature.name)
            if state is None:
                ctx = ctx or StepContext.outside(self.model)
                state = feature.init_state(ctx)
                if state is not None:
                    state = keras.tree.map_structure(_placed, state)
            if state is not None:
                values[feature.name] = state
        return values

    def inputs(self, features) -> FeatureValues:
        """The next call's third argument: the held states and the frozen values."""
        return FeatureValues(dict(self.values),
                             [v.value for v in frozen_variables(features)])

    def carry(self, carried: dict) -> None:
        """Keeps a call's new states for the next call."""
        self.values.update(carried)

    def get(self, feature):
        """`feature`'s state (None: it has none, or no fit made it yet)."""
        return self.values.get(feature.name)

    def set(self, feature, state) -> None:
        """Replaces `feature`'s state for the next call: the same structure, each value
        cast to the held one's dtype and laid out as it is.

        Raises:
            ValueError: `feature` holds no state, or `state` has another structure or
                other shapes.
        """
        held = self.values.get(feature.name)
        if held is None:
            raise ValueError(
                f"{type(feature).__name__} holds no state in this fit: its "
                "`init_state` returned None, or no fit with it started yet.")
        check_state_replacement(feature, held, state)
        self.values[feature.name] = keras.tree.map_structure(
            lambda new, old: _placed(new, like=old), state, held)


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


def quiet_steps_possible(model, features, states: FeatureStates, has_hook) -> bool:
    """Whether a quiet step (`Feature.quiet_update`) can be chosen: every feature with
    state fills `quiet_update` (`has_hook(feature, "quiet_update")`), and
    `optimizer.iterations` advances by one a step (a `LossScaleOptimizer` skips the
    updates with non-finite gradients)."""
    carriers = [f for f in features if states.get(f) is not None]
    return (bool(carriers) and all(has_hook(f, "quiet_update") for f in carriers)
            and not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer))


def carrying_step(model, features, states: FeatureStates, step, quiet_step=None):
    """The train function's `(state, data) -> (logs, state)` around a step that takes
    the features' states and frozen values and returns the new states.

    With `quiet_step` (the same step compiled with `quiet=True`, which returns no
    states), each update that every feature with state calls quiet
    (`Feature.quiet_update`) runs it instead.
    """
    features = tuple(features)  # the build's snapshot (the engine's list changes)
    carriers = [f for f in features if states.get(f) is not None]
    counter = UpdateCounter(model) if quiet_step is not None else None

    def train_step(state, data):
        inputs = states.inputs(features)
        update = None if counter is None else counter.next_update(state)
        if update is not None and all(f.quiet_update(update) for f in carriers):
            logs, state = quiet_step(state, data, inputs)
        else:
            logs, state, carried = step(state, data, inputs)
            states.carry(carried)
        if counter is not None:
            counter.advance(state, update)
        return logs, state

    return train_step


def check_quiet(features, given: dict, returned: dict) -> None:
    """A quiet step's features left their states as given (`Feature.quiet_update`)."""
    changed = [name for name in given
               if any(new is not old for old, new in zip(keras.tree.flatten(given[name]),
                                                          keras.tree.flatten(returned[name])))]
    if changed:
        names = ", ".join(type(f).__name__ for f in features if f.name in changed)
        raise ValueError(
            f"{names} changed its state in an update its quiet_update(update) called "
            "quiet; return False there, or return ctx.state unchanged when ctx.quiet is "
            "True.")
