"""Devices and their memory on TensorFlow: device names and `tf.config`'s allocator.

Contract: `keras_tpu_mem.backends.contracts.Devices`; a *device* here is a TensorFlow
device name (`"TPU:3"` or `"/job:localhost/replica:0/task:0/device:CPU:0"`).
"""

from __future__ import annotations

import os

import tensorflow as tf


def allocator_reader() -> str:
    return "tf.config.experimental.get_memory_info"


def peak_resettable() -> bool | None:
    """None: whether a device's peak resets is known once tried (TPU, GPU and CPU with
    oneDNN can)."""
    return None


def host_allocator_shared() -> bool:
    """True: every logical CPU device and the input pipeline share the one host
    allocator."""
    return True


def host_rss_why() -> str:
    return ("The CPU allocator keeps no statistics here (oneDNN is off: TensorFlow's "
            "default on CPUs without AVX-512, or TF_ENABLE_ONEDNN_OPTS=0)")


def host_rss_fix() -> str:
    return "TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow starts gives allocator figures."


def unreadable_why() -> str:
    return "TensorFlow keeps no allocator statistics there"


def replica_devices(where=None) -> list[str]:
    """Full device names of a strategy's replicas, e.g. `/job:.../device:CPU:1`.

    The default strategy has no replica list: its one replica runs where
    TensorFlow places ops, the first GPU if there is one, else the CPU.
    """
    strategy = tf.distribute.get_strategy() if where is None else where
    try:
        names = list(strategy.extended.worker_devices)
    except (RuntimeError, AttributeError, NotImplementedError):
        names = []
    if not names:
        gpus = tf.config.list_logical_devices("GPU")
        names = [gpus[0].name] if gpus else ["/device:CPU:0"]
    return names


def model_devices(model) -> list[str]:
    """The replica devices of the strategy `model` was built under."""
    return replica_devices(model.distribute_strategy)


def device_name(device: str) -> str:
    return device.split("device:")[-1]


def platform(device: str) -> str:
    return device_name(device).split(":")[0].upper()


def device_kinds(device: str) -> list[str]:
    """A TPU's accelerator type and device kinds, or the first GPU's name."""
    kind = platform(device)
    if kind == "TPU":
        accelerator = os.environ.get("TPU_ACCELERATOR_TYPE")
        kinds = [accelerator] if accelerator else []
        for lister in (tf.config.list_physical_devices, tf.config.list_logical_devices):
            try:
                found = lister("TPU")[:1]
            except Exception:
                found = []
            for tpu in found:
                try:
                    kinds.append(tf.config.experimental.get_device_details(tpu).get("device_kind"))
                except Exception:
                    pass
        return [k for k in kinds if k]
    if kind == "GPU":
        try:
            gpu = tf.config.list_physical_devices("GPU")[0]
            name = tf.config.experimental.get_device_details(gpu).get("device_name")
        except Exception:
            name = None
        return [name] if name else []
    return []


def reader_queries(device: str) -> tuple[str, ...]:
    """The full name first (where given), then the short one."""
    short = device_name(device)
    return (device, short) if device != short else (short,)


def host_queries(devices) -> tuple[str, ...]:
    return ("CPU:0",)  # the one host allocator, whichever logical CPUs the replicas use


def memory_stats(device: str) -> dict | None:
    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None
    return {"bytes_in_use": int(info["current"]), "peak_bytes_in_use": int(info["peak"])}


def reset_peak(device: str) -> bool:
    try:
        tf.config.experimental.reset_memory_stats(device)
    except (ValueError, RuntimeError, tf.errors.OpError):
        return False
    return True


def gpu_capabilities(devices) -> list[tuple[str, str]]:
    """`(name, "major.minor")` of each GPU whose compute capability TensorFlow tells:
    it tells those of the physical GPUs, whichever `devices` the replicas use."""
    found = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        capability = details.get("compute_capability")
        if capability is not None:
            found.append((details.get("device_name", gpu.name),
                          f"{capability[0]}.{capability[1]}"))
    return found


def cpu_bfloat16_matmul(native: bool) -> str:
    """How this backend computes a bfloat16 matrix product on a CPU: TensorFlow's own
    kernels use the CPU's bfloat16 instructions (oneDNN) where it has them
    (`native`), and emulate bfloat16 where it does not."""
    return "bfloat16" if native else "emulated"
