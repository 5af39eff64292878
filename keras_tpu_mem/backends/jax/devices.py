"""Devices and their memory on JAX: `jax.Device`s and their `memory_stats()`.

Contract: `keras_tpu_mem.backends.contracts.Devices`; a *device* here is a
`jax.Device` (anything with `platform`, `id` and `memory_stats`), and
`replica_devices(where)` takes a `keras.distribution.Distribution`.

TPU and GPU runtimes report `bytes_in_use`, `peak_bytes_in_use` and
`bytes_limit`; that peak is a high-water mark since the process started that
nothing can reset (`reset_peak` returns False). JAX's CPU devices keep no
statistics (`memory_stats()` is `None`). Nothing here imports TensorFlow.
"""

from __future__ import annotations

import jax
import keras
import numpy as np

from keras_tpu_mem._compat import jax as jax_compat


def allocator_reader() -> str:
    return "jax.Device.memory_stats()"


def peak_resettable() -> bool | None:
    """False: JAX exposes no reset of `peak_bytes_in_use`."""
    return False


def host_allocator_shared() -> bool:
    """False: each device has its own statistics where it keeps any; the host's memory
    stands in only for CPU devices that keep none."""
    return False


def host_rss_why() -> str:
    return "JAX's CPU devices keep no memory statistics (jax.Device.memory_stats() is None)"


def host_rss_fix() -> str:
    return "On a TPU or GPU the monitor reads each device's own memory_stats() instead."


def unreadable_why() -> str:
    return "jax.Device.memory_stats() returns nothing there"


#: `jax.Device.platform` -> the kind in a device's name ("TPU:0", "GPU:1", "CPU:0").
_PLATFORM_KIND = {"tpu": "TPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "cpu": "CPU"}


def replica_devices(where=None) -> list:
    """The `jax.Device`s a JAX training step runs on, in this process.

    The devices of `where` (a `keras.distribution`; default: the active one)
    that this process addresses, sorted by id; without a distribution, the
    first local device, where Keras' JAX trainer places everything.
    """
    distribution = keras.distribution.distribution() if where is None else where
    if distribution is None:
        return list(jax.local_devices()[:1])
    # The JAX mesh's devices: a Keras mesh built from `list_devices()` (as
    # `DataParallel()` builds it) holds device names ("cpu:0"), not devices.
    flat = list(np.asarray(jax_compat.backend_mesh(distribution.device_mesh).devices).flat)
    local = jax.process_index()
    return sorted((d for d in flat if getattr(d, "process_index", local) == local),
                  key=lambda d: d.id)


def model_devices(model) -> list:
    """The devices of the active distribution (JAX models carry none of their own)."""
    return replica_devices()


def platform(device) -> str:
    name = str(device.platform)
    return _PLATFORM_KIND.get(name, name.upper())


def device_name(device) -> str:
    """`"TPU:3"`, `"GPU:0"`, `"CPU:5"`: a `jax.Device`'s platform and (global) id."""
    return f"{platform(device)}:{device.id}"


def device_kinds(device) -> list[str]:
    return [getattr(device, "device_kind", None) or ""]


def reader_queries(device) -> tuple:
    return (device,)


def host_queries(devices) -> tuple:
    return (devices[0],)  # JAX's CPU devices keep no statistics: any one stands for all


def memory_stats(device) -> dict | None:
    try:
        stats = device.memory_stats()
    except Exception:  # a runtime without statistics may raise instead
        return None
    return dict(stats) if stats else None


def reset_peak(device) -> bool:
    return False


def gpu_capabilities(devices) -> list[tuple[str, str]]:
    """`(name, "major.minor")` of each GPU among `devices` whose compute capability
    JAX tells."""
    return sorted({(device.device_kind, str(capability)) for device in devices
                   for capability in [getattr(device, "compute_capability", None)]
                   if capability is not None})


def cpu_bfloat16_matmul(native: bool) -> str:
    """How this backend computes a bfloat16 matrix product on a CPU: every JAX
    computation goes through XLA, whose CPU backend computes it in float32, with or
    without bfloat16 instructions (`native`)."""
    return "float32"
