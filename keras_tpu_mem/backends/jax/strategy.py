"""`TPUStrategyWrapper` on JAX: devices and `keras.distribution`.

On JAX there is no strategy object and no TPU address: `jax.devices()` lists
the accelerators the process can use (a TPU VM's chips, the GPUs, or host CPU
devices), and `keras.distribution` says how state and data are laid out over
them. The wrapper builds a `keras.distribution.DataParallel` over every
device, or a `ModelParallel` when a `LayoutMap` is given. "Replica" means one
data-parallel shard of the batch: a device under `DataParallel`, a row of the
mesh's batch axis under `ModelParallel`.

Multi-host (TPU pods, or several processes on one machine):
`multi_host=True` calls `keras.distribution.initialize()` (which wraps
`jax.distributed.initialize`) before it looks at the devices; pass
`coordinator_address`, `num_processes` and `process_id` where the environment
does not say them (on Cloud TPU pods JAX finds them itself). Each process then
feeds its own share of every global batch (`keras_tpu_mem.array_batches.ArrayBatches`
slices it), and the distribution is built with `auto_shard_dataset=False`.

Contract: `keras_tpu_mem.backends.contracts.Strategy`.
"""

from __future__ import annotations

import math
import os

import jax
import keras

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.array_batches import array_batches
from keras_tpu_mem.backends.jax import sharding
from keras_tpu_mem.backends.mesh import axis_size

_PLATFORM_KIND = {"tpu": "TPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "cpu": "CPU"}


def place(tpu: str | None, logical_cpus: int | None, **options) -> Placement:
    """Lays a `keras.distribution` over `jax.devices()` (see the module docstring).

    Args (`options`: `layout_map`, `mesh_shape`, `multi_host`, `coordinator_address`,
    `num_processes`, `process_id`, `sharded`):
        tpu: `None` or `"local"`: JAX finds the TPU chips of a TPU VM itself.
            A TPU name or `grpc://` address belongs to TensorFlow's TPUStrategy
            and is refused with an explanation.
        logical_cpus: Without TPU or GPU, lay the model over this many host CPU
            devices (needs `XLA_FLAGS=--xla_force_host_platform_device_count=N`
            before JAX starts; set here when JAX has not started yet).
        layout_map: A `keras.distribution.LayoutMap` for model parallelism;
            with it a `ModelParallel` on its mesh.
        mesh_shape: `(batch, model)` device counts: lays `layout_map` over a
            new mesh of that shape instead of the layout map's own mesh. Only
            with `layout_map`.
        multi_host: Call `keras.distribution.initialize` first (pods, several
            processes).
        coordinator_address, num_processes, process_id: Passed to
            `keras.distribution.initialize` with `multi_host=True`.
        sharded: Optional factory of a sharded distribution (the front's
            `ShardedDataParallel` with its `shard`), called with `devices=`
            or with `layout_map=` and `axis_name=`, and `auto_shard_dataset=`;
            without it a `DataParallel` or `ModelParallel`.

    Raises:
        TypeError: an argument of neither backend, or a `layout_map` that is
            not a `LayoutMap`.
    """
    return _place(tpu, logical_cpus, **options)


def _place(tpu, logical_cpus, *, layout_map=None, mesh_shape=None, multi_host: bool = False,
           coordinator_address: str | None = None, num_processes: int | None = None,
           process_id: int | None = None, sharded=None, **unexpected) -> Placement:
    if unexpected:
        raise TypeError(f"TPUStrategyWrapper got unexpected keyword arguments: "
                        f"{', '.join(sorted(unexpected))}.")
    if tpu not in (None, "local"):
        raise ValueError(
            f"tpu={tpu!r}: on the JAX backend the TPU is not addressed by name: JAX "
            "uses the chips of the TPU VM it runs on (tpu=None or 'local'). For a pod "
            "slice, run the same program on every host with multi_host=True.")
    if logical_cpus is not None:
        _request_host_devices(logical_cpus)
    if not isinstance(multi_host, bool):
        raise TypeError(f"`multi_host` must be a bool, got {multi_host!r}.")
    if multi_host:
        keras.distribution.initialize(job_addresses=coordinator_address,
                                      num_processes=num_processes, process_id=process_id)
    multi_host = multi_host or jax.process_count() > 1
    all_devices = jax.devices()
    platform = all_devices[0].platform
    kind = _PLATFORM_KIND.get(platform, platform.upper())
    reason = f"jax.devices() lists {len(all_devices)} {platform} device(s)"
    if kind == "CPU" and logical_cpus is not None and len(all_devices) != logical_cpus:
        raise RuntimeError(
            f"logical_cpus={logical_cpus}, but JAX already runs with {len(all_devices)} "
            "host device(s). Set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{logical_cpus} before JAX starts (first thing in the process, or restart "
            "the runtime in Colab).")
    if kind == "CPU" and logical_cpus is None:
        all_devices = all_devices[:1]
        reason += "; no TPU or GPU, and no logical_cpus: one host device"
    distribution = _build_distribution(all_devices, layout_map, mesh_shape,
                                       auto_shard=not multi_host, sharded=sharded)
    return Placement(distribution, all_devices, kind, reason, multi_host)


def _build_distribution(devices, layout_map, mesh_shape, *, auto_shard, sharded=None):
    if layout_map is None:
        if mesh_shape is not None:
            raise ValueError("`mesh_shape` needs a `layout_map` (model parallelism).")
        if sharded is not None:
            return sharded(devices=devices, auto_shard_dataset=auto_shard)
        return keras.distribution.DataParallel(devices=devices, auto_shard_dataset=auto_shard)
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        raise TypeError("`layout_map` must be a keras.distribution.LayoutMap, got "
                        f"{type(layout_map).__name__}.")
    mesh = layout_map.device_mesh
    if mesh_shape is not None:
        shape = tuple(mesh_shape)
        if len(shape) != 2 or math.prod(shape) != len(devices):
            raise ValueError(
                f"`mesh_shape` must be (batch, model) with batch * model = "
                f"{len(devices)} devices; got {mesh_shape!r}.")
        mesh = keras.distribution.DeviceMesh(shape, mesh.axis_names[:2], devices)
        # ModelParallel takes its mesh from the layout map: the same layouts
        # (axis names per dimension) on the new mesh.
        regrid = keras.distribution.LayoutMap(mesh)
        for key in layout_map:
            regrid[key] = tuple(layout_map[key].axes)
        layout_map = regrid
    if sharded is not None:
        return sharded(layout_map=layout_map, axis_name=mesh.axis_names[0],
                       auto_shard_dataset=auto_shard)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=mesh.axis_names[0],
        auto_shard_dataset=auto_shard)


