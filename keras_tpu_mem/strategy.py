"""`TPUStrategyWrapper`: find the accelerator, build the strategy, do the batch arithmetic."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from keras_tpu_mem import devices
from keras_tpu_mem._utils import check_positive_int, logger
from keras_tpu_mem.backends.require import require_tensorflow_backend

# Environment variables that name a TPU. Colab's legacy TPU runtime exports
# COLAB_TPU_ADDR (a grpc host:port); Cloud TPU nodes and most launch scripts
# export TPU_NAME.
_TPU_ENV_VARS = ("TPU_NAME", "COLAB_TPU_ADDR")
# A TPU VM exposes its chips as /dev/accel* (v2-v4) or /dev/vfio/* (v5e, v6e);
# TPU VM images also export TPU_ACCELERATOR_TYPE.
_LOCAL_TPU_PATHS = ("/dev/accel0", "/dev/vfio/0")

_SOURCE_WORDS = {
    devices.SOURCE_ALLOCATOR: "allocator statistics of each device",
    devices.SOURCE_HOST_RSS: ("host RSS: the CPU allocator keeps no statistics here (oneDNN "
                              "off), so this is the resident memory of the whole process"),
}


def resolve_tpu_address(
    tpu: str | None,
    environ: Mapping[str, str] | None = None,
    local_tpu_present: bool | None = None,
) -> tuple[str | None, str]:
    """Decides which TPU to connect to, without touching TensorFlow.

    Order: the explicit `tpu` argument, then `TPU_NAME`, then `COLAB_TPU_ADDR`
    (prefixed with `grpc://`), then a local TPU VM (`"local"`).

    Returns:
        `(address, reason)`: the address for `TPUClusterResolver` (or `None`
        when no TPU is indicated) and a sentence saying why.

    Raises:
        TypeError: if `tpu` is not a str or None.
        ValueError: if `tpu` is an empty string.
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


def _shared_strategy(key: tuple, factory):
    if key not in _STRATEGIES:
        _STRATEGIES[key] = factory()
    return _STRATEGIES[key]


def mirrored_logical_cpus(count: int):
    """The process-wide MirroredStrategy over `count` logical CPUs (configured if needed)."""
    import tensorflow as tf

    configure_logical_cpus(count)
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    return _shared_strategy(("CPU", tuple(cpus)), lambda: tf.distribute.MirroredStrategy(cpus))


def configure_logical_cpus(count: int) -> None:
    """Splits the host CPU into `count` logical devices for MirroredStrategy.

    Must run before TensorFlow initialises its devices (before the first op or
    device query). Calling it again with the same count is a no-op.

    Raises:
        RuntimeError: if TensorFlow is already initialised with another layout.
    """
    import tensorflow as tf

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


_JAX_ONLY_ARGUMENTS = frozenset(
    {"layout_map", "mesh_shape", "multi_host", "coordinator_address", "num_processes",
     "process_id"})


