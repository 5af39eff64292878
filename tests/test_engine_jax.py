"""The engine on JAX (`keras_tpu_mem.engine`, its step from `backends/jax/trainer.py`):
registration, loss terms, the multi-step loop, first-batch observation, random
state under shard_map."""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest
from helpers import (
    RecordingDense,
    compiled_function_names,
    compiled_text,
    make_distribution,
    max_abs_diff,
    mesh_mlp,
    scope,
    sparse_ce,
    toy_data,
)

from keras_tpu_mem.accumulation import GradientAccumulation
from keras_tpu_mem.backends.jax.trainer import Step
from keras_tpu_mem.backends.mesh import data_parallel_size
from keras_tpu_mem.engine import Engine, EngineCallback, observe_first_batch, update_variable

L2 = 0.1


class KernelPenalty(EngineCallback):
    """A loss term through `transform_loss`: L2 * sum(kernel**2) of the first layer."""

    name = "kernel_penalty"

    def transform_loss(self, loss, ctx):
        kernel = ctx.model.layers[0].kernel
        return loss + L2 * keras.ops.sum(keras.ops.square(kernel))


class NoHooks(EngineCallback):
    """A feature that declares nothing: every feature runs on both backends."""

    name = "no_hooks"


class AfterUpdate(EngineCallback):
    name = "after"

    def after_update(self, ctx):
        pass


def _compiled(model, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=sparse_ce(),
                  metrics=["accuracy"], **kwargs)
    return model


@pytest.mark.parametrize("case", ["none", "dp8", "mp2x4"])
def test_engine_builds_the_jax_step_and_counts_data_parallel_shards(case):
    distribution = make_distribution(case)
    with scope(distribution):
        model = _compiled(mesh_mlp())
        step = Engine.attach(model).backend_step
        assert isinstance(step, Step)
        assert step.num_replicas() == {"none": 1, "dp8": 8, "mp2x4": 2}[case]
        assert data_parallel_size() == step.num_replicas()
        assert step.distribution_key() is distribution


@pytest.mark.parametrize("case,accumulate", [("none", False), ("dp8", False), ("dp8", True),
                                             ("mp2x4", True)])
def test_loss_term_equals_the_same_term_as_a_keras_regularizer(case, accumulate):
    # Independent reference: Keras' own step with kernel_regularizer=L2(0.1) on
    # the first layer adds exactly 0.1 * sum(kernel**2) to the loss. The term
    # reads the kernel, a Keras variable: it must see the step's traced value.
    x, y = toy_data(classes=8)
    distribution = make_distribution(case)
    with scope(distribution):
        reference = _compiled(mesh_mlp(kernel_regularizer=keras.regularizers.L2(L2)))
        reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        ours = _compiled(mesh_mlp())
        callbacks = [KernelPenalty()] + ([GradientAccumulation(4)] if accumulate else [])
        history = ours.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                           callbacks=callbacks)
    assert max_abs_diff(reference.get_weights(), ours.get_weights()) <= 1e-5
    assert np.isfinite(history.history["loss"][0])


def test_every_feature_runs_on_jax():
    # Features no longer name their backends: one that declares nothing joins
    # the JAX step like any other (the step is the engine's, not Keras' own).
    model = _compiled(mesh_mlp())
    history = model.fit(*toy_data(32, classes=8), batch_size=32, epochs=1, verbose=0,
                        callbacks=[NoHooks()])
    assert np.isfinite(history.history["loss"][0])
    assert Engine.attach(model).num_builds == 1


class HalveFirstKernel(EngineCallback):
    """An after-update hook that assigns: functional on JAX (a StatelessScope in the step)."""

    name = "halve"

    def after_update(self, ctx):
        kernel = ctx.model.layers[0].kernel
        kernel.assign(kernel * 0.5)


