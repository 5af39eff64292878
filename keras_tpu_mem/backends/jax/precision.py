"""bfloat16 on JAX: the devices a distribution trains on, its GPUs, its CPUs.

Contract: as `backends/tensorflow/precision.py`. Here a strategy is a
`keras.distribution.Distribution` (None: the active one, or the default
device without one).
"""

from __future__ import annotations


def training_strategy(model):
    # Keras' JAX trainer runs under the active keras.distribution, not the model's.
    return None


def device_kinds(strategy, devices) -> list[str]:
    return sorted({devices.jax_device_name(device).partition(":")[0]
                   for device in devices.monitored_jax_devices(strategy)})


def gpus(strategy, devices) -> list[tuple[str, str]]:
    return sorted({(device.device_kind, str(capability))
                   for device in devices.monitored_jax_devices(strategy)
                   for capability in [getattr(device, "compute_capability", None)]
                   if capability is not None})


def cpu_notice(support: str, native: bool) -> str:
    # Every JAX computation goes through XLA, whose CPU backend computes bfloat16
    # matrix products in float32, with or without bfloat16 instructions.
    return (f"bfloat16 on CPU ({support}): it runs and halves activation memory; XLA on "
            "CPU computes bfloat16 matrix products in float32, so it is not faster "
            "there. On a TPU it is native.")
