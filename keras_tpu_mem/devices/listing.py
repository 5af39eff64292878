"""Which devices run the model, and what they are: written once for both backends.

A *device* is what the running backend's readers take: a TensorFlow device
name (`"TPU:3"`, `"/job:localhost/.../device:CPU:1"`) or a `jax.Device`. Each
function asks `backends.current().devices` for the backend's facts (names,
platform strings, kinds) and returns them as they are.

Example:

```python
from keras_tpu_mem import devices

for device in devices.replica_devices():
    print(devices.device_name(device), devices.device_platform(device),
          devices.is_host_device(device))
```
"""

from __future__ import annotations

from keras_tpu_mem import backends


def backend_devices():
    """The running backend's `devices` concern module (`backends/<name>/devices.py`)."""
    return backends.current("keras_tpu_mem.devices").devices


def replica_devices(where=None) -> list:
    """The devices a training step runs on in this process.

    Args:
        where: On TensorFlow a `tf.distribute.Strategy` (None: the current
            one; the default strategy's one replica is the first GPU, else the
            CPU); on JAX a `keras.distribution.Distribution` (None: the active
            one; without one, the first local device), whose devices this
            process addresses, sorted by id.

    Returns:
        TensorFlow device names (full, e.g. `/job:.../device:CPU:1`) or
        `jax.Device`s.
    """
    return backend_devices().replica_devices(where)


def model_devices(model) -> list:
    """The devices `model`'s training steps run on in this process.

    On TensorFlow the replicas of the strategy `model` was built under; on JAX
    the devices of the active `keras.distribution` (see `replica_devices`).
    """
    return backend_devices().model_devices(model)


def device_name(device) -> str:
    """`"TPU:3"`, `"GPU:0"`, `"CPU:5"`: a device's platform and (global) index."""
    return backend_devices().device_name(device)


def device_platform(device) -> str:
    """`"TPU"`, `"GPU"` or `"CPU"` (another platform's name in capitals)."""
    return backend_devices().platform(device)


def is_host_device(device) -> bool:
    """True for a CPU device: a name such as `"CPU:0"` or a `jax.Device` on `"cpu"`."""
    return device_platform(device) == "CPU"


def device_kinds(device) -> list[str]:
    """What names the device's hardware, most trusted first: a TPU's accelerator
    type or device kind (`"v3-8"`, `"TPU v4"`), a GPU's name; may be empty."""
    return backend_devices().device_kinds(device)


def gpu_capabilities(devices) -> list[tuple[str, str]]:
    """`(name, "major.minor")` of each GPU among `devices` whose compute capability
    the backend tells."""
    return backend_devices().gpu_capabilities(devices)


def cpu_bfloat16_matmul(native: bool) -> str:
    """How the running backend computes a bfloat16 matrix product on a CPU with
    (`native`) or without bfloat16 instructions: `"bfloat16"`, `"float32"` (XLA
    upcasts) or `"emulated"`."""
    return backend_devices().cpu_bfloat16_matmul(native)