@pytest.mark.parametrize("distribution_name", [None, "dp8"])
def test_after_update_hook_assignments_become_the_new_state(distribution_name):
    x, y = toy_data(64, classes=8)
    distribution = make_distribution(distribution_name) if distribution_name else None

    def fit(callbacks):
        with scope(distribution):
            model = _compiled(mesh_mlp(), steps_per_execution=2)
            model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks)
        return model

    hooked = fit([HalveFirstKernel()])
    assert int(hooked.optimizer.iterations.numpy()) == 2
    # Reference: the same two updates by hand, each followed by halving the kernel.
    with scope(distribution):
        reference = _compiled(mesh_mlp())
    for start in (0, 32):
        reference.train_on_batch(x[start:start + 32], y[start:start + 32])
        kernel = reference.layers[0].kernel
        kernel.assign(kernel.numpy() * 0.5)
    assert max_abs_diff(hooked.get_weights(), reference.get_weights()) <= 1e-6


class HalveWithUpdateVariable(EngineCallback):
    """The same hook through `update_variable`, the engine's portable assignment."""

    name = "halve"

    def after_update(self, ctx):
        update_variable(ctx.model.layers[0].kernel, lambda v: v.assign(v * 0.5))


def test_update_variable_assigns_in_the_jax_step_as_a_direct_assign():
    x, y = toy_data(64, classes=8)
    models = []
    for hook in (HalveFirstKernel(), HalveWithUpdateVariable()):
        model = _compiled(mesh_mlp(), steps_per_execution=2)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[hook])
        models.append(model)
    assert max_abs_diff(models[0].get_weights(), models[1].get_weights()) <= 1e-6


class _Observe(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.sizes = []

    def on_train_begin(self, logs=None):
        observe_first_batch(self.model, self.sizes.append)


@pytest.mark.parametrize("features", [False, True])
def test_observing_the_first_batch_consumes_no_batch(features):
    # Reading the first batch's size takes it from fit's iterator; the step
    # must still train on it: same weights and update count as without.
    x, y = toy_data(classes=8)
    distribution = make_distribution("dp8")
    extra = [GradientAccumulation(4)] if features else []
    with distribution.scope():
        reference = _compiled(mesh_mlp(), steps_per_execution=2)
        reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                      callbacks=list(extra))
        extra = [GradientAccumulation(4)] if features else []
        observer = _Observe()
        model = _compiled(mesh_mlp(), steps_per_execution=2)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                  callbacks=[observer, *extra])
    assert observer.sizes == [32]
    assert int(model.optimizer.iterations) == 5
    assert max_abs_diff(reference.get_weights(), model.get_weights()) == 0.0


def test_no_batch_is_lost_when_reading_the_first_batch_size_fails(monkeypatch):
    # The size is read after the first batch is taken from fit's iterator: when
    # reading it raises, the batch still reaches the step (the size is unknown).
    # Keras' own step (no feature): the engine's reads batch dimensions too.
    from keras_tpu_mem.backends.jax import trainer

    def unreadable(structure):
        raise RuntimeError("cannot read the batch dimension")

    monkeypatch.setattr(trainer, "_leading_dim", unreadable)
    x, y = toy_data(classes=8)
    observer = _Observe()
    model = _compiled(mesh_mlp())
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[observer])
    assert observer.sizes == [None]
    assert int(model.optimizer.iterations) == 5


class _FirstBatchFails(keras.utils.PyDataset):
    def __len__(self):
        return 3

    def __getitem__(self, index):
        if index == 0:
            raise ValueError("batch 0 cannot be read")
        x, y = toy_data(32, classes=8)
        return x, y


def test_an_error_of_the_first_batch_is_raised_not_swallowed_by_the_observer():
    # The observer's peek takes the first batch: an error of the data itself must
    # come out of fit as it would without the observer, with no step run.
    model = _compiled(mesh_mlp())
    with pytest.raises(ValueError, match="batch 0 cannot be read"):
        model.fit(_FirstBatchFails(), epochs=1, shuffle=False, verbose=0,
                  callbacks=[_Observe()])
    assert int(model.optimizer.iterations) == 0


def test_last_call_of_an_epoch_runs_the_remainder():
    # steps_per_epoch=9 with steps_per_execution=4 on endless data: 4 + 4 + 1
    # updates per epoch (Keras' own JAX loop would run 12).
    x, y = toy_data(32, classes=8)

    def endless():
        for _ in itertools.count():
            yield x, y

    model = _compiled(mesh_mlp(), steps_per_execution=4)
    model.fit(endless(), steps_per_epoch=9, epochs=2, verbose=0,
              callbacks=[GradientAccumulation(4)])
    assert int(model.optimizer.iterations) == 18


