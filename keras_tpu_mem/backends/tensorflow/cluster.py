"""TensorFlow's in-process cluster: the TPU to connect to, logical CPU devices, and
one strategy per accelerator set.

TensorFlow only (contract: `keras_tpu_mem.backends.contracts.Cluster`):
`tf.distribute.TPUStrategy` connects to a TPU by address, and `MirroredStrategy`
over logical CPUs needs TensorFlow's host device split before TensorFlow starts,
both set up here, in the process. JAX takes its devices as its runtime lists them
(a TPU VM's chips; `XLA_FLAGS` for host devices; `jax.distributed` for pods), so it
has no counterpart. `strategy.place` and the tests' strategy matrix use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import tensorflow as tf

from keras_tpu_mem._utils import check_positive_int

# A TPU VM exposes its chips as /dev/accel* (v2-v4) or /dev/vfio/* (v5e, v6e);
# TPU VM images also export TPU_ACCELERATOR_TYPE.
_LOCAL_TPU_PATHS = ("/dev/accel0", "/dev/vfio/0")


def resolve_tpu_address(
    tpu: str | None,
    environ: Mapping[str, str] | None = None,
    local_tpu_present: bool | None = None,
) -> tuple[str | None, str]:
    """Decides which TPU to connect to, without touching TensorFlow.

    Order: the explicit `tpu` argument, then `TPU_NAME`, then `COLAB_TPU_ADDR`
    (Colab's legacy TPU runtime, a grpc host:port; prefixed with `grpc://`),
    then a local TPU VM (`"local"`).

    Returns:
        `(address, reason)`: the address for `TPUClusterResolver` (or `None`
        when no TPU is indicated) and a sentence saying why.

    Raises:
        TypeError: if `tpu` is not a str or None.
        ValueError: if `tpu` is an empty string.

    Example:

    ```python
    from keras_tpu_mem.backends.tensorflow.cluster import resolve_tpu_address

    resolve_tpu_address(None, {"COLAB_TPU_ADDR": "10.0.0.2:8470"}, False)
    # ('grpc://10.0.0.2:8470', "COLAB_TPU_ADDR='10.0.0.2:8470' is set (Colab)")
    ```
    """
    if tpu is not None and not isinstance(tpu, str):
        raise TypeError(
            "`tpu` must be None, 'local', a TPU name or a 'grpc://host:port' address; "
            f"got {type(tpu).__name__}."
        )
    if tpu is not None:
        if not tpu.strip():
            raise ValueError(
                "`tpu` must be None, 'local', a TPU name or a 'grpc://host:port' "
                "address; got an empty string."
            )
        return tpu.strip(), f"tpu={tpu.strip()!r} was passed"
    environ = os.environ if environ is None else environ
    if environ.get("TPU_NAME"):
        return environ["TPU_NAME"], f"TPU_NAME={environ['TPU_NAME']!r} is set"
    if environ.get("COLAB_TPU_ADDR"):
        address = environ["COLAB_TPU_ADDR"]
        if not address.startswith("grpc://"):
            address = "grpc://" + address
        return address, f"COLAB_TPU_ADDR={environ['COLAB_TPU_ADDR']!r} is set (Colab)"
    if local_tpu_present is None:
        local_tpu_present = bool(environ.get("TPU_ACCELERATOR_TYPE")) or any(
            os.path.exists(p) for p in _LOCAL_TPU_PATHS
        )
    if local_tpu_present:
        return "local", "this machine is a TPU VM"
    return None, "no TPU named (tpu=None, no TPU_NAME or COLAB_TPU_ADDR, not a TPU VM)"


# One strategy per accelerator set and process. Re-running a notebook cell must
# not build a second TPUStrategy (initialize_tpu_system would wipe the TPU's
# memory under the first one's variables), and on TensorFlow 2.19 two
# MirroredStrategy objects over the same devices can mix up their collective
# all-reduce keys ("Shape mismatch in the collective instance").
_STRATEGIES: dict[tuple, object] = {}


def shared_strategy(key: tuple, factory):
    """The process-wide strategy for `key` (an accelerator set), made by `factory()`
    the first time."""
    if key not in _STRATEGIES:
        _STRATEGIES[key] = factory()
    return _STRATEGIES[key]


def mirrored_logical_cpus(count: int):
    """The process-wide MirroredStrategy over `count` logical CPUs (configured if needed)."""
    configure_logical_cpus(count)
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    return shared_strategy(("CPU", tuple(cpus)), lambda: tf.distribute.MirroredStrategy(cpus))


def configure_logical_cpus(count: int) -> None:
    """Splits the host CPU into `count` logical devices for MirroredStrategy.

    Must run before TensorFlow initialises its devices (before the first op or
    device query). Calling it again with the same count is a no-op.

    Raises:
        RuntimeError: if TensorFlow is already initialised with another layout.
    """
    check_positive_int(count, "logical_cpus")
    cpu = tf.config.list_physical_devices("CPU")[0]
    wanted = [tf.config.LogicalDeviceConfiguration() for _ in range(count)]
    try:
        tf.config.set_logical_device_configuration(cpu, wanted)
    except RuntimeError as err:
        existing = tf.config.list_logical_devices("CPU")
        if len(existing) == count:
            return
        raise RuntimeError(
            f"logical_cpus={count} needs TensorFlow uninitialised, but it already "
            f"runs with {len(existing)} logical CPU(s). Create "
            f"TPUStrategyWrapper(logical_cpus={count}) before any TensorFlow op, "
            "model or dataset (first thing in the process, or restart the "
            "runtime in Colab)."
        ) from err
