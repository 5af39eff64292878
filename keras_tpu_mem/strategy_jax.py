"""`TPUStrategyWrapper` on the JAX backend: devices and `keras.distribution`.

On JAX there is no strategy object and no TPU address: `jax.devices()` lists
the accelerators the process can use (a TPU VM's chips, the GPUs, or host CPU
devices), and `keras.distribution` says how state and data are laid out over
them. `TPUStrategyWrapper()` with `KERAS_BACKEND=jax` returns a
`JaxTPUStrategyWrapper`: the same members (`scope()`, `num_replicas`, the
batch arithmetic, `hbm_bytes_per_replica`, `distribute`, `memory_info`,
`describe`), built on a `keras.distribution.DataParallel` over every device,
or a `ModelParallel` when a `LayoutMap` is given. "Replica" means one
data-parallel shard of the batch: a device under `DataParallel`, a row of the
mesh's batch axis under `ModelParallel`.

Multi-host (TPU pods, or several processes on one machine):
`TPUStrategyWrapper(multi_host=True)` calls `keras.distribution.initialize()`
(which wraps `jax.distributed.initialize`) before it looks at the devices;
pass `coordinator_address`, `num_processes` and `process_id` where the
environment does not say them (on Cloud TPU pods JAX finds them itself). Each
process then feeds its own share of every global batch (`distribute` slices
it), and the distribution is built with `auto_shard_dataset=False`.
"""

from __future__ import annotations

import math
import os

import keras
import numpy as np

from keras_tpu_mem import devices
from keras_tpu_mem._utils import check_positive_int, logger
from keras_tpu_mem.strategy import TPUStrategyWrapper

_PLATFORM_KIND = {"tpu": "TPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "cpu": "CPU"}


class ArrayBatches(keras.utils.PyDataset):
    """Static global batches of in-memory arrays, in order, for `fit` on JAX.

    Every batch has exactly `global_batch_size` rows (the last partial batch
    is dropped unless `drop_remainder=False`), so XLA compiles one step. Under
    several processes each yields only its own rows of every global batch,
    which is what `keras.distribution` expects of each process's input.
    """

    def __init__(self, data, global_batch_size, *, drop_remainder=True,
                 process_index=0, process_count=1):
        super().__init__()
        self.data = data
        leaves = keras.tree.flatten(data)
        if not leaves:
            raise ValueError("`dataset` holds no arrays.")
        lengths = {len(leaf) for leaf in leaves}
        if len(lengths) != 1:
            raise ValueError(
                f"Every array in `dataset` needs the same length; got {sorted(lengths)}.")
        self.num_examples = lengths.pop()
        self.global_batch_size = global_batch_size
        self.process_index, self.process_count = process_index, process_count
        if global_batch_size % process_count:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not split over "
                f"{process_count} processes; use a multiple of {process_count}.")
        full, rest = divmod(self.num_examples, global_batch_size)
        self._batches = full + (1 if rest and not drop_remainder else 0)
        if self._batches == 0:
            raise ValueError(
                f"`dataset` has {self.num_examples} examples, fewer than one global batch of "
                f"{global_batch_size}.")

    def __len__(self):
        return self._batches

    def __getitem__(self, index):
        if not 0 <= index < self._batches:
            raise IndexError(index)
        start = index * self.global_batch_size
        stop = min(start + self.global_batch_size, self.num_examples)
        share = (stop - start) // self.process_count
        begin = start + self.process_index * share
        rows = slice(begin, begin + share)
        batch = keras.tree.map_structure(lambda a: a[rows], self.data)
        return tuple(batch) if isinstance(batch, list) else batch