def test_run_eagerly_matches_the_jitted_step():
    x, y = toy_data(classes=8)
    jitted = _compiled(mesh_mlp())
    jitted.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
               callbacks=[GradientAccumulation(4)])
    eager = _compiled(mesh_mlp(), run_eagerly=True)
    eager.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
              callbacks=[GradientAccumulation(4)])
    assert eager.train_function.jitted_step is None
    assert jitted.train_function.jitted_step is not None
    assert max_abs_diff(jitted.get_weights(), eager.get_weights()) <= 1e-6


def _dropout_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dropout(0.5, seed=7), keras.layers.Dense(8)])


def _seed_state(model):
    return np.asarray(model.layers[1].seed_generator.state.value)


def test_dropout_seed_state_under_shard_map_advances_as_without_distribution():
    # Inside shard_map every device offsets its dropout seed (so devices draw
    # different masks); the state handed back must be the plain counter, the
    # same as without any distribution: 5 updates x 4 micro-batches draws.
    x, y = toy_data(classes=8)
    states = {}
    for case in ("none", "dp8"):
        with scope(make_distribution(case)):
            model = _compiled(_dropout_model())
            start = _seed_state(model).copy()
            history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                                callbacks=[GradientAccumulation(4)])
            states[case] = _seed_state(model)
            assert np.isfinite(history.history["loss"][0])
    np.testing.assert_array_equal(states["none"], states["dp8"])
    assert int(states["dp8"][1]) - int(start[1]) == 5 * 4
    assert int(states["dp8"][0]) == int(start[0])


def test_jitted_step_keeps_its_features_after_fit():
    # `model.train_function.jitted_step.lower(...)` after fit must lower the
    # step that ran (with micro-batching), not a step without features.
    x, y = toy_data(32, classes=8)
    model = _compiled(mesh_mlp())
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[GradientAccumulation(4)])
    RecordingDense.seen.clear()
    # A new batch size, so that JAX traces the step again (64 / 4 = 16).
    compiled_text(model, (np.concatenate([x, x]), np.concatenate([y, y])))
    assert {batch for batch, _ in RecordingDense.seen} == {16}


def _features(name):
    from keras_tpu_mem.distillation import Distillation
    from keras_tpu_mem.precision import MixedBFloat16
    from keras_tpu_mem.pruning import ConstantSparsity, Pruning

    if name == "pruning":
        return [Pruning(ConstantSparsity(0.5, begin_step=0, frequency=2))]
    if name == "accumulation":
        return [GradientAccumulation(4)]
    if name == "bf16":
        return [MixedBFloat16()]
    return [Distillation(mesh_mlp(seed=5, recording=False))]


@pytest.mark.parametrize("case", ["none", "dp8"])
@pytest.mark.parametrize("features", ["pruning", "accumulation", "bf16", "distillation"])
def test_a_second_fit_compiles_the_step_no_second_time(case, features):
    """The step compiles once for all fits of the same shapes, as Keras' own does
    (with pruning: two steps, the one that may recompute the masks and the quiet one,
    `Feature.quiet_update`, each once).

    (A pruning mask placed on a device, committed, while Keras' state is not
    made every output of the step committed, and the next fit compiled the
    same step again for committed arguments: a second compile per notebook.)
    """
    x, y = toy_data(64, classes=8)
    distribution = make_distribution(case)
    with scope(distribution):
        model = _compiled(mesh_mlp(recording=False))
        callbacks = _features(features)
        with compiled_function_names() as names:
            for _ in range(3):
                model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
    assert names.count("_step") == (2 if features == "pruning" else 1), names


class ReadsModelWhileTraced(EngineCallback):
    """A loss term that reads `self.model` (a Keras callback property that, on JAX,
    syncs the training state into the variables) inside the traced step."""

    name = "reads_model"

    def transform_loss(self, loss, ctx):
        assert self.model is ctx.model
        return loss


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_feature_reading_its_model_while_traced_loses_no_update(accumulate):
    # With run_eagerly the step is traced on every call: each trace syncs the
    # state. Reference: Keras' own eager fit.
    x, y = toy_data(classes=8)
    reference = _compiled(mesh_mlp(), run_eagerly=True)
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model = _compiled(mesh_mlp(), run_eagerly=True)
    callbacks = [ReadsModelWhileTraced()] + ([GradientAccumulation(4)] if accumulate else [])
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    assert int(model.optimizer.iterations) == 5
    assert max_abs_diff(reference.get_weights(), model.get_weights()) <= 1e-5


