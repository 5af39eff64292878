"""Which of the model's state is split over the batch axis (FSDP / ZeRO), read from the state.

A state value whose `.sharding.spec` names the distribution's batch axis on one
dimension is sharded there; the distribution's class is never looked at, so any
distribution that lays state out this way gets the engine's sharded step
(`reducers.ShardedShardMap`). `StateLayout` holds the answer (which dimension of
each weight, gradient and optimizer variable), read once when a step is built.

XLA's partitioner alone (the step on global arrays) keeps whole gathered
weights and all-reduces whole gradients on CPU (docs/engine.md, "The sharded
step"); on a TPU mesh it reduce-scatters itself (`partitioner_shards_state`).
"""

from __future__ import annotations

import jax
import keras
import numpy as np
from jax.sharding import PartitionSpec

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.backends.mesh import data_parallel_size


def _batch_dim(sharding, axis) -> int | None:
    """The dimension a value's sharding splits over `axis` (None: not split over it)."""
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return None
    for dim, entry in enumerate(spec):
        names = entry if isinstance(entry, (tuple, list)) else (entry,)
        if axis in names:
            if len(names) > 1:
                raise NotImplementedError(
                    f"A state value's sharding splits one dimension over the axes {names}; "
                    f"keras_tpu_mem's sharded step needs the batch axis {axis!r} alone on a "
                    "dimension.")
            return dim
    return None


def _spec(axis, dim, ndim) -> PartitionSpec:
    if dim is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * dim + [axis]))


class StateLayout:
    """Which state values are split over the batch axis, and on which dimension.

    Read from the values' shardings (`state_layout`), never from the
    distribution's class, so any distribution that lays state out over its
    batch axis gets the sharded step.

    Attributes:
        axis: The distribution's batch axis name.
        shards: Devices along it.
        weight_dims: Per trainable weight, the dimension split over the axis (or None).
        grad_dims: Per trainable weight, where its gradient is reduce-scattered:
            the weight's own dimension, else that of its own sharded optimizer
            slots of its shape (as the optimizer maps slots to weights: two
            weights of one shape may lie differently), else None (`psum`).
        optimizer_dims: Per optimizer variable, its split dimension (or None).
    """

    def __init__(self, axis, shards, weight_dims, optimizer_dims, weight_shapes,
                 optimizer_shapes, weight_slots):
        """`weight_slots`: per trainable weight, the positions of its own slots
        among the optimizer's variables (`keras_compat.optimizer_slot_positions`)."""
        self.axis, self.shards = axis, shards
        self.weight_dims = list(weight_dims)
        self.optimizer_dims = list(optimizer_dims)
        self.weight_ndims = [len(s) for s in weight_shapes]
        self.optimizer_ndims = [len(s) for s in optimizer_shapes]
        self.grad_dims = []
        for dim, shape, slots in zip(self.weight_dims, weight_shapes, weight_slots):
            if dim is None:
                # A slot of another shape (a factored second moment) lies otherwise.
                dim = next((self.optimizer_dims[i] for i in slots
                            if self.optimizer_dims[i] is not None
                            and tuple(optimizer_shapes[i]) == tuple(shape)), None)
            self.grad_dims.append(dim)

    def weight_specs(self):
        return [_spec(self.axis, d, n) for d, n in zip(self.weight_dims, self.weight_ndims)]

    def grad_specs(self):
        return [_spec(self.axis, d, n) for d, n in zip(self.grad_dims, self.weight_ndims)]

    def optimizer_specs(self):
        return [_spec(self.axis, d, n)
                for d, n in zip(self.optimizer_dims, self.optimizer_ndims)]

    def gather(self, trainable):
        """Whole weights from the device's slices (inside the `shard_map` body)."""
        return [v if d is None else jax.lax.all_gather(v, self.axis, axis=d, tiled=True)
                for v, d in zip(trainable, self.weight_dims)]

    def reduce(self, sums, scattered: bool):
        """The mean gradient over the devices, each in its `grad_dims` sharding.

        `sums` are the device's gradient sums; a sharded weight's is already a
        slice summed over the devices (the all_gather's transpose) when
        `scattered`, else a whole local gradient, reduce-scattered here."""
        out = []
        for s, wd, gd in zip(sums, self.weight_dims, self.grad_dims):
            if wd is not None and scattered:
                out.append(s / self.shards)
            elif gd is not None:
                out.append(jax.lax.psum_scatter(s, self.axis, scatter_dimension=gd,
                                                tiled=True) / self.shards)
            else:
                out.append(jax.lax.psum(s, self.axis) / self.shards)
        return out


