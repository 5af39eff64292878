"""The features' state carried between jitted calls on JAX
(`keras_tpu_mem/backends/jax/feature_state.py`): a state set between calls reaches
the next step, and the engine holds each call's state for whoever reads it between
calls; the quiet step (`Feature.quiet_update`) and the host's count of the updates.
(The state's API on both backends: tests/test_engine.py.)"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import make_distribution, scope

from keras_tpu_mem import PolynomialDecay, Pruning
from keras_tpu_mem.backends.jax.feature_state import quiet_steps_possible
from keras_tpu_mem.engine import Engine, EngineCallback
from keras_tpu_mem.pruning.callback import PruningState
from keras_tpu_mem.pruning.schedules import ConstantSparsity

BATCH, STEPS = 16, 12


def _model(spe):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((12,)),
                              keras.layers.Dense(24, activation="relu", name="hidden"),
                              keras.layers.Dense(4, name="out")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 12)).astype("float32")
    return x, rng.integers(0, 4, size=BATCH * STEPS)


class _ZeroMaskAt(keras.callbacks.Callback):
    """Zeroes the hidden layer's pruning mask before the call that starts at
    step `at`, and records the hidden kernel seen after every call."""

    def __init__(self, pruning, at):
        super().__init__()
        self.pruning, self.at, self.seen = pruning, at, {}

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            engine = Engine.of(self.model)
            masks = list(engine.feature_state(self.pruning).masks)
            masks[0] = np.zeros(masks[0].shape, bool)
            engine.set_feature_state(self.pruning, PruningState(tuple(masks)))

    def on_train_batch_end(self, batch, logs=None):
        kernel = self.model.layers[0].kernel  # `model` syncs Keras' state
        self.seen[batch] = np.asarray(kernel.value).copy()


@pytest.mark.parametrize("spe", [1, 4])
def test_a_mask_written_between_calls_prunes_the_next_step(spe):
    x, y = _data()
    model = _model(spe)
    # Never prunes by schedule (begin_step past the fit): the masks stay all
    # ones unless written.
    pruning = Pruning(ConstantSparsity(0.5, begin_step=10 * STEPS, frequency=1))
    probe = _ZeroMaskAt(pruning, at=spe)  # the second call
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[pruning, probe])
    first, second = 0 + spe - 1, 2 * spe - 1  # the last step of each call
    assert np.count_nonzero(probe.seen[first]) == probe.seen[first].size
    # The written mask took effect at the very next step, and stays.
    assert not np.any(probe.seen[second])
    assert not np.any(np.asarray(model.layers[0].kernel.value))
    assert not np.any(pruning.masks[0])
    assert np.count_nonzero(np.asarray(model.layers[1].kernel.value)) == 24 * 4
    np.testing.assert_array_equal(pruning.masks[1], True)


class _MasksSeen(keras.callbacks.Callback):
    """Reads the masks the engine holds (as checkpoints do) after every call: they must
    be this call's, covering the kernels' zeros."""

    def __init__(self, pruning):
        super().__init__()
        self.pruning, self.checked = pruning, 0

    def on_train_batch_end(self, batch, logs=None):
        for layer, mask in zip(self.model.layers, self.pruning.masks, strict=True):
            np.testing.assert_array_equal(mask, np.asarray(layer.kernel.value) != 0)
        self.checked += 1


@pytest.mark.parametrize("spe", [1, 4])
def test_between_calls_and_after_fit_the_engine_holds_each_calls_masks(spe):
    x, y = _data()
    model = _model(spe)
    pruning = Pruning(PolynomialDecay(0.0, 0.75, begin_step=0, end_step=2 * STEPS,
                                      frequency=2))
    seen = _MasksSeen(pruning)
    model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
              callbacks=[pruning, seen])
    assert seen.checked == 3 * STEPS // spe
    for layer, mask in zip(model.layers, pruning.masks, strict=True):
        kernel = np.asarray(layer.kernel.value)
        assert np.mean(kernel == 0) == pytest.approx(0.75, abs=0.01)
        np.testing.assert_array_equal(mask, kernel != 0)
    # The same masks whatever the number of steps per call.
    reference = _model(1)
    ref_pruning = Pruning(PolynomialDecay(0.0, 0.75, begin_step=0, end_step=2 * STEPS,
                                          frequency=2))
    reference.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                  callbacks=[ref_pruning])
    for mask, reference_mask in zip(pruning.masks, ref_pruning.masks, strict=True):
        np.testing.assert_array_equal(mask, reference_mask)


# ---------------------------------------------------- quiet steps (`Feature.quiet_update`)
class _CountedPruning(Pruning):
    """Pruning that records the update numbers the engine asks `quiet_update` about."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates = []

    def quiet_update(self, update):
        self.updates.append(update)
        return super().quiet_update(update)


