"""ShardedDataParallel on 8 host devices: layouts, exactness against DataParallel,
where the state lies after a fit, per-device compiled state, save/load, BackupAndRestore."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import (
    compile_adam,
    fit_under,
    issue_mlp,
    max_weight_diff,
    small_model,
    state_bytes,
    toy_data,
)

from keras_tpu_mem.accumulation import GradientAccumulation
from keras_tpu_mem.engine.core import Engine
from keras_tpu_mem.planning.compiled import compiled_memory
from keras_tpu_mem.sharding import ShardedDataParallel, sharded_dim


@pytest.fixture(scope="module")
def reference():
    """Plain DataParallel: initial weights and the weights after 5 Adam updates."""
    init = small_model().get_weights()
    return init, fit_under(keras.distribution.DataParallel(), init=init)


def _slots(model):
    return [v for v in model.optimizer.variables if len(v.shape)]


def _replicated_ok(variable):
    return variable.path.endswith("dense_out/bias") or variable.name.startswith(
        "sequential") and "dense_out_bias" in variable.name


# ------------------------------------------------------------------ layouts
def test_layouts_follow_the_rule_and_the_axis():
    distribution = ShardedDataParallel()
    assert (distribution.shard, distribution.axis_name, distribution.min_shard_bytes,
            distribution.axis_size) == ("all", "batch", 0, 8)
    assert repr(distribution) == ("ShardedDataParallel(shard='all', axis_name='batch', "
                                  "min_shard_bytes=0, mesh=(8,) ('batch',))")
    assert isinstance(distribution, keras.distribution.ModelParallel)
    # Devices, not the names `list_devices()` gives (the monitors read them).
    import jax

    assert list(distribution.device_mesh.devices.flat) == jax.devices()
    with distribution.scope():
        model = small_model()
    specs = {v.path.split("/", 1)[1]: tuple(v.value.sharding.spec) for v in model.weights}
    assert specs == {"dense_in/kernel": (None, "batch"), "dense_in/bias": ("batch",),
                     "dense_mid/kernel": ("batch", None), "dense_mid/bias": ("batch",),
                     "dense_out/kernel": ("batch", None), "dense_out/bias": (None,)}
    assert distribution.get_data_layout((32, 16)).axes == ("batch", None)
    # The layout says the same as the value (what a traced step asks, without values).
    for variable in model.weights:
        assert (sharded_dim(variable, distribution=distribution)
                == sharded_dim(variable)), variable.path
    assert sharded_dim(model.layers[0].kernel, "model") is None


def test_min_shard_bytes_keeps_small_variables_replicated():
    distribution = ShardedDataParallel(min_shard_bytes=1024)
    with distribution.scope():
        model = small_model()
    # Kernels of 4096 / 8192 / 1280 bytes split; biases (256, 128 bytes) stay whole.
    assert [sharded_dim(v) for v in model.weights] == [1, None, 0, None, 0, None]


def test_shard_none_is_data_parallel():
    distribution = ShardedDataParallel(shard=None)
    with distribution.scope():
        model = compile_adam(small_model())
        model.optimizer.build(model.trainable_variables)
    assert all(sharded_dim(v) is None for v in [*model.weights, *model.optimizer.variables])


def test_set_distribution_works_like_the_scope():
    distribution = ShardedDataParallel(shard="optimizer")
    keras.distribution.set_distribution(distribution)
    try:
        model = compile_adam(small_model())
        model.optimizer.build(model.trainable_variables)
    finally:
        keras.distribution.set_distribution(None)
    assert all(sharded_dim(v) is None for v in model.weights)
    assert [sharded_dim(v) for v in _slots(model)] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, None, None]


def test_replicated_variables_are_logged_once(ktm_records):
    distribution = ShardedDataParallel()
    fit_under(distribution, epochs=2)
    lines = [r.getMessage() for r in ktm_records if "stay replicated" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "dense_out/bias (10,)" in lines[0] and "no dimension that 8 divides" in lines[0]
    assert "dense_in" not in lines[0]


def test_argument_errors_name_the_argument():
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"),
                                         keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    cases = [
        (dict(shard="zero3"), ValueError, r'`shard` must be "all", "optimizer" or None'),
        (dict(min_shard_bytes=-1), ValueError, "`min_shard_bytes` must be an int >= 0"),
        (dict(min_shard_bytes="1k"), TypeError, "`min_shard_bytes` must be an int >= 0"),
        (dict(axis_name=""), TypeError, "`axis_name` must be a non-empty string"),
        (dict(layout_map={"a": 1}), TypeError, "`layout_map` must be a keras.distribution"),
        (dict(layout_map=layout_map, axis_name="data"), ValueError,
         r"`axis_name`='data' must name an axis of `layout_map`'s mesh, whose axes are "
         r"\('batch', 'model'\)"),
        (dict(layout_map=layout_map, devices=keras.distribution.list_devices()), ValueError,
         "Pass `devices` or `layout_map`, not both"),
        (dict(devices=[]), ValueError, "`devices` must list at least one device"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            ShardedDataParallel(**kwargs)


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("shard", ["all", "optimizer"])
def test_fit_matches_data_parallel_and_state_stays_split(reference, shard):
    init, expected = reference
    model = fit_under(ShardedDataParallel(shard=shard), init=init)
    assert max_weight_diff(model, expected) <= 1e-5
    assert int(model.optimizer.iterations) == 5
    for variable in model.weights:
        dim = sharded_dim(variable)
        if shard == "optimizer" or variable.path.endswith("dense_out/bias"):
            assert dim is None, variable.path
        else:
            assert dim is not None, variable.path
    for slot in _slots(model):
        assert (sharded_dim(slot) is None) == ("dense_out_bias" in slot.name), slot.path
        assert slot.value.sharding.mesh.shape == {"batch": 8}


def test_a_plain_fit_in_the_scope_runs_the_engines_sharded_step(reference):
    """No callback and no reshard: the optimizer's build under the distribution hands
    the model to the engine, whose step gathers weights and reduce-scatters their
    gradients (Keras' own step all-reduces whole gradients)."""
    init, expected = reference
    model = fit_under(ShardedDataParallel(), init=init)
    engine = Engine.attach(model)
    assert engine.num_builds >= 1 and max_weight_diff(model, expected) <= 1e-5
    state = tuple([v.value for v in group] for group in (
        model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
        model.metrics_variables))
    with ShardedDataParallel().scope():
        batch = toy_data(32, classes=10)
        hlo = engine.backend_step.jitted_step.lower(state, batch).compile().as_text()
    assert hlo.count(" reduce-scatter(") >= len(model.trainable_variables) - 1


def test_steps_per_execution_matches_data_parallel(reference):
    init, expected = reference
    model = fit_under(ShardedDataParallel(), init=init, steps_per_execution=4)
    assert max_weight_diff(model, expected) <= 1e-5
    assert sharded_dim(model.layers[0].kernel) == 1


def test_layout_map_on_a_2x4_mesh_matches_data_parallel(reference):
    init, expected = reference
    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"),
                                         keras.distribution.list_devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense_in/kernel"] = (None, "model")
    layout_map[".*dense_in/bias"] = ("model",)
    # keras-hub's layout maps (e.g. GemmaBackbone.get_layout_map) name both axes.
    layout_map[".*dense_mid/kernel"] = ("model", "batch")
    model = fit_under(ShardedDataParallel(layout_map=layout_map), init=init)
    assert max_weight_diff(model, expected) <= 1e-5
    kernel, bias = model.layers[0].kernel, model.layers[0].bias
    # The user's rule kept, its free dimension split over the data axis as well.
    assert tuple(kernel.value.sharding.spec) == ("batch", "model")
    assert tuple(bias.value.sharding.spec) == ("model",)   # 64 / 4 = 16 rows: 2 divides, but
    # the rule's one dimension is taken by the user; nothing left to split.
    # A rule that already names the data axis is kept as it is.
    assert tuple(model.layers[1].kernel.value.sharding.spec) == ("model", "batch")
    # Variables no rule matches follow the rule alone, over the data axis (2 devices).
    assert tuple(model.layers[2].kernel.value.sharding.spec) == ("batch", None)
    assert tuple(model.layers[2].bias.value.sharding.spec) == ("batch",)
    momentum = [s for s in _slots(model) if "dense_in_kernel" in s.name][0]
    assert tuple(momentum.value.sharding.spec) == ("batch", "model")


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["all", "optimizer"])
def test_gradient_accumulation_matches_data_parallel(reference, shard):
    init, expected = reference
    model = fit_under(ShardedDataParallel(shard=shard), init=init,
                callbacks=[GradientAccumulation(4)])
    assert max_weight_diff(model, expected) <= 1e-5
    assert all(sharded_dim(s) is not None for s in _slots(model)
               if "dense_out_bias" not in s.name)


