"""The engine's sharded step (`backends/jax/reducers.py`, `ShardedShardMap`) against DataParallel.

A test-local `ModelParallel` subclass (`sharding_step_models.Sharded`) lays the
state out over the batch axis; the engine finds that from the values'
shardings. Every fit here is compared with a plain
`keras.distribution.DataParallel` fit from the same weights (float32, Adam,
5 updates of a global batch of 32).
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from sharding_step_models import (
    Sharded,
    ShardedOverLayoutMap,
    data,
    lay_out_optimizer,
    small_mlp,
)

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.accumulation import GradientAccumulation
from keras_tpu_mem.backends.jax.layout import model_state_layout, state_layout
from keras_tpu_mem.engine.core import Engine, engage

TOL = 1e-5


def _fit(distribution, mode=None, callbacks=(), batch_size=32, n=160, spe=1, engaged=False,
         optimizer=None):
    x, y = data(n)
    with distribution.scope():
        model = small_mlp()
        model.compile(optimizer=optimizer() if optimizer else keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=spe)
        if mode == "optimizer":
            lay_out_optimizer(model, distribution)
        if engaged:
            engage(model)
        history = model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False,
                            callbacks=list(callbacks))
    return model, history.history


@pytest.fixture(scope="module")
def reference():
    """A plain DataParallel fit: 5 updates of 32."""
    model, history = _fit(keras.distribution.DataParallel(devices=jax.devices()))
    return [np.asarray(v.value) for v in model.trainable_variables], history


def _check(model, history, reference, sharded_weights=True):
    weights, ref_history = reference
    for variable, expected in zip(model.trainable_variables, weights):
        np.testing.assert_allclose(np.asarray(variable.value), expected, atol=TOL, rtol=0)
    for name, values in ref_history.items():
        np.testing.assert_allclose(history[name], values, atol=TOL, rtol=0)
    # The state stays laid out as it was: split over the batch axis.
    kernel = model.trainable_variables[0]
    slots = [v for v in model.optimizer.variables if tuple(v.shape) == tuple(kernel.shape)]
    assert "batch" in tuple(slots[0].value.sharding.spec)
    assert ("batch" in tuple(kernel.value.sharding.spec)) == sharded_weights


@pytest.mark.parametrize("mode", ["all", "optimizer"])
@pytest.mark.parametrize("how", ["engaged", "ga4", "ga4_pulled", "spe4"])
def test_sharded_fit_matches_data_parallel(reference, mode, how):
    kwargs = {"engaged": how in ("engaged", "spe4")}
    if how == "ga4":
        kwargs["callbacks"] = [GradientAccumulation(4)]
    elif how == "ga4_pulled":
        # Keras' convention: the data yields micro-batches of 8, 4 make one update of 32.
        kwargs.update(callbacks=[GradientAccumulation(4, dataset_yields="micro_batches")],
                      batch_size=8)
    elif how == "spe4":
        kwargs["spe"] = 4
    model, history = _fit(Sharded(mode), mode=mode, **kwargs)
    assert Engine.attach(model).num_builds == 1  # the engine's step ran, not Keras'
    _check(model, history, reference, sharded_weights=mode == "all")


def test_micro_batches_take_their_rows_from_every_device():
    """16 rows over 2 devices (rows 0-7, 8-15) as 4 micro-batches: the j-th holds the
    j-th pair of each device's rows, as each device's own loop would take them."""
    from keras_tpu_mem.backends.jax.gradients import micro_batches

    rows = np.arange(32).reshape(16, 2)
    got = np.asarray(micro_batches(rows, 4, devices=2))
    want = np.stack([np.concatenate([rows[2 * j:2 * j + 2], rows[8 + 2 * j:8 + 2 * j + 2]])
                     for j in range(4)])
    np.testing.assert_array_equal(got, want)
    # One device: the rows split in order.
    np.testing.assert_array_equal(np.asarray(micro_batches(rows, 4)), rows.reshape(4, 4, 2))


@pytest.mark.parametrize("mode", ["all", "optimizer"])
@pytest.mark.parametrize("how", ["ga4", "ga4_pulled"])
def test_accumulation_left_to_the_partitioner_matches_data_parallel(reference, mode, how,
                                                                    monkeypatch):
    """On a TPU mesh (`layout.partitioner_shards_state`) accumulation under split state
    runs on the global arrays, left to XLA's partitioner: the micro-batch loop with each
    micro-batch over every device, or each pulled micro-batch as Keras' step takes it,
    into accumulators split like the gradients. Forced here on the 8 host devices: the
    weights and logs of a plain `DataParallel` fit (what XLA:TPU holds per chip:
    test_planning_target_jax.py)."""
    from keras_tpu_mem.backends.jax import gradients, reducers

    monkeypatch.setattr(reducers, "partitioner_shards_state", lambda distribution=None: True)
    calls = []
    loop, pulled = gradients.LocalGradients.micro_batch_loop, reducers.accumulate_global

    def recorded_loop(self, *args, **kwargs):
        calls.append(("loop", kwargs.get("devices", 1)))
        return loop(self, *args, **kwargs)

    def recorded_pulled(*args):
        calls.append(("pulled", None))
        return pulled(*args)

    monkeypatch.setattr(gradients.LocalGradients, "micro_batch_loop", recorded_loop)
    monkeypatch.setattr(reducers, "accumulate_global", recorded_pulled)
    if how == "ga4":
        kwargs = dict(callbacks=[GradientAccumulation(4)])
    else:  # Keras' convention: the data yields micro-batches of 8, 4 make one update of 32
        kwargs = dict(callbacks=[GradientAccumulation(4, dataset_yields="micro_batches")],
                      batch_size=8)
    model, history = _fit(Sharded(mode), mode=mode, **kwargs)
    # On the global arrays: the loop over the 8 devices' rows, or each pulled micro-batch.
    assert set(calls) == ({("loop", 8)} if how == "ga4" else {("pulled", None)})
    _check(model, history, reference, sharded_weights=mode == "all")


@pytest.mark.parametrize("steps", [1, 4])
def test_layout_map_on_a_2x4_mesh(reference, steps):
    """Kernels split over "model" by a LayoutMap, the rest over "batch" (automatic
    model axis inside the shard_map over the batch axis)."""
    callbacks = [GradientAccumulation(steps)] if steps > 1 else []
    model, history = _fit(ShardedOverLayoutMap(), engaged=True, callbacks=callbacks)
    assert Engine.attach(model).num_builds == 1
    assert tuple(model.trainable_variables[0].value.sharding.spec) == ("batch", "model")
    _check(model, history, reference)


def test_global_clipnorm_keeps_its_global_norm():
    """The optimizer runs on the global (sharded) arrays: its global norm is exact."""
    ref, ref_history = _fit(keras.distribution.DataParallel(devices=jax.devices()),
                            optimizer=lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.05))
    model, history = _fit(Sharded("all"), engaged=True,
                          optimizer=lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.05))
    _check(model, history, ([np.asarray(v.value) for v in ref.trainable_variables],
                            ref_history))


def test_without_engage_or_feature_keras_runs_its_own_step():
    model, _ = _fit(Sharded("all"))
    engine = model.__dict__.get(Engine._ATTR)
    assert engine is None or engine.num_builds == 0


def test_engaged_step_reduce_scatters_sharded_gradients():
    model, _ = _fit(Sharded("all"), engaged=True)
    step = Engine.attach(model).backend_step
    state = tuple([v.value for v in group] for group in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))
    x, y = data(32)
    with Sharded("all").scope():
        hlo = step.jitted_step.lower(state, (x, y)).compile().as_text()
    # Every weight of the small MLP splits over 8 devices: one gather and one
    # reduce-scatter each; the only all-reduce is the metrics' scalars.
    assert hlo.count(" reduce-scatter(") == len(model.trainable_variables)
    assert hlo.count(" all-gather(") == len(model.trainable_variables)
    assert hlo.count(" all-reduce(") == 1


def test_state_layout_reads_the_values_shardings():
    distribution = Sharded("all")
    with distribution.scope():
        model = small_mlp()
        model.optimizer.build(model.trainable_variables)
        layout = model_state_layout(model)
    assert layout.axis == "batch" and layout.shards == len(jax.devices())
    # Kernels (16, 32), (32, 32), (32, 8) and biases: the largest divisible
    # dimension (the first of equals).
    assert layout.weight_dims == [1, 0, 0, 0, 0, 0]
    assert layout.grad_dims == layout.weight_dims
    with keras.distribution.DataParallel(devices=jax.devices()).scope():
        replicated = small_mlp()
        replicated.optimizer.build(replicated.trainable_variables)
        assert model_state_layout(replicated) is None
        shardings = jax_compat.state_sharding_spec(replicated)
        assert state_layout(shardings) is None


def test_optimizer_only_layout_reduce_scatters_into_the_slots():
    distribution = Sharded("optimizer")
    with distribution.scope():
        model = small_mlp()
        lay_out_optimizer(model, distribution)
        layout = model_state_layout(model)
    assert layout.weight_dims == [None] * 6
    assert layout.grad_dims == [1, 0, 0, 0, 0, 0]


def test_engaged_model_gets_the_sharded_step_once_its_state_is_sharded():
    """Engaged with replicated state, `fit` runs Keras' step; after the slots are laid
    out over the batch axis (as a reshard does) the next `fit` builds the engine's."""
    distribution = Sharded("optimizer")
    x, y = data(64)
    with distribution.scope():
        model = small_mlp()
        engage(model)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        engine = Engine.attach(model)
        assert engine.num_builds == 0
        lay_out_optimizer(model, distribution)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        assert engine.num_builds == 1
        assert engine.backend_step.jitted_step is not None
