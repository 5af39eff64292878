"""Memory readers: current and peak bytes of a device, and where they come from.

Every figure names its *source*:

* `"allocator"` (`SOURCE_ALLOCATOR`): the bytes a device's allocator holds now
  and at its peak, as the backend reads them
  (`tf.config.experimental.get_memory_info` on TensorFlow: HBM on a TPU, GPU
  memory, or the host allocator on CPU; `jax.Device.memory_stats()` on JAX,
  whose `bytes_limit` is the capacity). JAX's peak is a high-water mark since
  the process started that nothing can reset (`reset_peak` returns False), so
  callers that keep phases apart compare it with the mark at the phase's start
  (see `HBMMonitor`).
* `"host_rss"` (`SOURCE_HOST_RSS`): the resident memory (RSS) of this whole
  process (`keras_tpu_mem.devices.host`), the fallback for a CPU device whose
  allocator keeps no statistics (TensorFlow's CPU allocator with oneDNN off:
  the default on CPUs without AVX-512, such as AMD EPYC with AVX2, or
  `TF_ENABLE_ONEDNN_OPTS=0`; JAX's CPU devices). It is a process-wide figure
  (weights, data, Python, the framework itself), never HBM.

`read_memory` and `reset_peak` read one source; `memory_source` picks the
source that can read a device, and `read_memory_reading` returns a
`MemoryReading` that carries it. They return `None` where nothing can tell (a
TPU or GPU plugin without statistics), so callers say "unknown" instead of
guessing. A device is what `keras_tpu_mem.devices.listing` lists: a TensorFlow
device name or a `jax.Device`; the backend's part is
`backends.current().devices`.
"""

from __future__ import annotations

import dataclasses

from keras_tpu_mem.devices.host import host_memory_readable, read_host_memory, reset_host_peak
from keras_tpu_mem.devices.listing import (
    backend_devices,
    device_kinds,
    device_name,
    device_platform,
    is_host_device,
)
from keras_tpu_mem.devices.specs import gpu_memory_bytes, lookup_tpu

#: The device's allocator statistics: `tf.config.experimental.get_memory_info` on
#: TensorFlow, `jax.Device.memory_stats()` on JAX.
SOURCE_ALLOCATOR = "allocator"
#: The resident memory of the whole process (psutil; peak from Linux's VmHWM).
SOURCE_HOST_RSS = "host_rss"
#: Every source, with the words reports use for it.
MEMORY_SOURCES = {
    SOURCE_ALLOCATOR: "allocator",
    SOURCE_HOST_RSS: "host RSS (whole process, not HBM)",
}


def _check_source(source) -> str:
    if source not in MEMORY_SOURCES:
        raise ValueError(
            f"`source` must be one of {sorted(MEMORY_SOURCES)}, got {source!r}."
        )
    return source


def describe_source(source: str | None) -> str:
    """Words for a source in tables and titles: `"allocator"`, `"host RSS (...)"`."""
    if source is None:
        return "unreadable"
    return MEMORY_SOURCES.get(source, str(source))


@dataclasses.dataclass(frozen=True)
class MemoryReading:
    """One device's memory, and where the figures come from.

    Attributes:
        device: Device name, e.g. `"TPU:0"` or `"CPU:0"` (for a `jax.Device`:
            its platform and id, `device_name`).
        current_bytes: Bytes in use now, or `None` if unreadable.
        peak_bytes: Peak bytes since the last reset (or the process start),
            or `None` if unreadable.
        capacity_bytes: Total memory of the device where known, else `None`.
        shared: True when several replicas share this allocator (logical CPUs).
        source: `"allocator"` (the device's allocator statistics), `"host_rss"`
            (the resident memory of the whole process, the fallback for a CPU
            allocator that keeps no statistics), or `None` when unreadable.
        process_wide: True for `"host_rss"`: the figure covers the whole
            process (weights, data, Python, the framework itself), not one device.
    """

    device: str
    current_bytes: int | None
    peak_bytes: int | None
    capacity_bytes: int | None = None
    shared: bool = False
    source: str | None = SOURCE_ALLOCATOR
    process_wide: bool = False

    @property
    def readable(self) -> bool:
        return self.current_bytes is not None


def memory_stats(device) -> dict | None:
    """A device allocator's statistics, or `None` where it keeps none.

    `bytes_in_use`, `peak_bytes_in_use` and, where the runtime reports one,
    `bytes_limit` (JAX's TPU and GPU devices). TensorFlow's CPU allocator with
    oneDNN off, JAX's CPU devices and an unknown device give `None`.
    """
    return backend_devices().memory_stats(device)