def test_frozen_and_batch_norm_state_under_shard_map():
    # A frozen layer's weights (non-trainable, never written) come back bit for
    # bit; BatchNormalization's moving statistics (written on every device)
    # are combined into one finite replicated value that moved.
    x, y = toy_data(classes=8)
    keras.utils.set_random_seed(4)
    with make_distribution("dp8").scope():
        frozen = keras.layers.Dense(32, name="frozen")
        model = keras.Sequential([keras.Input((16,)), frozen,
                                  keras.layers.BatchNormalization(),
                                  keras.layers.Dense(8)])
        frozen.trainable = False
        _compiled(model)
        kernel = np.asarray(frozen.kernel.value).copy()
        moving_mean = np.asarray(model.layers[1].moving_mean.value).copy()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0,
                  callbacks=[GradientAccumulation(2)])
    np.testing.assert_array_equal(np.asarray(frozen.kernel.value), kernel)
    after = np.asarray(model.layers[1].moving_mean.value)
    assert np.all(np.isfinite(after)) and not np.allclose(after, moving_mean)


class FailsInStep(EngineCallback):
    """A loss term whose trace raises: a step that fails before it ever runs."""

    name = "fails_in_step"

    def transform_loss(self, loss, ctx):
        raise RuntimeError("injected step failure")


@pytest.mark.parametrize("case", ["none", "dp8"])
def test_a_failed_step_ends_the_fit_and_takes_its_features_off(case):
    """Keras never calls on_train_end after a step's error: the engine takes the fit's
    features off itself, so the model plans and fits again right away, with its weights
    (not the emptied variables of an interrupted JAX fit)."""
    from keras_tpu_mem import compiled_memory

    x, y = toy_data(64, classes=8)
    distribution = make_distribution(case)
    with scope(distribution):
        model = _compiled(mesh_mlp(recording=False))
        with pytest.raises(RuntimeError, match="injected step failure"):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                      callbacks=[GradientAccumulation(4), FailsInStep()])
        assert Engine.attach(model).features == []
        # Before: "The model is inside a fit with keras_tpu_mem features".
        planned = compiled_memory(model, 32, callbacks=[GradientAccumulation(2)],
                                  hlo_text=False)
        assert planned.micro_batches == 2
        # The next fit is Keras' own step: the weights of a twin that never failed.
        twin = _compiled(mesh_mlp(recording=False))
        for m in (model, twin):
            m.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    assert max_abs_diff(model.get_weights(), twin.get_weights()) <= 1e-6
    assert int(np.asarray(model.optimizer.iterations.value)) == 4


@pytest.mark.parametrize("case", ["none", "dp8"])
def test_the_engines_step_adds_no_copy_to_keras_own(case):
    """Issue 29's floor: the engine's step with no feature (its loop form, its carry of
    feature state, its reducer) compiles to exactly as many `copy` instructions as
    Keras' own `train_step` for the same state and batch, jitted alike (XLA:CPU's
    optimised HLO; one device and `DataParallel(8)`)."""
    import re

    import jax

    from keras_tpu_mem._compat import jax as jax_compat

    copy = re.compile(r"= \S+ copy\(")
    distribution = make_distribution(case)
    with scope(distribution):
        model = mesh_mlp(recording=False)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=sparse_ce(),
                      metrics=["accuracy"])
        x, y = toy_data(64, 16, 8)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        state = jax_compat.jax_state(model)
        data = jax_compat.distribute_data((x[:32], y[:32]))
        counts = {}
        for name, step in (("keras", model.train_step),
                           ("engine", Engine.attach(model).backend_step.make_step(jit=False))):
            text = jax.jit(step, donate_argnums=0).lower(state, data).compile().as_text()
            counts[name] = len(copy.findall(text))
    assert counts["engine"] == counts["keras"] > 0, counts
