"""The features' state on TensorFlow: variables the engine makes from each feature's
`init_state`, which the compiled step reads and writes in place.

A feature's state is carried in variables (`FeatureStates`) made at the fit's start
(or, for a model Keras builds in the step's first trace, in that trace, before the
features' hooks): replica-local (sync-on-read) under the model's strategy, each
replica writing its own copy in the step (all copies equal: same mirrored weights,
same computation), owned by the engine (never by the model). The step's hooks see
their values as `ctx.state`; what `after_update` returns is written back. A later
fit that reuses the traced step gives the same variables the feature's
`init_state` again; where that no longer fits them they are made anew (and the step
traced again).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_tpu_mem.backends.step import StepContext, check_state_replacement


def _carriers(model, state):
    """The variables that carry `state`, made from it under the model's strategy."""
    with model.distribute_strategy.scope():
        return keras.tree.map_structure(
            lambda value: keras.Variable(
                value, dtype=keras.backend.standardize_dtype(value.dtype), trainable=False,
                synchronization="on_read", aggregation="only_first_replica",
                name="feature_state"), state)


def _fits(carriers, state) -> bool:
    """Whether `state` has the structure, shapes and dtypes of the `carriers`."""
    try:
        keras.tree.assert_same_structure(carriers, state)
    except (ValueError, TypeError):
        return False
    return all(tuple(v.shape) == tuple(value.shape)
               and keras.backend.standardize_dtype(v.dtype)
               == keras.backend.standardize_dtype(value.dtype)
               for v, value in zip(keras.tree.flatten(carriers), keras.tree.flatten(state)))


class FeatureStates:
    """Each feature's state in variables (see the module docstring).

    Args:
        model: The model whose engine holds them.
    """

    def __init__(self, model):
        self.model = model
        self.carriers: dict = {}  # feature name -> a structure of variables
        self._pending: dict = {}  # feature name -> a state set before its carriers exist
        self._stateless: set = set()

    def start(self, features) -> bool:
        """At a fit's start (outside any replica context): each feature's `init_state`
        goes into its carriers, made here where there are none yet, or made again where
        it no longer fits them. A model still unbuilt (Keras builds it in the step's
        first trace) gets its carriers there. Returns whether any carriers were made:
        a step traced before would read the old ones, so it must be traced again."""
        self._pending, self._stateless = {}, set()
        ctx, made = StepContext.outside(self.model), False
        for feature in features:
            carriers = self.carriers.get(feature.name)
            if carriers is None and not self.model.built:
                continue
            state = feature.init_state(ctx)
            if state is None:
                self._stateless.add(feature.name)
                made = made or self.carriers.pop(feature.name, None) is not None
            elif carriers is not None and _fits(carriers, state):
                for variable, value in zip(keras.tree.flatten(carriers),
                                           keras.tree.flatten(state)):
                    variable.assign(value)
            else:
                self.carriers[feature.name] = _carriers(self.model, state)
                made = True
        return made

    def in_step(self, feature, ctx):
        """Inside the trace: `(carriers, their values)` of `feature`, or `(None, None)`
        where it has no state; carriers not made at the fit's start are made (eagerly)
        at the first trace that needs them, from a state set before or else the
        feature's `init_state`."""
        name = feature.name
        if name in self._stateless:
            return None, None
        carriers = self.carriers.get(name)
        if carriers is None:
            state = self._pending.pop(name, None)
            if state is None:
                state = ctx.eagerly(
                    lambda: feature.init_state(StepContext.outside(self.model)))
            if state is None:
                self._stateless.add(name)
                return None, None
            carriers = ctx.eagerly(lambda: _carriers(self.model, state))
            self.carriers[name] = carriers
        return carriers, keras.tree.map_structure(lambda v: v.value, carriers)

    @staticmethod
    def write(feature, carriers, ctx, new_state) -> None:
        """Inside the step: the carriers take `new_state` (what `after_update`
        returned), except the values they already hold (`ctx.state` as it came, or what
        `state_where` wrote)."""
        if carriers is None:
            raise ValueError(
                f"{type(feature).__name__}.after_update returned a state, but its "
                "init_state returned None: a feature's state is made by init_state.")
        keras.tree.assert_same_structure(carriers, new_state)
        held = keras.tree.flatten(ctx.state)
        for variable, old, value in zip(keras.tree.flatten(carriers), held,
                                        keras.tree.flatten(new_state)):
            if value is old or any(value is written for written in ctx.written):
                continue
            variable.assign(tf.cast(value, variable.dtype))

    def get(self, feature):
        """`feature`'s state: its carriers' values (None: none yet)."""
        carriers = self.carriers.get(feature.name)
        if carriers is None:
            return self._pending.get(feature.name)
        return keras.tree.map_structure(lambda v: tf.convert_to_tensor(v.value), carriers)

    def set(self, feature, state) -> None:
        """Between steps: the carriers take `state` (kept for their making where the
        step that makes them has not run yet).

        Raises:
            ValueError: `state` has another structure or other shapes.
        """
        carriers = self.carriers.get(feature.name)
        if carriers is None:
            self._pending[feature.name] = state
            return
        check_state_replacement(feature, carriers, state)
        for variable, value in zip(keras.tree.flatten(carriers), keras.tree.flatten(state)):
            variable.assign(tf.cast(value, variable.dtype))
