"""bfloat16 on TensorFlow: the devices a strategy trains on, its GPUs, its CPUs.

Contract (same in `backends/jax/precision.py`), for
`keras_tpu_mem.precision.notice`:

- `training_strategy(model)`: what `device_notice` takes to describe the
  devices `model` trains on (here the model's `tf.distribute.Strategy`).
- `device_kinds(strategy, devices)`: the kinds (`"TPU"`, `"GPU"`, `"CPU"`) of
  the devices `strategy` runs on (None: the current strategy); `devices` is
  the module `keras_tpu_mem.devices`, whose listing this reads (passed in: a
  backend module never imports the neutral modules).
- `gpus(strategy, devices)`: `(name, "major.minor")` for each GPU bfloat16
  would run on whose compute capability the backend knows.
- `cpu_notice(support, native)`: the notice for bfloat16 on a CPU, where
  `support` says what the CPU has (`"this CPU has amx_bf16"`) and `native`
  whether it has bfloat16 instructions.
"""

from __future__ import annotations

import tensorflow as tf


def training_strategy(model):
    return model.distribute_strategy


def device_kinds(strategy, devices) -> list[str]:
    strategy = strategy or tf.distribute.get_strategy()
    return sorted({tf.DeviceSpec.from_string(name).device_type or "CPU"
                   for name in devices.replica_device_names(strategy)})


def gpus(strategy, devices) -> list[tuple[str, str]]:
    # TensorFlow tells compute capabilities of the physical GPUs, whichever the
    # strategy's replicas use.
    found = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        capability = details.get("compute_capability")
        if capability is not None:
            found.append((details.get("device_name", gpu.name),
                          f"{capability[0]}.{capability[1]}"))
    return found


def cpu_notice(support: str, native: bool) -> str:
    # TensorFlow's own CPU kernels use the CPU's bfloat16 instructions (oneDNN)
    # where it has them and emulate bfloat16 where it does not.
    if native:
        return (f"bfloat16 on CPU ({support}): it runs and halves activation memory; on a "
                "TPU it is native. XLA on CPU (jit_compile=True) upcasts bfloat16 matrix "
                "products to float32.")
    return (f"bfloat16 on CPU ({support}): it runs, emulated, usually slower than "
            "float32; on a TPU it is native.")