class JaxTPUStrategyWrapper(TPUStrategyWrapper):
    """`TPUStrategyWrapper` for `KERAS_BACKEND=jax` (see the module docstring).

    Args:
        tpu: `None` or `"local"`: JAX finds the TPU chips of a TPU VM itself.
            A TPU name or `grpc://` address belongs to TensorFlow's TPUStrategy
            and is refused with an explanation.
        logical_cpus: Without TPU or GPU, lay the model over this many host CPU
            devices (needs `XLA_FLAGS=--xla_force_host_platform_device_count=N`
            before JAX starts; set here when JAX has not started yet).
        layout_map: A `keras.distribution.LayoutMap` for model parallelism;
            with it the wrapper builds a `ModelParallel` on its mesh.
        mesh_shape: `(batch, model)` device counts: lays `layout_map` over a
            new mesh of that shape instead of the layout map's own mesh. Only
            with `layout_map`.
        multi_host: Call `keras.distribution.initialize` first (pods, several
            processes).
        coordinator_address, num_processes, process_id: Passed to
            `keras.distribution.initialize` with `multi_host=True`.

    Example:

    ```python
    import os
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import keras_tpu_mem as ktm

    tpu = ktm.TPUStrategyWrapper()        # TPU chips -> GPUs -> host CPU
    with tpu.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="mse")
    print(tpu.describe())
    ```
    """

    def __init__(self, tpu: str | None = None, *, logical_cpus: int | None = None,
                 layout_map=None, mesh_shape=None, multi_host: bool = False,
                 coordinator_address: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None):
        if tpu not in (None, "local"):
            raise ValueError(
                f"tpu={tpu!r}: on the JAX backend the TPU is not addressed by name: JAX "
                "uses the chips of the TPU VM it runs on (tpu=None or 'local'). For a pod "
                "slice, run the same program on every host with multi_host=True.")
        if logical_cpus is not None:
            check_positive_int(logical_cpus, "logical_cpus")
            _request_host_devices(logical_cpus)
        if not isinstance(multi_host, bool):
            raise TypeError(f"`multi_host` must be a bool, got {multi_host!r}.")
        if multi_host:
            keras.distribution.initialize(job_addresses=coordinator_address,
                                          num_processes=num_processes, process_id=process_id)
        import jax

        self._jax = jax
        self._tpu_address = None
        self._resolver = None
        self._gpu_details = None
        self.multi_host = multi_host or jax.process_count() > 1
        all_devices = jax.devices()
        platform = all_devices[0].platform
        self.kind = _PLATFORM_KIND.get(platform, platform.upper())
        reason = f"jax.devices() lists {len(all_devices)} {platform} device(s)"
        if self.kind == "CPU" and logical_cpus is not None and len(all_devices) != logical_cpus:
            raise RuntimeError(
                f"logical_cpus={logical_cpus}, but JAX already runs with {len(all_devices)} "
                "host device(s). Set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{logical_cpus} before JAX starts (first thing in the process, or restart "
                "the runtime in Colab).")
        if self.kind == "CPU" and logical_cpus is None:
            all_devices = all_devices[:1]
            reason += "; no TPU or GPU, and no logical_cpus: one host device"
        self._devices = all_devices
        self._strategy = self._build_distribution(layout_map, mesh_shape)
        self.reason = reason
        logger.info(
            "TPUStrategyWrapper (JAX): %s over %d device(s) (%d data-parallel), on %s, "
            "because %s.", type(self._strategy).__name__, len(self._devices),
            self.num_replicas, self.device_name, reason)

    def _build_distribution(self, layout_map, mesh_shape):
        auto_shard = not self.multi_host
        if layout_map is None:
            if mesh_shape is not None:
                raise ValueError("`mesh_shape` needs a `layout_map` (model parallelism).")
            return keras.distribution.DataParallel(devices=self._devices,
                                                   auto_shard_dataset=auto_shard)
        if not isinstance(layout_map, keras.distribution.LayoutMap):
            raise TypeError("`layout_map` must be a keras.distribution.LayoutMap, got "
                            f"{type(layout_map).__name__}.")
        mesh = layout_map.device_mesh
        if mesh_shape is not None:
            shape = tuple(mesh_shape)
            if len(shape) != 2 or math.prod(shape) != len(self._devices):
                raise ValueError(
                    f"`mesh_shape` must be (batch, model) with batch * model = "
                    f"{len(self._devices)} devices; got {mesh_shape!r}.")
            mesh = keras.distribution.DeviceMesh(shape, mesh.axis_names[:2], self._devices)
            # ModelParallel takes its mesh from the layout map: the same layouts
            # (axis names per dimension) on the new mesh.
            regrid = keras.distribution.LayoutMap(mesh)
            for key in layout_map:
                regrid[key] = tuple(layout_map[key].axes)
            layout_map = regrid
        return keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name=mesh.axis_names[0],
            auto_shard_dataset=auto_shard)

    # ------------------------------------------------------------- properties
    @property
    def distribution(self):
        """The `keras.distribution.Distribution` that was built."""
        return self._strategy

    @property
    def num_replicas(self) -> int:
        """Data-parallel shards of the batch (devices on the mesh's batch axis)."""
        mesh = self._strategy.device_mesh
        name = getattr(self._strategy, "batch_dim_name", None) or mesh.axis_names[0]
        return int(mesh.shape[mesh.axis_names.index(name)])

    @property
    def device_name(self) -> str:
        kind = getattr(self._devices[0], "device_kind", "") or ""
        if self.kind == "CPU":
            return "CPU"
        return kind or self.kind

    @property
    def hbm_bytes_per_replica(self) -> int | None:
        """Memory of one device: the runtime's `bytes_limit`, else the TPU table."""
        stats = _memory_stats(self._devices[0])
        if stats and stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
        return super().hbm_bytes_per_replica   # the TPU table, a GPU's name

    # ------------------------------------------------------------------ data
    def distribute(self, dataset, global_batch_size: int, drop_remainder: bool = True):
        """Static global batches for `fit`.

        Args:
            dataset: Arrays / a tuple or dict of arrays (sliced along the first
                axis), or, where TensorFlow is installed, a `tf.data.Dataset`
                of single examples.
            global_batch_size: Examples per step over all devices; a multiple
                of `num_replicas`.
            drop_remainder: Drop the last partial batch (one static shape, one
                XLA program).

        Returns:
            A `keras.utils.PyDataset` of global batches (arrays), or a batched
            `tf.data.Dataset` for a `tf.data` input. Under several processes
            each process's batches hold its own share of every global batch.
        """
        self.per_replica_batch_size(global_batch_size)
        if not isinstance(drop_remainder, bool):
            raise TypeError(f"`drop_remainder` must be a bool, got {drop_remainder!r}.")
        if type(dataset).__module__.startswith("tensorflow"):
            import tensorflow as tf

            if isinstance(dataset, tf.data.Dataset):
                return dataset.batch(global_batch_size, drop_remainder=drop_remainder
                                     ).prefetch(tf.data.AUTOTUNE)
        try:
            data = keras.tree.map_structure(np.asarray, dataset)
        except Exception as err:
            raise TypeError(
                "`dataset` must be arrays / a tuple or dict of arrays (or a tf.data.Dataset "
                f"where TensorFlow is installed); got {type(dataset).__name__}.") from err
        jax = self._jax
        return ArrayBatches(data, global_batch_size, drop_remainder=drop_remainder,
                            process_index=jax.process_index(),
                            process_count=jax.process_count())

    # ---------------------------------------------------------------- memory
    def replica_devices(self) -> list[str]:
        """Short names of this process's devices, e.g. `["TPU:0", "TPU:1"]`."""
        return [f"{self.kind}:{d.id}" for d in self._devices
                if d.process_index == self._jax.process_index()]

    def memory_info(self) -> list[devices.MemoryReading]:
        """Memory of every device of this process.

        TPU and GPU devices report their runtime's `memory_stats()` (bytes in
        use, peak, `bytes_limit` as the capacity). JAX's CPU devices report
        nothing: there the figures are the whole process's resident memory
        (source `"host_rss"`), shared by all host devices.
        """
        readings = []
        local = [d for d in self._devices if d.process_index == self._jax.process_index()]
        for device, name in zip(local, self.replica_devices()):
            stats = _memory_stats(device)
            if stats:
                readings.append(devices.MemoryReading(
                    name, int(stats.get("bytes_in_use", 0)),
                    int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0))),
                    int(stats["bytes_limit"]) if stats.get("bytes_limit") else
                    self.hbm_bytes_per_replica, False, devices.SOURCE_ALLOCATOR))
                continue
            current, peak = devices.read_host_memory()
            readings.append(devices.MemoryReading(
                name, current, peak, None, True, devices.SOURCE_HOST_RSS, True))
        return readings

    def __repr__(self) -> str:
        return (f"TPUStrategyWrapper(backend='jax', kind={self.kind!r}, "
                f"device={self.device_name!r}, replicas={self.num_replicas})")


def _memory_stats(device) -> dict | None:
    try:
        return device.memory_stats() or None
    except Exception:  # some runtimes raise instead of returning None
        return None


def _request_host_devices(count: int) -> None:
    """Asks XLA for `count` host devices if JAX has not started its backends yet."""
    flag = f"--xla_force_host_platform_device_count={count}"
    current = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in current:
        return
    from keras_tpu_mem._compat import jax as jax_compat

    if not jax_compat.backends_initialized():
        os.environ["XLA_FLAGS"] = f"{current} {flag}".strip()
