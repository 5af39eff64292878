"""`TPUStrategyWrapper` on TensorFlow: find the accelerator, build the `tf.distribute` strategy.

Resolution order: an explicit `tpu` (a name, a `grpc://` address or
`"local"`), then the `TPU_NAME` / Colab (`COLAB_TPU_ADDR`) environment, then a
local TPU VM, each giving `tf.distribute.TPUStrategy`; else one or more GPUs
give `MirroredStrategy`; else `logical_cpus=N` gives `MirroredStrategy` over N
logical CPUs (the CPU stand-in for a multi-replica TPU); else the default
strategy.

Contract: `keras_tpu_mem.backends.contracts.Strategy`. Resolving a TPU's address,
configuring logical CPUs and the process-wide strategies are TensorFlow's own, in
the `cluster` concern (`contracts.Cluster`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import keras
import numpy as np
import tensorflow as tf

from keras_tpu_mem._utils import logger
from keras_tpu_mem.array_batches import array_batches
from keras_tpu_mem.backends.tensorflow.cluster import (
    mirrored_logical_cpus,
    resolve_tpu_address,
    shared_strategy,
)

# The keyword arguments of the JAX backend's wrapper (keras.distribution).
_JAX_ONLY_ARGUMENTS = frozenset(
    {"layout_map", "mesh_shape", "multi_host", "coordinator_address", "num_processes",
     "process_id"})


def _check_options(options: Mapping) -> None:
    """Refuses the JAX backend's keyword arguments (they describe a `keras.distribution`).

    Raises:
        TypeError: naming the JAX-only arguments that were passed.
    """
    jax_only = sorted(set(options) & _JAX_ONLY_ARGUMENTS)
    if jax_only:
        raise TypeError(
            f"TPUStrategyWrapper: {', '.join(jax_only)} belong to the JAX backend "
            "(keras.distribution); on TensorFlow use tf.distribute (tpu=..., "
            "logical_cpus=...).")
    if options:
        raise TypeError(f"TPUStrategyWrapper got unexpected keyword arguments: "
                        f"{', '.join(sorted(options))}.")


def place(tpu: str | None, logical_cpus: int | None, **options) -> Placement:
    """Connects the TPU, or mirrors over GPUs or logical CPUs (see the module docstring).

    Raises:
        TypeError: JAX-only keyword arguments, or a `tpu` that is not a str.
        RuntimeError: a TPU was asked for but cannot be reached: training
            silently on the CPU instead would be the worse surprise.
    """
    _check_options(options)
    address, reason = resolve_tpu_address(tpu)
    if address is not None:
        return Placement(_connect_tpu(address, reason), "TPU", reason)
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if logical_cpus is not None:
            logger.warning(
                "TPUStrategyWrapper: logical_cpus=%d ignored because %d GPU(s) "
                "were found; GPUs take precedence.", logical_cpus, len(gpus)
            )
        try:
            details = tf.config.experimental.get_device_details(gpus[0])
        except Exception:  # details are cosmetic; never fail on them
            details = {}
        strategy = shared_strategy(("GPU",), tf.distribute.MirroredStrategy)
        return Placement(strategy, "GPU", f"{reason}; found {len(gpus)} GPU(s)",
                         gpu_name=details.get("device_name"))
    if logical_cpus is not None:
        return Placement(mirrored_logical_cpus(logical_cpus), "CPU",
                         f"{reason}; no GPU; logical_cpus={logical_cpus} requested")
    return Placement(tf.distribute.get_strategy(), "CPU", f"{reason}; no GPU")


def _connect_tpu(address: str, reason: str):
    def connect():
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
        if address != "local":
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)

    try:
        return shared_strategy(("TPU", address), connect)
    except Exception as err:  # TF raises many types here; re-raise with context.
        raise RuntimeError(
            f"A TPU was requested ({reason}) but connecting to {address!r} failed: "
            f"{err}. Check that this runtime has a TPU and that the TensorFlow "
            "build supports it (TPU VMs need `tensorflow-tpu` or a TPU-enabled "
            "TensorFlow; see the README). Unset TPU_NAME / COLAB_TPU_ADDR to "
            "train without a TPU."
        ) from err


class Placement:
    """A `tf.distribute.Strategy` and what `TPUStrategyWrapper` reads off it.

    Args:
        strategy: The strategy that was built.
        kind: `"TPU"`, `"GPU"` or `"CPU"`.
        reason: Why, in words.
        gpu_name: The first GPU's name from its device details, where known.
    """

    multi_host = False
    repr_fields: tuple[str, ...] = ()

    def __init__(self, strategy, kind: str, reason: str, *, gpu_name: str | None = None):
        self.strategy = strategy
        self.kind = kind
        self.reason = reason
        self._gpu_name = gpu_name

    @property
    def distribution(self):
        raise AttributeError(
            "TPUStrategyWrapper.distribution is the JAX backend's keras.distribution; on "
            "TensorFlow the wrapper builds a tf.distribute strategy: use .strategy.")

    @property
    def num_replicas(self) -> int:
        """Replicas in sync (TPU cores or chips, GPUs, logical CPUs)."""
        return int(self.strategy.num_replicas_in_sync)

    def scope(self):
        return self.strategy.scope()

    def accelerator_type(self) -> str | None:
        """The TPU VM's `TPU_ACCELERATOR_TYPE` (e.g. `"v4-8"`) where it says one."""
        return os.environ.get("TPU_ACCELERATOR_TYPE") if self.kind == "TPU" else None

    def device_name(self) -> str:
        if self.kind == "TPU":
            for device in tf.config.list_logical_devices("TPU")[:1]:
                try:
                    kind = tf.config.experimental.get_device_details(device).get("device_kind")
                except Exception:
                    kind = None
                if kind:
                    return kind
            return "TPU (generation unknown)"
        if self.kind == "GPU":
            return self._gpu_name or "GPU"
        return "CPU"

    def bytes_limit(self) -> int | None:
        """TensorFlow's allocators tell no capacity: the wrapper uses the tables."""
        return None

    def replica_devices(self) -> list[tuple[str, str]]:
        """`(short name, short name)` per replica, e.g. `("CPU:1", "CPU:1")`."""
        try:
            names = [n.split("device:")[-1] for n in self.strategy.extended.worker_devices]
        except (RuntimeError, AttributeError, NotImplementedError):
            names = []
        # The default strategy lists no replica; `place` builds it only where
        # there is no GPU, so its one replica runs on the CPU.
        return [(name, name) for name in names or ["CPU:0"]]

    def batches(self, dataset, global_batch_size: int, drop_remainder: bool, seed=None):
        """A batched, prefetched `tf.data.Dataset` of `dataset`'s single examples; with
        `seed`, `ArrayBatches` of arrays in each epoch's `EpochOrder` (a
        `keras.utils.PyDataset`: Keras ends its epochs from the fit loop, where a tf.data
        pipeline's prefetch would read the next epoch's first rows before it ends)."""
        if seed is not None:
            return array_batches(dataset, global_batch_size,
                                 "arrays / a tuple or dict of arrays with `seed`",
                                 drop_remainder=drop_remainder, seed=seed)
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

    def state_bytes(self, variables) -> int:
        """Bytes of `variables` one replica holds: all of them (tf.distribute mirrors
        every variable whole on each replica)."""
        return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)

    def announcement(self, device_name: str) -> str:
        return (f"TPUStrategyWrapper: {type(self.strategy).__name__} with "
                f"{self.num_replicas} replica(s) on {device_name}")


