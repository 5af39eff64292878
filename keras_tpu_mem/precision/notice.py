"""What bfloat16 means on the devices that run: `device_notice`.

bfloat16 is native on TPUs. On CPUs and on GPUs without bfloat16 tensor cores
(compute capability below 8.0) it runs and halves activation memory, but
matrix products are not faster there; `MixedBFloat16` says so once in the log.
Which devices run, their GPUs' compute capabilities and how the backend runs a
bfloat16 matrix product on a CPU come from `keras_tpu_mem.devices`.
"""

from __future__ import annotations

import logging

from keras_tpu_mem import devices
from keras_tpu_mem._utils import log_once
from keras_tpu_mem.devices import placement

__all__ = ["device_notice"]



def _cpu_bf16_flags() -> list[str] | None:
    """bfloat16 instruction sets of this CPU, or None where unknown (not Linux x86)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    except OSError:
        return None
    return None


def _capability(text: str) -> tuple[int, ...]:
    """`(8, 0)` from a compute capability written `"8.0"`."""
    return tuple(int(part) for part in text.split(".")[:2])


def device_notice(strategy=None) -> str | None:
    """What bfloat16 means on the devices of `strategy` (None on a TPU: native).

    Args:
        strategy: On TensorFlow, a `tf.distribute.Strategy`; on JAX, a
            `keras.distribution.Distribution`. The current one if None (on JAX
            without a distribution: the default device).

    Returns:
        A one-line notice for CPUs and for GPUs without bfloat16 tensor cores
        (compute capability below 8.0), or None where bfloat16 is native.

    Example:

    ```python
    import keras_tpu_mem as ktm

    print(ktm.device_notice())   # e.g. "bfloat16 on CPU (...): it runs and ..."
    ```
    """
    running = devices.replica_devices(strategy)
    kinds = {devices.device_platform(device) for device in running}
    if "TPU" in kinds:
        return None
    if "GPU" in kinds:
        slow = [f"{name} (compute capability {capability})"
                for name, capability in devices.gpu_capabilities(running)
                if _capability(capability) < (8, 0)]
        if not slow:
            return None
        return ("bfloat16 on " + ", ".join(slow) + ", which has no bfloat16 tensor "
                "cores: it runs and halves activation memory, but matrix products are "
                "not faster than float32 there.")
    flags = _cpu_bf16_flags()
    support = (f"this CPU has {', '.join(flags)}" if flags else
               "this CPU has no bfloat16 instructions" if flags is not None
               else "bfloat16 support of this CPU unknown")
    matmul = devices.cpu_bfloat16_matmul(bool(flags))
    if matmul == "float32":
        return (f"bfloat16 on CPU ({support}): it runs and halves activation memory; XLA on "
                "CPU computes bfloat16 matrix products in float32, so it is not faster "
                "there. On a TPU it is native.")
    if matmul == "bfloat16":
        return (f"bfloat16 on CPU ({support}): it runs and halves activation memory; on a "
                "TPU it is native. XLA on CPU (jit_compile=True) upcasts bfloat16 matrix "
                "products to float32.")
    return (f"bfloat16 on CPU ({support}): it runs, emulated, usually slower than "
            "float32; on a TPU it is native.")


def log_device_notice(model) -> None:
    """Logs `device_notice` for the devices `model` trains on, once per process."""
    message = device_notice(placement.training_strategy(model, "MixedBFloat16"))
    if message:
        log_once(message, logging.INFO, "%s", message)