# ------------------------------------------------------------ compiled state
@pytest.mark.slow
def test_per_device_compiled_state_of_the_issue_mlp():
    def state(distribution):
        with distribution.scope():
            model = compile_adam(issue_mlp(), 1e-3)
            return state_bytes(compiled_memory(model, 1024, hlo_text=False))

    replicated = state(keras.distribution.DataParallel())
    full = state(ShardedDataParallel())
    optimizer = state(ShardedDataParallel(shard="optimizer"))
    assert full <= 0.15 * replicated, (full, replicated)
    assert optimizer <= 0.45 * replicated, (optimizer, replicated)


# ------------------------------------------------------- saving and resuming
def test_save_and_load_in_the_scope_lays_out_the_loaded_state(tmp_path):
    distribution = ShardedDataParallel()
    model = fit_under(distribution)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with distribution.scope():
        loaded = keras.models.load_model(path)
    assert max_weight_diff(model, loaded) == 0.0
    assert [sharded_dim(v) for v in loaded.weights] == [sharded_dim(v) for v in model.weights]
    slots = _slots(loaded)
    assert slots and all(sharded_dim(s) is not None for s in slots
                         if "dense_out_bias" not in s.name)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x, y = toy_data(classes=10)
    with distribution.scope():
        loaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert sharded_dim(loaded.layers[0].kernel) == 1


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == 1 and batch == 2:
            raise RuntimeError("interrupted")


def test_backup_and_restore_resumes_exactly(tmp_path):
    init = small_model().get_weights()
    straight = fit_under(ShardedDataParallel(), init=init, epochs=3)
    backup = str(tmp_path / "backup")
    distribution = ShardedDataParallel()
    with pytest.raises(RuntimeError, match="interrupted"):
        fit_under(distribution, init=init, epochs=3,
            callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt()])
    resumed = fit_under(distribution, init=init, epochs=3,
                  callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert int(resumed.optimizer.iterations) == 15
    assert max_weight_diff(resumed, straight) <= 1e-6
    assert sharded_dim(resumed.layers[0].kernel) == 1
    assert all(sharded_dim(s) is not None for s in _slots(resumed)
               if "dense_out_bias" not in s.name)