def state_layout(state_shardings, distribution=None):
    """The `StateLayout` of a state's shardings, or None when nothing is split over the
    distribution's batch axis (or it has one device, or there is no distribution).

    Args:
        state_shardings: `(trainable, non_trainable, optimizer, metrics)` shardings,
            as `jax_compat.state_sharding_spec(model)` reads them from the values
            (or `ShapeDtypeStruct.sharding`s of a compile's state).
        distribution: The `keras.distribution`; the active one if None.
    """
    if distribution is None:
        distribution = keras.distribution.distribution()
    if distribution is None or state_shardings is None:
        return None
    axis = distribution.batch_dim_name
    shards = data_parallel_size(distribution)
    if shards < 2:
        return None
    trainable, _, optimizer, _ = state_shardings
    weight_dims = [_batch_dim(s, axis) for s in trainable]
    optimizer_dims = [_batch_dim(s, axis) for s in optimizer]
    if all(d is None for d in (*weight_dims, *optimizer_dims)):
        return None
    return weight_dims, optimizer_dims, axis, shards


def make_state_layout(model, state_shardings, distribution=None):
    """`state_layout` with the model's shapes: a `StateLayout`, or None."""
    found = state_layout(state_shardings, distribution)
    if found is None:
        return None
    weight_dims, optimizer_dims, axis, shards = found
    weights = model.trainable_variables
    return StateLayout(axis, shards, weight_dims, optimizer_dims,
                       [tuple(v.shape) for v in weights],
                       [tuple(v.shape) for v in model.optimizer.variables],
                       keras_compat.optimizer_slot_positions(model.optimizer, weights))


def partitioner_shards_state(distribution=None) -> bool:
    """Whether XLA's own SPMD partitioner is left the step of state split over the batch
    axis: on TPU meshes (`reducers.ShardedShardMap(partitioned=True)`).

    The engine's `shard_map` step exists because XLA:CPU all-reduces whole gradients
    even under sharding constraints (it has no reduce-scatter creator). XLA:TPU does
    reduce-scatter and gathers weights where it schedules them: for an 8 x Dense(4096)
    MLP with Adam under `ShardedDataParallel()` on v5e-8 (global batch 256), Keras' own
    step compiled by XLA:TPU holds 332 MiB per chip against 811 MiB for the engine's
    `shard_map` step (`benchmarks/tpu_plans.py`, docs/sharding.md). With
    `GradientAccumulation(4)`, the micro-batch loop on the global arrays (each
    micro-batch over every chip) holds 0.47 against 1.06 GiB for the engine's loop,
    which gathers every weight whole. GPUs: not measured; the engine's step, as before.
    """
    if distribution is None:
        distribution = keras.distribution.distribution()
    if distribution is None:
        return False
    devices = np.asarray(jax_compat.backend_mesh(distribution.device_mesh).devices).flat
    return all(str(getattr(d, "platform", "")).lower() == "tpu" for d in devices)


def model_state_layout(model):
    """The `StateLayout` of the model's current variable values (None when unsharded).

    None without a `keras.distribution`, without an optimizer (an uncompiled
    model), or where no state is split over the distribution's batch axis.
    Anything else that keeps the shardings from being read raises: answering
    None there would run the unsharded step on sharded state, with nothing said.
    Call it before `fit` purges the values (from `make_train_function`).

    Raises:
        RuntimeError: A variable has no value (`fit` took them out for its loop).
    """
    optimizer = getattr(model, "optimizer", None)
    if keras.distribution.distribution() is None or optimizer is None:
        return None
    try:
        shardings = jax_compat.state_sharding_spec(model)
    except Exception as err:
        # Keras' JAX `fit` takes the values out of the variables while it holds
        # them (reading one then fails inside Keras): say which, else raise as is.
        empty = []
        for variable in [*model.trainable_variables, *model.non_trainable_variables,
                         *optimizer.variables, *model.metrics_variables]:
            try:
                _ = variable.value
            except Exception:
                empty.append(variable.path)
        if not empty:
            raise
        raise RuntimeError(
            f"Cannot read the layout of {model.name}'s state: {len(empty)} variables have "
            f"no value ({', '.join(empty[:3])}{', ...' if len(empty) > 3 else ''}), as "
            "while Keras' JAX `fit` holds them. Read it before `fit` starts, or from a "
            "callback through `self.model`, which puts the values back.") from err
    return make_state_layout(model, shardings)