def read_memory(device, *, source: str = SOURCE_ALLOCATOR) -> tuple[int, int] | None:
    """Returns `(current_bytes, peak_bytes)` for a device from one source, or `None`.

    With `source="allocator"` (the default) `None` means the backend cannot
    read this allocator: on TensorFlow's CPU that is the case when oneDNN is
    off (the default on CPUs without AVX-512, or `TF_ENABLE_ONEDNN_OPTS=0`),
    because the plain CPU allocator keeps no statistics; JAX's CPU devices
    keep none either. `source="host_rss"` reads the whole process's resident
    memory (`read_host_memory`) whatever `device` is; use it only for the
    host (see `memory_source`).

    Raises:
        ValueError: if `source` is not `"allocator"` or `"host_rss"`.
    """
    if _check_source(source) == SOURCE_HOST_RSS:
        return read_host_memory()
    stats = memory_stats(device)
    if stats is None or stats.get("bytes_in_use") is None:
        return None
    current = int(stats["bytes_in_use"])
    return current, int(stats.get("peak_bytes_in_use", current))


def reset_peak(device, *, source: str = SOURCE_ALLOCATOR) -> bool:
    """Resets a device's peak counter; returns False where that is unsupported.

    With `source="host_rss"` the peak starts again from the current RSS; the
    result says whether the OS high-water mark could be reset too (see
    `reset_host_peak`). A `jax.Device`'s allocator peak cannot be reset:
    JAX exposes no such call (its `peak_bytes_in_use` counts from the process
    start), so this returns False for one.

    Raises:
        ValueError: if `source` is not `"allocator"` or `"host_rss"`.
    """
    if _check_source(source) == SOURCE_HOST_RSS:
        return reset_host_peak()
    return backend_devices().reset_peak(device)


def memory_source(device) -> str | None:
    """The source that can read `device`, or `None` if none can.

    `"allocator"` where its allocator keeps statistics; `"host_rss"` for a CPU
    device whose allocator keeps none (the host's memory *is* that device's
    memory, counted for the whole process); `None` for a TPU or GPU without
    statistics: the host's RSS says nothing about accelerator memory.
    """
    if read_memory(device) is not None:
        return SOURCE_ALLOCATOR
    if is_host_device(device) and host_memory_readable():
        return SOURCE_HOST_RSS
    return None


def capacity(device) -> tuple[int | None, str]:
    """`(bytes, where the figure comes from)` for one device.

    The runtime's `bytes_limit` where the allocator reports one (JAX on TPU
    and GPU); else a TPU's per-replica HBM from `HBM_TABLE` by its accelerator
    type or device kind (`device_kinds`), a GPU's size from its name;
    `None` on CPU.
    """
    stats = memory_stats(device)
    if stats and stats.get("bytes_limit"):
        reader = backend_devices().allocator_reader()
        return int(stats["bytes_limit"]), f"bytes_limit of {reader}"
    platform = device_platform(device)
    if platform == "TPU":
        kinds = device_kinds(device)
        for kind in kinds:
            try:
                spec = lookup_tpu(kind)
            except (ValueError, TypeError):
                continue
            return spec.hbm_bytes_per_replica, f"{spec.device_kind} per replica (ktm.HBM_TABLE)"
        tried = f" ({', '.join(map(repr, kinds))})" if kinds else ""
        return None, f"TPU generation unknown{tried}"
    if platform == "GPU":
        kinds = device_kinds(device)
        name = kinds[0] if kinds else None
        size = gpu_memory_bytes(name)
        return size, (f"{name} (from its name)" if size else f"{name or 'GPU'}: unknown")
    return None, "unknown on CPU (pass capacity_bytes=)"


def read_memory_reading(device, *, capacity_bytes: int | None = None,
                        shared: bool = False, source: str | None = None) -> MemoryReading:
    """Reads `device` into a `MemoryReading` that names its source.

    Args:
        device: A device of the running backend: a TensorFlow device name,
            e.g. `"CPU:0"`, `"TPU:3"`, or a `jax.Device`.
        capacity_bytes: The device's capacity where known (copied into the
            reading; `None` for the host RSS, which has no HBM capacity). For
            a device read from its allocator, `None` takes `capacity(device)`.
        shared: Whether several replicas share this device's allocator.
        source: `None` picks one (`memory_source`); else `"allocator"` or
            `"host_rss"`.

    Example:

    ```python
    from keras_tpu_mem import devices

    reading = devices.read_memory_reading("CPU:0", shared=True)
    print(reading.source, devices.format_bytes(reading.peak_bytes))
    ```
    """
    source = memory_source(device) if source is None else _check_source(source)
    value = read_memory(device, source=source) if source is not None else None
    if source == SOURCE_ALLOCATOR and capacity_bytes is None:
        capacity_bytes = capacity(device)[0]
    name = device_name(device)
    if value is None:
        return MemoryReading(name, None, None, capacity_bytes, shared, None, False)
    on_host = source == SOURCE_HOST_RSS
    return MemoryReading(name, value[0], value[1], None if on_host else capacity_bytes,
                         shared, source, on_host)