class _NeverQuiet(Pruning):
    """Every update runs the step that may recompute the masks (the step before quiet
    steps existed)."""

    def quiet_update(self, update):
        return False


def _schedule():
    return PolynomialDecay(0.0, 0.75, begin_step=2, end_step=2 * STEPS, frequency=3)


@pytest.mark.parametrize("case", ["none", "dp8"])
@pytest.mark.parametrize("spe", [1, 4])
def test_quiet_steps_train_as_the_step_that_always_branches(spe, case):
    """Updates that are not a turn of the schedule run the quiet step (the masks go in
    and come not out, no branch); the weights and masks equal those of a fit whose every
    update runs the full step, and the host counted every update."""
    x, y = _data()
    results = []
    for pruning in (_CountedPruning(_schedule()), _NeverQuiet(_schedule())):
        with scope(make_distribution(case)):
            model = _model(spe)
            model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                      callbacks=[pruning])
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
                      callbacks=[pruning])
        results.append((model, pruning))
    (quiet, counted), (branching, never) = results
    assert counted.updates == list(range(1, 3 * STEPS + 1))
    for a, b in zip(quiet.get_weights(), branching.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(counted.masks, never.masks, strict=True):
        np.testing.assert_array_equal(a, b)
    kernel = np.asarray(quiet.layers[0].kernel.value)
    assert np.mean(kernel == 0) == pytest.approx(0.75, abs=0.01)


class _SetsIterations(keras.callbacks.Callback):
    """Writes `optimizer.iterations` between two calls, as a restore would."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 4:
            self.model.optimizer.iterations.assign(100)


def test_the_host_count_follows_iterations_written_between_calls():
    x, y = _data()
    model = _model(1)
    pruning = _CountedPruning(_schedule())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False,
              callbacks=[pruning, _SetsIterations()])
    assert pruning.updates == [1, 2, 3, 4] + list(range(101, 101 + STEPS - 4))
    assert int(model.optimizer.iterations.value) == 100 + STEPS - 4


class _WritesWhenQuiet(EngineCallback):
    """Says every update is quiet, then changes its state anyway."""

    name = "writes_when_quiet"
    order = 90

    def init_state(self, ctx):
        return (np.zeros((), "float32"),)

    def quiet_update(self, update):
        return True

    def after_update(self, ctx):
        return (ctx.state[0] + 1.0,)


def test_a_quiet_update_that_changes_its_state_is_an_error():
    x, y = _data()
    with pytest.raises(ValueError, match="quiet_update"):
        _model(1).fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                      callbacks=[_WritesWhenQuiet()])


def test_no_quiet_step_where_iterations_may_not_advance_every_step():
    """A LossScaleOptimizer skips the updates with non-finite gradients (its iterations
    stand still), so the host could not count them: every update runs the full step."""
    model = _model(1)
    pruning = Pruning(_schedule())
    model.fit(*_data(), batch_size=BATCH, epochs=1, verbose=0, callbacks=[pruning])
    states = Engine.of(model).backend_step.states
    assert quiet_steps_possible(model, [pruning], states, Engine.has_hook)
    scaled = _model(1)
    scaled.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
                   loss="sparse_categorical_crossentropy")
    assert not quiet_steps_possible(scaled, [pruning], states, Engine.has_hook)
    # A feature with state that does not tell its quiet updates: none is quiet.
    carries = _CarriesOnly()
    states.values[carries.name] = (np.zeros((), "float32"),)
    assert not quiet_steps_possible(model, [pruning, carries], states, Engine.has_hook)


class _CarriesOnly(EngineCallback):
    """Has state and does not fill `quiet_update`."""

    name = "carries_only"

    def init_state(self, ctx):
        return (np.zeros((), "float32"),)
