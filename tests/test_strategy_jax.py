"""TPUStrategyWrapper on the JAX backend, over the harness's 8 host CPU devices."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_tpu_mem as ktm
from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.array_batches import ArrayBatches
from keras_tpu_mem.strategy import TPUStrategyWrapper


def test_backends_initialized_by_name():
    import jax

    jax.devices()
    assert jax_compat.backends_initialized() is True


def test_data_parallel_over_every_host_device(ktm_records):
    tpu = ktm.TPUStrategyWrapper(logical_cpus=8)
    # One class on both backends; the JAX behaviour comes from its strategy concern.
    assert type(tpu) is TPUStrategyWrapper and TPUStrategyWrapper is ktm.TPUStrategyWrapper
    assert repr(tpu) == "TPUStrategyWrapper(backend='jax', kind='CPU', device='CPU', replicas=8)"
    assert isinstance(tpu.distribution, keras.distribution.DataParallel)
    assert tpu.kind == "CPU" and tpu.num_replicas == 8
    assert tpu.global_batch_size(4) == 32 and tpu.per_replica_batch_size(32) == 4
    with pytest.raises(ValueError, match="does not split evenly over 8 replicas"):
        tpu.per_replica_batch_size(30)
    assert any("DataParallel over 8 device(s)" in r.getMessage() for r in ktm_records)
    assert "replicas:  8" in tpu.describe()


def test_one_host_device_without_logical_cpus():
    tpu = ktm.TPUStrategyWrapper()
    assert tpu.num_replicas == 1 and "one host device" in tpu.reason


def test_logical_cpus_that_jax_cannot_give_raise():
    with pytest.raises(RuntimeError, match="logical_cpus=4, but JAX already runs with 8"):
        ktm.TPUStrategyWrapper(logical_cpus=4)


def test_tpu_names_are_tensorflow_only():
    with pytest.raises(ValueError, match="JAX uses the chips of the TPU VM"):
        ktm.TPUStrategyWrapper("grpc://10.0.0.2:8470")


def test_model_parallel_from_a_layout_map():
    import jax

    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    tpu = ktm.TPUStrategyWrapper(logical_cpus=8, layout_map=layout_map)
    assert isinstance(tpu.distribution, keras.distribution.ModelParallel)
    assert tpu.num_replicas == 2      # the batch axis of the (2, 4) mesh
    with tpu.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense")])
    kernel = model.layers[0].kernel.value
    assert kernel.sharding.shard_shape(kernel.shape) == (8, 4)
    regrid = ktm.TPUStrategyWrapper(logical_cpus=8, layout_map=layout_map, mesh_shape=(4, 2))
    assert regrid.num_replicas == 4
    with pytest.raises(ValueError, match="batch \\* model = 8 devices"):
        ktm.TPUStrategyWrapper(logical_cpus=8, layout_map=layout_map, mesh_shape=(3, 2))
    with pytest.raises(ValueError, match="needs a `layout_map`"):
        ktm.TPUStrategyWrapper(logical_cpus=8, mesh_shape=(4, 2))


def test_distribute_arrays_gives_static_global_batches_that_fit_trains(digits):
    (x, y), _ = digits
    tpu = ktm.TPUStrategyWrapper(logical_cpus=8)
    batches = tpu.distribute((x, y), global_batch_size=64)
    assert len(batches) == len(x) // 64
    first_x, first_y = batches[0]
    np.testing.assert_array_equal(first_x, x[:64])
    np.testing.assert_array_equal(batches[len(batches) - 1][1], y[(len(x) // 64 - 1) * 64:
                                                                  len(x) // 64 * 64])
    with tpu.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
    history = model.fit(batches, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    with pytest.raises(ValueError, match="does not split evenly"):
        tpu.distribute((x, y), global_batch_size=60)


def test_array_batches_share_each_global_batch_between_processes():
    x = np.arange(40)
    zero = ArrayBatches(x, 8, process_index=0, process_count=2)
    one = ArrayBatches(x, 8, process_index=1, process_count=2)
    assert len(zero) == 5
    np.testing.assert_array_equal(zero[1], [8, 9, 10, 11])
    np.testing.assert_array_equal(one[1], [12, 13, 14, 15])
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ArrayBatches(x[:5], 8)
    assert len(ArrayBatches(x[:20], 8, drop_remainder=False)) == 3


def test_memory_info_falls_back_to_host_rss_on_cpu_devices():
    tpu = ktm.TPUStrategyWrapper(logical_cpus=8)
    readings = tpu.memory_info()
    assert len(readings) == 8
    assert all(r.source == "host_rss" and r.process_wide and r.current_bytes > 0
               for r in readings)
    assert tpu.hbm_bytes_per_replica is None    # no capacity known for host devices


@pytest.mark.parametrize("sharding", ["all", "optimizer"])
def test_sharding_builds_a_sharded_data_parallel(sharding):
    from keras_tpu_mem.sharding import ShardedDataParallel, sharded_dim

    tpu = TPUStrategyWrapper(logical_cpus=8, sharding=sharding)
    assert isinstance(tpu.distribution, ShardedDataParallel)
    assert tpu.distribution.shard == sharding and tpu.num_replicas == 8
    assert repr(tpu) == (f"TPUStrategyWrapper(backend='jax', sharding={sharding!r}, "
                         "kind='CPU', device='CPU', replicas=8)")
    assert "split over the 8 data-parallel devices: each holds 1/8" in tpu.describe()
    with tpu.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256),
                                  keras.layers.Dense(16)])
        model.compile(optimizer="adam", loss="mse")
        model.optimizer.build(model.trainable_variables)
    assert (sharded_dim(model.layers[0].kernel) == 1) == (sharding == "all")
    line = [ln for ln in tpu.describe(model).splitlines() if "model state per device" in ln][0]
    # Every variable splits over 8: 1/8 of the whole (the Adam scalars are a rounding
    # error); with "optimizer" the weights stay whole: (1 + 2/8) / 3 of it.
    share = float(line.split("(")[-1].split("x;")[0])
    assert share == pytest.approx(0.125 if sharding == "all" else 1.25 / 3, abs=0.01), line


def test_sharding_with_a_layout_map_keeps_the_mesh():
    import jax

    from keras_tpu_mem.sharding import ShardedDataParallel

    mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    tpu = TPUStrategyWrapper(logical_cpus=8, layout_map=layout_map, sharding="all")
    assert isinstance(tpu.distribution, ShardedDataParallel) and tpu.num_replicas == 2
    with tpu.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense")])
    assert tuple(model.layers[0].kernel.value.sharding.spec) == ("batch", "model")


def test_sharding_values_are_checked():
    with pytest.raises(ValueError, match=r'`sharding` must be "all", "optimizer" or None'):
        TPUStrategyWrapper(logical_cpus=8, sharding=True)
