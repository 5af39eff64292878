"""`TPUStrategyWrapper`: find the accelerator, build the strategy, do the batch arithmetic.

Written once for both backends. What differs lives in the backend's
`strategy` concern (`keras_tpu_mem/backends/<name>/strategy.py`): on
TensorFlow a `tf.distribute` strategy (`TPUStrategy`, `MirroredStrategy`, the
default one), on JAX a `keras.distribution` over `jax.devices()`. Here: the
argument checks, the replica and batch arithmetic, the capacity of a replica,
the memory readings (through `keras_tpu_mem.devices`) and `describe`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

from keras_tpu_mem import backends, devices
from keras_tpu_mem._utils import check_non_negative_int, check_positive_int, logger, unique
from keras_tpu_mem.devices.units import tensor_bytes
from keras_tpu_mem.sharding.distribution import ShardedDataParallel, sharding_concern
from keras_tpu_mem.sharding.rule import check_shard

_SOURCE_WORDS = {
    devices.SOURCE_ALLOCATOR: "allocator statistics of each device",
    devices.SOURCE_HOST_RSS: ("host RSS: the CPU allocator keeps no statistics here (oneDNN "
                              "off), so this is the resident memory of the whole process"),
}


class TPUStrategyWrapper:
    """Finds the best accelerator and builds what distributes the model over it.

    On TensorFlow, a `tf.distribute` strategy. Resolution order: an explicit
    `tpu` (a name, a `grpc://` address or `"local"`), then the `TPU_NAME` /
    Colab (`COLAB_TPU_ADDR`) environment, then a local TPU VM, each giving
    `tf.distribute.TPUStrategy`; else one or more GPUs give
    `MirroredStrategy`; else `logical_cpus=N` gives `MirroredStrategy` over N
    logical CPUs (the CPU stand-in for a multi-replica TPU); else the default
    strategy. A TPU that was asked for (explicitly or by the environment) but
    cannot be reached raises: training silently on the CPU instead would be
    the worse surprise.

    On JAX, a `keras.distribution`: a `DataParallel` over `jax.devices()` (TPU
    chips, else GPUs, else one host CPU device, or `logical_cpus` of them), or
    a `ModelParallel` from a `LayoutMap`. "Replica" then means one
    data-parallel shard of the batch. With `multi_host=True` every process of
    a pod runs the same program and `distribute` gives each its share of every
    global batch.

    With `sharding="all"` or `"optimizer"` (JAX) the distribution is a
    `keras_tpu_mem.sharding.ShardedDataParallel` over the same devices (and
    the `layout_map`'s mesh, if one is given): the model state is split over
    the data-parallel devices, all of it or only the optimizer's slots.

    One log line says what was picked and why.

    Args:
        tpu: `None` to detect, `"local"` for a TPU VM, a TPU name, or a
            `grpc://host:port` address (names and addresses: TensorFlow only;
            JAX uses the chips of the TPU VM it runs on).
        logical_cpus: Without TPU or GPU, mirror over this many logical CPUs
            (TensorFlow: must be set before TensorFlow initialises; JAX: host
            devices, set before JAX starts).
        sharding: `None` (state whole on every replica), `"all"` (weights and
            optimizer slots split over the data-parallel devices) or
            `"optimizer"` (only the slots). JAX only: on TensorFlow anything
            but `None` raises an error naming JAX.
        **options: JAX only (`TypeError` on TensorFlow): `layout_map` (a
            `keras.distribution.LayoutMap`: model parallelism), `mesh_shape`
            (`(batch, model)`: lay `layout_map` over a new mesh of that shape),
            `multi_host` (call `keras.distribution.initialize` first), and
            `coordinator_address`, `num_processes`, `process_id` (passed to it).

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

    def __init__(self, tpu: str | None = None, *, logical_cpus: int | None = None,
                 sharding=None, **options):
        backend = backends.current("TPUStrategyWrapper")
        concern = backend.strategy
        if logical_cpus is not None:
            check_positive_int(logical_cpus, "logical_cpus")
        self.sharding = check_sharding(sharding)
        if sharding is not None:
            sharding_concern(f"TPUStrategyWrapper(sharding={sharding!r})")
            options["sharded"] = functools.partial(ShardedDataParallel, shard=sharding)
        self._placement = concern.place(tpu, logical_cpus, **options)
        self.kind = self._placement.kind
        self.reason = self._placement.reason
        self.multi_host = self._placement.multi_host
        logger.info("%s, because %s.", self._placement.announcement(self.device_name),
                    self.reason)

    # ------------------------------------------------------------- properties
    @property
    def strategy(self):
        """The `tf.distribute.Strategy` that was built (on JAX: the distribution)."""
        return self._placement.strategy

    @property
    def distribution(self):
        """The `keras.distribution.Distribution` that was built (JAX backend)."""
        return self._placement.distribution

    def scope(self):
        """The strategy's scope: build and compile the model inside it."""
        return self._placement.scope()

    @property
    def num_replicas(self) -> int:
        """Replicas in sync (TPU cores or chips, GPUs, logical CPUs; on JAX the
        devices on the mesh's batch axis)."""
        return self._placement.num_replicas

    @property
    def device_name(self) -> str:
        """Human-readable device, e.g. `"TPU v3"`, `"NVIDIA A100-SXM4-40GB"`, `"CPU"`."""
        accelerator = self._placement.accelerator_type()
        if accelerator:
            with contextlib.suppress(ValueError):
                return devices.lookup_tpu(accelerator).device_kind
        return self._placement.device_name()

    @property
    def hbm_bytes_per_replica(self) -> int | None:
        """Accelerator memory of one replica in bytes, or `None` where unknown.

        The runtime's own limit where it tells one (JAX's `bytes_limit`), else
        the TPU table (`ktm.HBM_TABLE`) or a GPU's name.
        """
        limit = self._placement.bytes_limit()
        if limit:
            return limit
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

    def distribute(self, dataset, global_batch_size: int, drop_remainder: bool = True,
                   seed: int | None = None):
        """Batches a dataset of single examples for `fit` on this strategy.

        Args:
            dataset: A `tf.data.Dataset` of *unbatched* examples, or arrays /
                a tuple or dict of arrays (sliced along the first axis).
            global_batch_size: Examples per step over all replicas; must be a
                multiple of `num_replicas`.
            drop_remainder: Drop the last partial batch so every batch has the
                same static shape, which XLA needs. With `False` on a TPU
                (TensorFlow) a warning says the last batch compiles a second
                program.
            seed: Shuffle arrays with each epoch's order a pure function of
                `seed` and the epoch (`keras_tpu_mem.epoch_order.EpochOrder`):
                every run, a restarted one too, reads epoch `e` in the same
                order, which `ResumableCheckpoint` needs to resume mid-epoch
                exactly (it sets the epoch a restarted `fit` resumes at). Pass
                the result to `fit` with `shuffle=False`. Arrays only: a
                `tf.data.Dataset` orders itself. None: the arrays' own order.

        Returns:
            On TensorFlow, and for a `tf.data.Dataset`: a batched, prefetched
            `tf.data.Dataset`; `fit` splits each batch over the replicas. On
            JAX, for arrays: a `keras.utils.PyDataset` of static global
            batches; under several processes each process's batches hold its
            own share of every global batch. With `seed`, its `epoch_order`
            attribute is the `EpochOrder`.

        Example:

        ```python
        import numpy as np
        import keras_tpu_mem as ktm

        wrapper = ktm.TPUStrategyWrapper()
        x = np.random.rand(256, 8).astype("float32")
        y = np.random.randint(0, 2, 256)
        batches = wrapper.distribute((x, y), global_batch_size=32, seed=7)
        # model.fit(batches, epochs=3, shuffle=False, callbacks=[ktm.ResumableCheckpoint(...)])
        ```
        """
        self.per_replica_batch_size(global_batch_size)
        if not isinstance(drop_remainder, bool):
            raise TypeError(f"`drop_remainder` must be a bool, got {drop_remainder!r}.")
        if seed is not None:
            check_non_negative_int(seed, "seed")
            if type(dataset).__module__.startswith("tensorflow"):
                raise TypeError(
                    "`seed` orders arrays (an array, or a tuple or dict of arrays); a "
                    f"{type(dataset).__name__} cannot be reordered by index. Pass the "
                    "arrays, or order the tf.data.Dataset yourself the same way at every "
                    "run.")
        return self._placement.batches(dataset, global_batch_size, drop_remainder, seed)

    # ---------------------------------------------------------------- memory
    def replica_devices(self) -> list[str]:
        """Short device names of the replicas, e.g. `["CPU:0", "CPU:1"]` (on JAX:
        this process's devices)."""
        return [name for name, _ in self._placement.replica_devices()]

    def memory_info(self) -> list[devices.MemoryReading]:
        """Memory of every replica device, each reading naming its source.

        All host (CPU) devices share one allocator, read once and marked
        `shared=True`. Where that allocator keeps no statistics (TensorFlow
        with oneDNN off: the default on CPUs without AVX-512, or
        `TF_ENABLE_ONEDNN_OPTS=0`; JAX's CPU devices always) the readings fall
        back to the resident memory of the whole process, `source="host_rss"`
        and `process_wide=True`: not HBM, and it includes everything the
        process holds. Bytes are `None` (`source=None`) where nothing can read
        a device.
        """
        capacity = self.hbm_bytes_per_replica
        readings = []
        host = None
        for name, device in self._placement.replica_devices():
            if devices.is_host_device(device):
                # One read for all host devices: they share the host allocator.
                host = host or devices.read_memory_reading(device, capacity_bytes=capacity,
                                                           shared=True)
                readings.append(dataclasses.replace(host, device=name))
            else:
                readings.append(devices.read_memory_reading(device, capacity_bytes=capacity))
        return readings

    def describe(self, model=None) -> str:
        """A few lines saying what was found, why, and how much memory each replica has.

        Each memory line names its source: the device's allocator, or the
        host RSS of the whole process where the CPU allocator keeps no
        statistics. A line says how much model state each device holds: with
        `model`, its weights' and optimizer's bytes on one device (read from
        where the values lie) against the whole state; without, the rule.

        Args:
            model: Optional `keras.Model` built in `scope()`.
        """
        lines = [
            f"strategy:  {type(self.strategy).__name__}",
            f"kind:      {self.kind} ({self.device_name})",
            f"replicas:  {self.num_replicas}",
            f"why:       {self.reason}",
            f"HBM/replica: {devices.format_bytes(self.hbm_bytes_per_replica)}",
            self._state_line(model),
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

    def _state_line(self, model) -> str:
        if model is None:
            if self.sharding is None:
                return "model state: whole on every replica (sharding=None)"
            what = ("weights and optimizer slots" if self.sharding == "all"
                    else "optimizer slots (weights whole)")
            return (f"model state: {what} split over the {self.num_replicas} data-parallel "
                    f"devices: each holds 1/{self.num_replicas} of every such variable with a "
                    f"dimension {self.num_replicas} divides, the rest whole "
                    f"(sharding={self.sharding!r})")
        optimizer = getattr(model, "optimizer", None)
        weights = unique(model.weights)
        slots = [v for v in unique(optimizer.variables if optimizer is not None else [])
                 if id(v) not in {id(w) for w in weights}]
        held_w = self._placement.state_bytes(weights)
        held_o = self._placement.state_bytes(slots)
        whole = sum(tensor_bytes(v) for v in [*weights, *slots])
        share = (held_w + held_o) / whole if whole else 1.0
        return (f"model state per device: {devices.format_bytes(held_w + held_o)} "
                f"(weights {devices.format_bytes(held_w)}, optimizer "
                f"{devices.format_bytes(held_o)}) of {devices.format_bytes(whole)} in all "
                f"({share:.2f}x; sharding={self.sharding!r})")

    def __repr__(self) -> str:
        sharded = [f"sharding={self.sharding!r}"] if self.sharding is not None else []
        fields = [*self._placement.repr_fields, *sharded, f"kind={self.kind!r}",
                  f"device={self.device_name!r}", f"replicas={self.num_replicas}"]
        return f"TPUStrategyWrapper({', '.join(fields)})"


def check_sharding(sharding):
    """`TPUStrategyWrapper(sharding=...)`: "all", "optimizer" or None."""
    try:
        return check_shard(sharding)
    except ValueError:
        raise ValueError(f'`sharding` must be "all", "optimizer" or None, got '
                         f"{sharding!r}.") from None
