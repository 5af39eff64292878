"""The allocators `HBMMonitor` reads: which, how, and whether a peak is exact.

One `_Device` per allocator: a TPU or GPU device on its own, or one entry for
the host that the replicas on CPU share. The readers are those of
`keras_tpu_mem.devices`, for the running backend's devices (TensorFlow device
names or `jax.Device`s); this module only groups them and keeps the peak
intervals (a reset where the backend can, a mark where it cannot).
"""

from __future__ import annotations

import dataclasses
import re

from keras_tpu_mem import devices
from keras_tpu_mem.monitoring._layout import HOST_RSS_LABEL, SHARED_CPU_LABEL


@dataclasses.dataclass
class _Device:
    """One allocator to read: a TPU/GPU device, or the host CPU shared by replicas.

    `queries` are what the readers of `keras_tpu_mem.devices` take: TensorFlow
    device names, or `jax.Device`s on JAX. `resettable` says whether the peak
    counter can be reset (None until tried); where it cannot (JAX), `mark` is
    the peak read when the current phase began: a later peak above it was
    reached in this phase (exact), one at it is only an upper bound.
    """

    label: str
    queries: tuple
    replicas: tuple[str, ...]
    shared: bool
    capacity: int | None = None
    tag: str = ""  # the label as a TensorBoard tag part
    source: str = devices.SOURCE_ALLOCATOR
    resettable: bool | None = None
    mark: int | None = None

    def __post_init__(self):
        self.tag = self.tag or _tag(self.label)

    @property
    def process_wide(self) -> bool:
        return self.source == devices.SOURCE_HOST_RSS

    def use_host_rss(self) -> None:
        """Reads the process's resident memory instead of this CPU allocator."""
        self.source = devices.SOURCE_HOST_RSS
        self.label = HOST_RSS_LABEL
        self.tag = "process"


def _tag(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


def resolve_devices(replicas) -> list[_Device]:
    """The allocators behind a step's devices (`devices.model_devices`).

    A TPU or GPU device is read on its own, also under `ModelParallel`, where
    each device holds its own shard. Host devices that share one allocator
    (TensorFlow's logical CPUs) or keep no statistics (JAX's CPU devices) share
    the host's memory: one shared entry, labelled `"CPU (shared)"`, lists them
    all.
    """
    backend = devices.backend_devices()
    result: list[_Device] = []
    host = []
    for device in replicas:
        name = devices.device_name(device)
        if devices.is_host_device(device) and (
                backend.host_allocator_shared() or devices.read_memory(device) is None):
            host.append((device, name))
            continue
        result.append(_Device(name, backend.reader_queries(device), (name,), shared=False,
                              resettable=backend.peak_resettable()))
    if host:
        result.insert(0, _Device(SHARED_CPU_LABEL, backend.host_queries([d for d, _ in host]),
                                 tuple(n for _, n in host), shared=True,
                                 resettable=backend.peak_resettable()))
    return result


def assign_capacity(device_list, capacity_bytes) -> str:
    """Fills in each device's capacity; returns where the figure came from."""
    if capacity_bytes is not None:
        for device in device_list:
            device.capacity = capacity_bytes
        return "capacity_bytes argument"
    source = "unknown on CPU (pass capacity_bytes=)"
    for device in device_list:
        if not device.shared:
            device.capacity, source = devices.capacity(device.queries[0])
    return source


def read(device: _Device) -> tuple[int, int] | None:
    """`(current, peak)` of one allocator, or `None` where it cannot be read."""
    if device.source == devices.SOURCE_HOST_RSS:
        return devices.read_host_memory()
    for query in device.queries:
        value = devices.read_memory(query)
        if value is not None:
            if len(device.queries) > 1:
                device.queries = (query,)  # remember the spelling that works
            return value
    return None


def reset(device: _Device) -> bool:
    """Starts a new peak interval; False where the peak counter cannot be reset.

    Where it cannot (JAX's allocators), the peak read now becomes the device's
    `mark`, against which the next readings tell whether they are exact.
    """
    if device.source == devices.SOURCE_HOST_RSS:
        devices.reset_host_peak()  # False: sampled peaks only; said once at set-up
        return True
    done = any(devices.reset_peak(query) for query in device.queries)
    device.resettable = done
    if not done:
        value = read(device)
        device.mark = None if value is None else value[1]
    return done


def peak_exact(device: _Device, peak: int) -> bool:
    """Whether `peak` is this interval's own peak, not an upper bound of it.

    After a reset it is. Without one it is exactly when it rose above the mark
    read when the interval began: the high-water mark was raised in between.
    """
    if device.resettable is not False or device.source == devices.SOURCE_HOST_RSS:
        return True
    return device.mark is not None and peak > device.mark
