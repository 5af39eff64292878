"""A feature's explicit state (`Feature.init_state`, `ctx.state`, what `after_update`
returns), carried by the engine on both backends: read and replaced between steps
(`Engine.feature_state` / `Engine.set_feature_state`), updated where a condition
holds (`ctx.state_where`), made afresh at each fit, and refused where it is misused.
(On JAX, the carrying between jitted calls in detail: tests/test_feature_state_jax.py.)"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from keras import ops

from keras_tpu_mem.engine import Engine, EngineCallback

BATCH, STEPS = 8, 12


class CountUpdates(EngineCallback):
    """Counts the updates in its state; with `every`, only the updates whose number
    `every` divides (a conditional update)."""

    name = "count_updates"

    def __init__(self, every=None):
        super().__init__()
        self.every = every

    def init_state(self, ctx):
        return (np.zeros((), "int32"),)

    def after_update(self, ctx):
        (count,) = ctx.state
        if self.every is None:
            return (count + 1,)
        if self.every == 0:  # a plain Python number as the new state
            return (0,)
        turn = ops.equal(ops.mod(ctx.update_count(), self.every), 0)
        return ctx.state_where(turn, lambda: (count + 1,))


class SetAt(keras.callbacks.Callback):
    """Sets the feature's state before the call that starts at `batch` (and records
    the state read there)."""

    def __init__(self, feature, batch, state):
        super().__init__()
        self.feature, self.batch, self.state, self.seen = feature, batch, state, None

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.batch:
            engine = Engine.of(self.model)
            self.seen = int(np.asarray(engine.feature_state(self.feature)[0]))
            engine.set_feature_state(self.feature, self.state)


def _model(spe=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=spe)
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(BATCH * STEPS, 4)).astype("float32"),
            rng.normal(size=(BATCH * STEPS, 2)).astype("float32"))


def _count(model, feature) -> int:
    return int(np.asarray(Engine.of(model).feature_state(feature)[0]))


@pytest.mark.parametrize("spe", [1, 4])
def test_the_state_is_carried_read_and_replaced_between_steps(spe):
    """Each update adds one to the count; read before the call at batch 8 it is 8, set
    there to 100, the fit ends at 104; a second fit starts again from `init_state`."""
    x, y = _data()
    model, counter = _model(spe), CountUpdates()
    setter = SetAt(counter, 8, (np.asarray(100, "int32"),))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[counter, setter])
    assert setter.seen == 8
    assert _count(model, counter) == 100 + STEPS - 8
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[counter])
    assert _count(model, counter) == STEPS


def test_a_conditional_update_changes_the_state_only_where_it_holds():
    x, y = _data()
    model, counter = _model(), CountUpdates(every=3)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
              callbacks=[counter])
    assert _count(model, counter) == 2 * STEPS // 3


def test_a_python_number_is_a_state_of_the_held_dtype():
    x, y = _data()
    model, counter = _model(), CountUpdates(every=0)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[counter])
    state = Engine.of(model).feature_state(counter)[0]
    assert _count(model, counter) == 0
    assert keras.backend.standardize_dtype(state.dtype) == "int32"


def test_a_state_of_another_structure_or_shape_is_refused():
    x, y = _data()
    model, counter = _model(), CountUpdates()
    errors = []

    class Misuse(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 2:  # the state exists on both backends after the first step
                engine = Engine.of(self.model)
                for bad in ((np.zeros((), "int32"), np.zeros((), "int32")),
                            (np.zeros((3,), "int32"),)):
                    with pytest.raises(ValueError, match="state given to CountUpdates") as err:
                        engine.set_feature_state(counter, bad)
                    errors.append(str(err.value))

    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[counter, Misuse()])
    assert len(errors) == 2 and "structured" in errors[0] and "shape (3,)" in errors[1]
    assert _count(model, counter) == STEPS  # nothing of the refused states was taken


class ReturnsWithoutInit(EngineCallback):
    """Returns a state from `after_update` without making one in `init_state`."""

    name = "returns_without_init"

    def after_update(self, ctx):
        return (ops.zeros(()),)


def test_a_state_returned_without_init_state_is_refused():
    x, y = _data()
    with pytest.raises(ValueError, match="its init_state returned None"):
        _model().fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                     callbacks=[ReturnsWithoutInit()])
