"""One place for devices and memory, written once for TensorFlow and JAX.

* `specs`: what each accelerator generation holds (`HBM_TABLE`, `lookup_tpu`,
  `parse_accelerator_type`, `gpu_memory_bytes`); plain data, no framework.
* `units`: `GIB`, `GB`, `format_bytes`.
* `listing`: the devices that run the model (`replica_devices`,
  `model_devices`) and what they are (`device_name`, `device_platform`,
  `is_host_device`, `device_kinds`, `gpu_capabilities`, `cpu_bfloat16_matmul`).
* `placement`: where a model's variables live (`training_strategy`,
  `variable_owner`, `active_strategy`, `replica_runner`).
* `memory`: current and peak bytes with their source (`read_memory`,
  `reset_peak`, `memory_source`, `read_memory_reading`, `MemoryReading`),
  the allocator's statistics (`memory_stats`) and a device's `capacity`.
* `host`: the process's resident memory, the fallback source on a CPU whose
  allocator keeps no statistics (`read_host_memory`, `reset_host_peak`, ...).

A *device* is what the running backend's readers take: a TensorFlow device
name (`"TPU:3"`) or a `jax.Device`. The backend's part of each function lives
in `keras_tpu_mem/backends/<name>/devices.py` (`backends.current().devices`);
importing this package imports no framework and no Keras, so `ktm.HBM_TABLE`
works where neither is installed.

Example:

```python
from keras_tpu_mem import devices

print(devices.lookup_tpu("v5litepod-16").hbm_bytes_per_replica / devices.GB)  # 16.0
for device in devices.replica_devices():
    reading = devices.read_memory_reading(device)
    print(reading.device, reading.source, devices.format_bytes(reading.peak_bytes))
```
"""

from __future__ import annotations

from keras_tpu_mem.devices.host import (
    host_memory_readable,
    host_peak_method,
    host_rss_bytes,
    read_host_memory,
    reset_host_peak,
)
from keras_tpu_mem.devices.listing import (
    backend_devices,
    cpu_bfloat16_matmul,
    device_kinds,
    device_name,
    device_platform,
    gpu_capabilities,
    is_host_device,
    model_devices,
    replica_devices,
)
from keras_tpu_mem.devices.memory import (
    MEMORY_SOURCES,
    SOURCE_ALLOCATOR,
    SOURCE_HOST_RSS,
    MemoryReading,
    capacity,
    describe_source,
    memory_source,
    memory_stats,
    read_memory,
    read_memory_reading,
    reset_peak,
)
from keras_tpu_mem.devices.specs import (
    GPU_MEMORY_BYTES,
    HBM_TABLE,
    AcceleratorSpec,
    gpu_memory_bytes,
    lookup_tpu,
    parse_accelerator_type,
)
from keras_tpu_mem.devices.units import GB, GIB, format_bytes

# The names these functions had when this was one module with a reader per
# backend; the strategy wrapper, the profiler, the precision notice and the
# planner still call them.
replica_device_names = replica_devices
monitored_jax_devices = replica_devices
jax_device_name = device_name
jax_memory_stats = memory_stats
jax_capacity = capacity

__all__ = [
    "GB", "GIB", "GPU_MEMORY_BYTES", "HBM_TABLE", "MEMORY_SOURCES", "SOURCE_ALLOCATOR",
    "SOURCE_HOST_RSS", "AcceleratorSpec", "MemoryReading", "backend_devices", "capacity",
    "cpu_bfloat16_matmul", "gpu_capabilities",
    "describe_source", "device_kinds", "device_name", "device_platform", "format_bytes",
    "gpu_memory_bytes", "host_memory_readable", "host_peak_method", "host_rss_bytes",
    "is_host_device", "lookup_tpu", "memory_source", "memory_stats", "model_devices",
    "parse_accelerator_type", "read_host_memory", "read_memory", "read_memory_reading",
    "replica_devices", "reset_host_peak", "reset_peak",
]
