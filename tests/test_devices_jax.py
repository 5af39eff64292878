"""`keras_tpu_mem.devices` on the JAX backend: `jax.Device`s and their readers.

The harness gives 8 host CPU devices, which keep no memory statistics
(`jax.Device.memory_stats()` is None): their source is the host RSS.
"""

from __future__ import annotations

import jax
import monitoring_cases as cases
from helpers import make_distribution

from keras_tpu_mem import devices


def test_jax_readers_by_name():
    (first,) = devices.replica_devices()
    assert first == jax.local_devices()[0]
    assert devices.device_name(first) == "CPU:0"
    assert devices.memory_stats(first) is None  # JAX's CPU devices keep none
    assert devices.read_memory(first) is None and devices.reset_peak(first) is False
    assert devices.is_host_device(first) and devices.memory_source(first) == "host_rss"
    mp = make_distribution("mp2x4")
    assert [devices.device_name(d) for d in devices.replica_devices(mp)] == \
        cases.mesh_names(mp)
    reading = devices.read_memory_reading(first)
    assert reading.source == "host_rss" and reading.process_wide and reading.current_bytes > 0
    # The names these readers had before `keras_tpu_mem.devices` served both backends.
    assert devices.monitored_jax_devices is devices.replica_devices
    assert devices.jax_device_name is devices.device_name
    assert devices.jax_memory_stats is devices.memory_stats
    assert devices.jax_capacity is devices.capacity


def test_replica_devices_of_a_mesh_built_from_device_names():
    """`DataParallel()` lays its mesh over `list_devices()`'s names ("cpu:0"): the
    readers still get the devices."""
    import keras

    from keras_tpu_mem.backends.jax.devices import replica_devices

    distribution = keras.distribution.DataParallel()
    assert isinstance(distribution.device_mesh.devices.flat[0], str)
    assert replica_devices(distribution) == sorted(jax.devices(), key=lambda d: d.id)