# ----------------------------------------------------------- placement
# Where a model's variables live and how a function runs on every replica: what
# the distillation teacher's placement and logits cache, and the bfloat16 notice,
# read (the same functions in `backends/jax/strategy.py`):
# `training_strategy(model)`, `variable_owner(variable)` (the strategy a Keras
# variable is distributed by, None for a plain one), `active_strategy()` (the
# strategy whose scope is entered, None outside any), `replica_runner(fn,
# strategy)` (`call(x) -> dict of numpy arrays`, `fn` compiled on every replica,
# each on its slice of the batch, results in batch order).

def training_strategy(model):
    """The strategy `model`'s variables are made under and it trains under."""
    return model.distribute_strategy


def variable_owner(variable):
    # The TensorFlow variable behind a Keras variable.
    tf_var = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(tf_var, tf.distribute.DistributedValues):
        return tf_var.distribute_strategy
    return None


def active_strategy():
    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


def replica_runner(fn, strategy):
    replicas = strategy.num_replicas_in_sync

    @tf.function(reduce_retracing=True, autograph=False)
    def run(per_replica_x):
        return strategy.run(fn, args=(per_replica_x,))

    def call(x):
        size = int(tf.shape(tf.nest.flatten(x)[0])[0])
        per = -(-size // replicas)
        pad = per * replicas - size

        def padded(t):
            t = tf.convert_to_tensor(t)
            if pad:
                t = tf.concat([t, tf.repeat(t[-1:], pad, axis=0)], axis=0)
            return t

        x = tf.nest.map_structure(padded, x)
        if replicas == 1:
            per_replica = x
        else:
            per_replica = strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.nest.map_structure(
                    lambda t: t[ctx.replica_id_in_sync_group * per:
                                (ctx.replica_id_in_sync_group + 1) * per], x))
        outputs = run(per_replica)
        # Replica results in replica order: the order of the batch's slices.
        return {k: np.concatenate([t.numpy() for t in strategy.experimental_local_results(v)],
                                  axis=0)[:size]
                for k, v in outputs.items()}

    return call