class TPUStrategyWrapper:
    """Finds the best accelerator and builds the matching `tf.distribute` strategy.

    Resolution order: an explicit `tpu` (a name, a `grpc://` address or
    `"local"`), then the `TPU_NAME` / Colab (`COLAB_TPU_ADDR`) environment, then
    a local TPU VM, each giving `tf.distribute.TPUStrategy`; else one or more
    GPUs give `MirroredStrategy`; else `logical_cpus=N` gives `MirroredStrategy`
    over N logical CPUs (the CPU stand-in for a multi-replica TPU); else the
    default strategy. One log line says what was picked and why.

    A TPU that was asked for (explicitly or by the environment) but cannot be
    reached raises: training silently on the CPU instead would be the worse
    surprise.

    Args:
        tpu: `None` to detect, `"local"` for a TPU VM, a TPU name, or a
            `grpc://host:port` address.
        logical_cpus: Without TPU or GPU, mirror over this many logical CPUs.
            Must be set before TensorFlow initialises.

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm

    tpu = ktm.TPUStrategyWrapper()
    with tpu.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="mse")
    print(tpu.describe())
    ```
    """

    def __new__(cls, *args, **kwargs):
        # On the JAX backend the same name builds a keras.distribution over
        # jax.devices() (strategy_jax.py); its extra arguments are JAX-only.
        import keras

        if cls is TPUStrategyWrapper and keras.backend.backend() == "jax":
            from keras_tpu_mem.strategy_jax import JaxTPUStrategyWrapper

            return super().__new__(JaxTPUStrategyWrapper)
        jax_only = sorted(set(kwargs) & _JAX_ONLY_ARGUMENTS)
        if jax_only and keras.backend.backend() == "tensorflow":
            raise TypeError(
                f"TPUStrategyWrapper: {', '.join(jax_only)} belong to the JAX backend "
                "(keras.distribution); on TensorFlow use tf.distribute (tpu=..., "
                "logical_cpus=...).")
        return super().__new__(cls)

    def __init__(self, tpu: str | None = None, *, logical_cpus: int | None = None):
        require_tensorflow_backend("TPUStrategyWrapper")
        if logical_cpus is not None:
            check_positive_int(logical_cpus, "logical_cpus")
        address, reason = resolve_tpu_address(tpu)
        self._tpu_address = address
        self._resolver = None
        self._gpu_details = None
        if address is not None:
            self._strategy = self._connect_tpu(address, reason)
            self.kind = "TPU"
        else:
            self._strategy, self.kind, reason = self._local_strategy(logical_cpus, reason)
        self.reason = reason
        logger.info(
            "TPUStrategyWrapper: %s with %d replica(s) on %s, because %s.",
            type(self._strategy).__name__,
            self.num_replicas,
            self.device_name,
            reason,
        )

    # ----------------------------------------------------------------- set-up
    def _connect_tpu(self, address: str, reason: str):
        import tensorflow as tf

        def connect():
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
            if address != "local":
                tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
            return tf.distribute.TPUStrategy(resolver)

        try:
            strategy = _shared_strategy(("TPU", address), connect)
        except Exception as err:  # TF raises many types here; re-raise with context.
            raise RuntimeError(
                f"A TPU was requested ({reason}) but connecting to {address!r} failed: "
                f"{err}. Check that this runtime has a TPU and that the TensorFlow "
                "build supports it (TPU VMs need `tensorflow-tpu` or a TPU-enabled "
                "TensorFlow; see the README). Unset TPU_NAME / COLAB_TPU_ADDR to "
                "train without a TPU."
            ) from err
        self._resolver = strategy.cluster_resolver
        return strategy

    def _local_strategy(self, logical_cpus, reason):
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            if logical_cpus is not None:
                logger.warning(
                    "TPUStrategyWrapper: logical_cpus=%d ignored because %d GPU(s) "
                    "were found; GPUs take precedence.", logical_cpus, len(gpus)
                )
            try:
                self._gpu_details = tf.config.experimental.get_device_details(gpus[0])
            except Exception:  # details are cosmetic; never fail on them
                self._gpu_details = {}
            strategy = _shared_strategy(("GPU",), tf.distribute.MirroredStrategy)
            return strategy, "GPU", f"{reason}; found {len(gpus)} GPU(s)"
        if logical_cpus is not None:
            strategy = mirrored_logical_cpus(logical_cpus)
            return strategy, "CPU", f"{reason}; no GPU; logical_cpus={logical_cpus} requested"
        return tf.distribute.get_strategy(), "CPU", f"{reason}; no GPU"

    # ------------------------------------------------------------- properties
    @property
    def strategy(self):
        """The `tf.distribute.Strategy` that was built."""
        return self._strategy

    def scope(self):
        """The strategy's scope: build and compile the model inside it."""
        return self._strategy.scope()

    @property
    def num_replicas(self) -> int:
        """Replicas in sync (TPU cores or chips, GPUs, logical CPUs)."""
        return int(self._strategy.num_replicas_in_sync)

    @property
    def device_name(self) -> str:
        """Human-readable device, e.g. `"TPU v3"`, `"NVIDIA A100-SXM4-40GB"`, `"CPU"`."""
        if self.kind == "TPU":
            return self._tpu_device_kind() or "TPU (generation unknown)"
        if self.kind == "GPU":
            return (self._gpu_details or {}).get("device_name") or "GPU"
        return "CPU"

    def _tpu_device_kind(self) -> str | None:
        import tensorflow as tf

        accelerator = os.environ.get("TPU_ACCELERATOR_TYPE")
        if accelerator:
            try:
                return devices.lookup_tpu(accelerator).device_kind
            except ValueError:
                pass
        for device in tf.config.list_logical_devices("TPU")[:1]:
            try:
                kind = tf.config.experimental.get_device_details(device).get("device_kind")
            except Exception:
                kind = None
            if kind:
                return kind
        return None

    @property
    def hbm_bytes_per_replica(self) -> int | None:
        """Accelerator memory of one replica in bytes, or `None` where unknown."""
        if self.kind == "TPU":
            try:
                return devices.lookup_tpu(self.device_name).hbm_bytes_per_replica
            except ValueError:
                return None
        if self.kind == "GPU":
            return devices.gpu_memory_bytes(self.device_name)
        return None

    # ------------------------------------------------------------ arithmetic
    def global_batch_size(self, per_replica: int) -> int:
        """Global batch for a per-replica batch: `per_replica * num_replicas`."""
        check_positive_int(per_replica, "per_replica")
        return per_replica * self.num_replicas

    def per_replica_batch_size(self, global_batch: int) -> int:
        """Per-replica batch for a global batch.

        Raises:
            ValueError: if `global_batch` does not split evenly over the replicas.
        """
        check_positive_int(global_batch, "global_batch")
        if global_batch % self.num_replicas:
            lower = global_batch - global_batch % self.num_replicas
            upper = lower + self.num_replicas
            raise ValueError(
                f"Global batch {global_batch} does not split evenly over "
                f"{self.num_replicas} replicas; use a multiple of "
                f"{self.num_replicas}, e.g. {lower or upper} or {upper}."
            )
        return global_batch // self.num_replicas

    def distribute(self, dataset, global_batch_size: int, drop_remainder: bool = True):
        """Batches a dataset of single examples for `fit` on this strategy.

        Args:
            dataset: A `tf.data.Dataset` of *unbatched* examples, or arrays /
                a tuple or dict of arrays (sliced along the first axis).
            global_batch_size: Examples per step over all replicas; must be a
                multiple of `num_replicas`.
            drop_remainder: Drop the last partial batch so every batch has the
                same static shape, which XLA on TPU needs. With `False` on a TPU
                a warning says the last batch compiles a second program.

        Returns:
            A batched, prefetched `tf.data.Dataset`; `fit` splits each batch
            over the replicas.
        """
        import tensorflow as tf

        self.per_replica_batch_size(global_batch_size)
        if not isinstance(drop_remainder, bool):
            raise TypeError(f"`drop_remainder` must be a bool, got {drop_remainder!r}.")
        if not isinstance(dataset, tf.data.Dataset):
            try:
                dataset = tf.data.Dataset.from_tensor_slices(dataset)
            except (TypeError, ValueError) as err:
                raise TypeError(
                    "`dataset` must be a tf.data.Dataset of single examples, or arrays / "
                    f"a tuple or dict of arrays; got {type(dataset).__name__}."
                ) from err
        if self.kind == "TPU" and not drop_remainder:
            logger.warning(
                "distribute(drop_remainder=False) on TPU: the last, smaller batch has "
                "another shape, so XLA compiles a second step program for it."
            )
        dataset = dataset.batch(global_batch_size, drop_remainder=drop_remainder)
        return dataset.prefetch(tf.data.AUTOTUNE)

    # ---------------------------------------------------------------- memory
    def replica_devices(self) -> list[str]:
        """Short device names of the replicas, e.g. `["CPU:0", "CPU:1"]`."""
        return [n.split("device:")[-1] for n in devices.replica_device_names(self._strategy)]

    def memory_info(self) -> list[devices.MemoryReading]:
        """Memory of every replica device, each reading naming its source.

        On CPU all logical devices share one allocator, read once and marked
        `shared=True`. Where that allocator keeps no statistics (oneDNN off:
        the default on CPUs without AVX-512, or `TF_ENABLE_ONEDNN_OPTS=0`) the
        readings fall back to the resident memory of the whole process,
        `source="host_rss"` and `process_wide=True`: not HBM, and it includes
        everything the process holds. Bytes are `None` (`source=None`) where
        nothing can read a device.
        """
        capacity = self.hbm_bytes_per_replica
        readings = []
        host = None
        for name in self.replica_devices():
            shared = devices.is_host_device(name)
            if shared:
                # One read for all logical CPUs: they share the host allocator.
                host = host or devices.read_memory_reading("CPU:0", capacity_bytes=capacity,
                                                           shared=True)
                readings.append(dataclasses.replace(host, device=name))
            else:
                readings.append(devices.read_memory_reading(name, capacity_bytes=capacity))
        return readings

    def describe(self) -> str:
        """A few lines saying what was found, why, and how much memory each replica has.

        Each memory line names its source: the device's allocator, or the
        host RSS of the whole process where the CPU allocator keeps no
        statistics.
        """
        lines = [
            f"strategy:  {type(self._strategy).__name__}",
            f"kind:      {self.kind} ({self.device_name})",
            f"replicas:  {self.num_replicas}",
            f"why:       {self.reason}",
            f"HBM/replica: {devices.format_bytes(self.hbm_bytes_per_replica)}",
        ]
        readings = self.memory_info()
        sources = sorted({r.source for r in readings if r.source is not None})
        lines.append("memory source: " + (", ".join(_SOURCE_WORDS[s] for s in sources)
                                          or "none readable"))
        for reading in readings:
            if reading.source == devices.SOURCE_HOST_RSS:
                note = " (host RSS of the whole process, not HBM; shared by all CPU replicas)"
            elif reading.shared:
                note = " (shared host allocator)"
            elif reading.source is None:
                note = " (no allocator statistics on this device)"
            else:
                note = ""
            lines.append(
                f"  {reading.device}: current {devices.format_bytes(reading.current_bytes)}, "
                f"peak {devices.format_bytes(reading.peak_bytes)}{note}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"TPUStrategyWrapper(kind={self.kind!r}, device={self.device_name!r}, "
            f"replicas={self.num_replicas})"
        )