def _request_host_devices(count: int) -> None:
    """Asks XLA for `count` host devices if JAX has not started its backends yet."""
    flag = f"--xla_force_host_platform_device_count={count}"
    current = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in current:
        return
    if not jax_compat.backends_initialized():
        os.environ["XLA_FLAGS"] = f"{current} {flag}".strip()


class Placement:
    """A `keras.distribution` and what `TPUStrategyWrapper` reads off it.

    Args:
        distribution: The `DataParallel` or `ModelParallel` that was built.
        devices: The `jax.Device`s it was laid over.
        kind: `"TPU"`, `"GPU"` or `"CPU"`.
        reason: Why, in words.
        multi_host: Whether several processes feed the distribution.
    """

    repr_fields = ("backend='jax'",)

    def __init__(self, distribution, devices, kind: str, reason: str, multi_host: bool):
        self.strategy = self.distribution = distribution
        self.devices = devices
        self.kind = kind
        self.reason = reason
        self.multi_host = multi_host

    @property
    def num_replicas(self) -> int:
        """Data-parallel shards of the batch (devices on the mesh's batch axis)."""
        mesh = self.distribution.device_mesh
        name = getattr(self.distribution, "batch_dim_name", None) or mesh.axis_names[0]
        return axis_size(mesh, name)

    def scope(self):
        return self.distribution.scope()

    def accelerator_type(self) -> str | None:
        """JAX names the device itself (`device_kind`): no environment to read."""
        return None

    def device_name(self) -> str:
        if self.kind == "CPU":
            return "CPU"
        return getattr(self.devices[0], "device_kind", "") or self.kind

    def bytes_limit(self) -> int | None:
        """The first device's `bytes_limit` from its runtime's `memory_stats()`."""
        try:
            stats = self.devices[0].memory_stats() or {}
        except Exception:  # some runtimes raise instead of returning None
            stats = {}
        return int(stats["bytes_limit"]) if stats.get("bytes_limit") else None

    def replica_devices(self) -> list[tuple[str, object]]:
        """`(short name, jax.Device)` per device of this process, e.g. `("TPU:0", ...)`."""
        local = jax.process_index()
        return [(f"{self.kind}:{d.id}", d) for d in self.devices if d.process_index == local]

    def batches(self, dataset, global_batch_size: int, drop_remainder: bool, seed=None):
        """`ArrayBatches` of arrays, or a batched `tf.data.Dataset` for a `tf.data` input."""
        if type(dataset).__module__.startswith("tensorflow"):
            # Only a tf.data input brings TensorFlow in; a JAX run never imports it.
            import tensorflow as tf

            if isinstance(dataset, tf.data.Dataset):
                return dataset.batch(global_batch_size, drop_remainder=drop_remainder
                                     ).prefetch(tf.data.AUTOTUNE)
        return array_batches(
            dataset, global_batch_size, "arrays / a tuple or dict of arrays (or a "
            "tf.data.Dataset where TensorFlow is installed)", drop_remainder=drop_remainder,
            process_index=jax.process_index(), process_count=jax.process_count(), seed=seed)

    def state_bytes(self, variables) -> int:
        """Bytes of `variables` one device holds, from their values' shardings."""
        return sum(sharding.device_bytes(v) for v in variables)

    def announcement(self, device_name: str) -> str:
        return (f"TPUStrategyWrapper (JAX): {type(self.distribution).__name__} over "
                f"{len(self.devices)} device(s) ({self.num_replicas} data-parallel), on "
                f"{device_name}")


# ----------------------------------------------------------- placement
# Contract: `contracts.Strategy`. On JAX variables are laid
# out by the active `keras.distribution`, not by a strategy: a model has no
# strategy, no variable an owner, no strategy is active; a teacher always runs as
# it is.


def training_strategy(model):
    return None


def variable_owner(variable):
    return None


def active_strategy():
    return None


def replica_runner(fn, strategy):
    raise ValueError(
        "cache_teacher_logits runs the teacher on a tf.data.Dataset under tf.distribute, "
        "which needs the Keras TensorFlow backend. On JAX pass arrays instead, "
        "cache_teacher_logits(teacher, (x, y), batch_size=...), which returns a "
        "ktm.TeacherLogits PyDataset (saved with path='....npz').")
