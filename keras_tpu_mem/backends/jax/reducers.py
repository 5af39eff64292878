"""Where the JAX step reduces its gradient: one small object, chosen once per built step.

`Step` (`trainer.py`) builds its step with one reducer, chosen by `choose_reducer`
from the state's layout and the distribution's batch axis, and asks it for the
gradient of each update (`gradients`) or of each pulled micro-batch
(`accumulate`, `dataset_yields="micro_batches"`, see `pulled.py`):

* `Spmd`: no `shard_map`; the step on global arrays, as Keras writes it. With
  one data-parallel device (no distribution, or a batch axis of one device)
  there is nothing to reduce, and the micro-batch loop is a plain `lax.scan`.
* `ReplicatedShardMap` (`DataParallel`, replicated state over a batch axis of
  more than one device): the micro-batch loop inside `shard_map` over the batch
  axis only (a `ModelParallel` model axis stays automatic); every device sums
  its own share's gradients and one `psum` after the loop reduces them. On a
  plain `scan` over the global array XLA puts the all-reduce inside the loop
  body (one per micro-batch). One micro-batch is Keras' own step: XLA's
  partitioner inserts its one all-reduce.
* `ShardedShardMap` (FSDP / ZeRO, `layout.StateLayout`): on a TPU mesh the step on
  global arrays is left to XLA:TPU's partitioner, which gathers each weight where a
  (micro-)batch uses it: Keras' own step at one micro-batch, the micro-batch loop at
  more (each micro-batch over every device, `gradients.micro_batches`); elsewhere the
  gradient inside `shard_map` too, each sharded weight `all_gather`ed where the loss uses it so
  that its gradient is the transpose, a reduce-scatter into the slice; a
  replicated weight whose optimizer slots are sharded has its gradient
  reduce-scattered into the slots' sharding; any other gradient is `psum`med.
  The gradients leave the `shard_map` in that sharding and the optimizer runs
  outside it on the global arrays (XLA partitions the elementwise update and
  inserts the collectives of any global view, e.g. `global_clipnorm`).

Every reducer divides by the number of devices: each device's loss is the mean
over its share, so the mean of the devices' gradients is the gradient of the
global batch's loss. Metrics, the loss tracker and non-trainable variables
leave a `shard_map` by their aggregation (`per_device.PerDeviceState`), so the
logs are the same under every reducer.

A reducer has `shards`, `gradients(local, state, batch, num_micro,
feature_state) -> Reduced`, `accumulate(local, state, accumulators, batch, k,
apply, feature_state) -> Accumulated` and `accumulators()` (per trainable
weight, where its pulled-micro-batch accumulator lives: `PER_DEVICE`, a
gradient's scatter dimension, or None).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.backends.jax.gradients import Local, TrainState
from keras_tpu_mem.backends.jax.layout import partitioner_shards_state
from keras_tpu_mem.backends.jax.per_device import PerDeviceState

#: An accumulator with a leading per-device axis on the batch axis (the device's
#: own unreduced sum), as `reducers.*.accumulators()` says.
PER_DEVICE = "per device"

_REPLICATED = PartitionSpec()


class Reduced(NamedTuple):
    """An update's gradient, reduced, with the state it leaves.

    Attributes:
        grads: The mean gradients, ready for `optimizer.stateless_apply`.
        non_trainable: The non-trainable values after the update's data.
        metrics: The metric values after it.
        logs: The logs of the metrics, where the step's own `compute_metrics`
            gave them (one batch); None: read them from `metrics`.
    """

    grads: list
    non_trainable: list
    metrics: list
    logs: Any = None


class Accumulated(NamedTuple):
    """A pulled micro-batch's gradient added to the accumulators.

    Attributes:
        grads: With `apply`, the window's mean gradients; else empty.
        accumulators: The sums to carry (zeros after `apply`).
        non_trainable: The non-trainable values after the micro-batch.
        metrics: The metric values after it.
    """

    grads: list
    accumulators: list
    non_trainable: list
    metrics: list


def keras_step(local, state: TrainState, batch, feature_state) -> Reduced:
    """One batch on global arrays, exactly Keras' `train_step` (any all-reduce is
    XLA's partitioner's)."""
    (_, aux), grads = local.value_and_grad()(
        state.trainable, state.non_trainable, state.metrics, state.optimizer, batch, 1,
        feature_state)
    logs, metrics = local.update_metrics(aux.metrics, aux.unscaled, batch, aux.y_pred)
    return Reduced(grads, aux.non_trainable, metrics, logs)


class Spmd:
    """One data-parallel device: the step on global arrays, nothing to reduce."""

    shards = 1

    def __init__(self, model):
        self.model = model

    def gradients(self, local, state, batch, num_micro, feature_state) -> Reduced:
        return gradients_global(local, state, batch, num_micro, feature_state)

    def accumulate(self, local, state, accumulators, batch, k, apply,
                   feature_state) -> Accumulated:
        return accumulate_global(local, state, accumulators, batch, k, apply, feature_state)

    def accumulators(self) -> list:
        return [None] * len(self.model.trainable_variables)


def gradients_global(local, state, batch, num_micro, feature_state,
                     devices: int = 1) -> Reduced:
    """An update's gradient on global arrays (any reduction is XLA's partitioner's):
    Keras' own step at one micro-batch, else the micro-batch loop, each micro-batch
    taking its rows from each of `devices` blocks (`gradients.micro_batches`)."""
    if num_micro == 1:
        return keras_step(local, state, batch, feature_state)
    out = local.micro_batch_loop(state, batch, num_micro, feature_state, devices=devices)
    return Reduced(out.grads, out.non_trainable, out.metrics)


def accumulate_global(local, state, accumulators, batch, k, apply,
                      feature_state) -> Accumulated:
    """One pulled micro-batch on global arrays: its gradient added to the accumulators
    (any reduction is XLA's partitioner's); with `apply`, their sums and zeros."""
    out = local.one_batch(state, batch, k, feature_state)
    sums = [a + g.astype(a.dtype) for a, g in zip(accumulators, out.grads)]
    if apply:
        return Accumulated(sums, [jnp.zeros_like(a) for a in sums], out.non_trainable,
                           out.metrics)
    return Accumulated([], sums, out.non_trainable, out.metrics)


class _InShardMap:
    """The two `shard_map` bodies over the batch axis, for `ReplicatedShardMap` and
    `ShardedShardMap`, which say how the state lies: `state_specs`, `grad_specs`,
    `accumulator_specs`, the weights the loss sees (`enter`), the reduction after
    the loop (`reduce`) or of a window (`add`, `reduce_window`, `keep`)."""

    def gradients(self, local, state, batch, num_micro, feature_state) -> Reduced:
        """The micro-batch loop inside `shard_map`, reduced after it."""
        per_device = PerDeviceState(self.model, keras.distribution.distribution(),
                                    self.shards)
        axis = per_device.axis

        def body(state, batch, feature_state):
            trainable, gather = self.enter(state.trainable, in_loop=True)
            offset, out = per_device.run(state.non_trainable, lambda start: (
                local.micro_batch_loop(
                    TrainState(trainable, start, state.optimizer, state.metrics), batch,
                    num_micro, feature_state, gather=gather)))
            return self.reduce(out.grads, axis), *_combined(per_device, state, out, offset)

        mapped = jax_compat.shard_map(
            body, mesh=per_device.mesh,
            in_specs=(self.state_specs(), PartitionSpec(axis), _REPLICATED),
            out_specs=(self.grad_specs(), _REPLICATED, _REPLICATED),
            manual_axes={axis})
        return Reduced(*mapped(TrainState(*map(list, state)), batch, feature_state))

    def accumulate(self, local, state, accumulators, batch, k, apply,
                   feature_state) -> Accumulated:
        """One pulled micro-batch inside `shard_map`: each device adds its own share's
        gradient to its accumulators (`add`); only `apply` reduces (`reduce_window`)
        and hands back zeros."""
        per_device = PerDeviceState(self.model, keras.distribution.distribution(),
                                    self.shards)
        axis = per_device.axis

        def body(state, accumulators, batch, feature_state):
            trainable, gather = self.enter(state.trainable, in_loop=False)
            offset, out = per_device.run(state.non_trainable, lambda start: local.one_batch(
                TrainState(trainable, start, state.optimizer, state.metrics), batch, k,
                feature_state, gather=gather))
            sums = self.add(accumulators, out.grads, axis)
            if apply:  # the one gradient reduction of the window
                grads = self.reduce_window(sums, axis)
                accumulators = [jnp.zeros_like(a) for a in accumulators]
            else:
                grads, accumulators = [], self.keep(sums)
            return grads, accumulators, *_combined(per_device, state, out, offset)

        accumulator_specs = self.accumulator_specs(axis)
        mapped = jax_compat.shard_map(
            body, mesh=per_device.mesh,
            in_specs=(self.state_specs(), accumulator_specs, PartitionSpec(axis),
                      _REPLICATED),
            out_specs=(self.grad_specs() if apply else [], accumulator_specs, _REPLICATED,
                       _REPLICATED),
            manual_axes={axis})
        return Accumulated(*mapped(TrainState(*map(list, state)), list(accumulators), batch,
                                   feature_state))


def _combined(per_device, state: TrainState, out: Local, offset):
    """`(non_trainable, metrics)` made replicated again after the body's local step."""
    return per_device.combine(state.non_trainable, out.non_trainable, out.updated,
                              state.metrics, out.metrics, offset)


class ReplicatedShardMap(_InShardMap):
    """Replicated state over a batch axis of `shards` devices: `psum` after the loop.

    Args:
        model: The compiled Keras model.
        shards: Devices along the distribution's batch axis (more than one).
    """

    def __init__(self, model, shards):
        self.model = model
        self.shards = shards

    def gradients(self, local, state, batch, num_micro, feature_state) -> Reduced:
        if num_micro == 1:  # no loop to keep a reduction out of
            return keras_step(local, state, batch, feature_state)
        return super().gradients(local, state, batch, num_micro, feature_state)

    def accumulators(self) -> list:
        return [PER_DEVICE] * len(self.model.trainable_variables)

    # ---------------------------------------- the shard_map's parts (see below)
    def state_specs(self):
        return TrainState(_REPLICATED, _REPLICATED, _REPLICATED, _REPLICATED)

    def grad_specs(self):
        return _REPLICATED

    def accumulator_specs(self, axis):
        return PartitionSpec(axis)

    def enter(self, trainable, in_loop: bool):
        """`(trainable, gather)` for the loss inside the body: the weights as given."""
        return trainable, None

    def reduce(self, sums, axis):
        # The one gradient reduction of the step: each device's sum of its own
        # micro-batch gradients, averaged over the devices.
        return [jax.lax.psum(s, axis) / self.shards for s in sums]

    def add(self, accumulators, grads, axis):
        return [a[0] + g.astype(a.dtype) for a, g in zip(accumulators, grads)]

    def reduce_window(self, sums, axis):
        return self.reduce(sums, axis)

    def keep(self, sums):
        return [s[None] for s in sums]


class ShardedShardMap(_InShardMap):
    """State split over the batch axis (`layout`): gathers and reduce-scatters.

    Args:
        model: The compiled Keras model.
        layout: The state's `layout.StateLayout`.
        scatter_in_loop: Differentiate each micro-batch with respect to the
            device's slice (the reduce-scatter runs once per micro-batch and the
            accumulators hold slices) rather than gathering each weight once
            before the loop and reduce-scattering whole-weight sums once after it
            (whole gradient sums alive through the loop: 0.55x of `DataParallel`
            against 0.38x on XLA:CPU, docs/engine.md). `scatters_in_loop()` is the
            rule `choose_reducer` applies.
        partitioned: Leave the step on the global arrays to XLA's partitioner (a TPU
            mesh, `layout.partitioner_shards_state`): Keras' step at one micro-batch,
            the micro-batch loop at more, each pulled micro-batch into accumulators
            split like the gradients; no `shard_map`.
    """

    def __init__(self, model, layout, scatter_in_loop: bool, partitioned: bool = False):
        self.model = model
        self.layout = layout
        self.shards = layout.shards
        self.scatter_in_loop = scatter_in_loop
        self.partitioned = partitioned

    def gradients(self, local, state, batch, num_micro, feature_state) -> Reduced:
        if self.partitioned:
            # A TPU mesh: XLA:TPU's partitioner gathers each weight where a micro-batch
            # uses it and reduce-scatters its gradient, holding a fraction of what the
            # `shard_map` loop's whole gathered weights hold (2.15B MLP, 4 micro-batches
            # on v5e-8: 9.17 against 15.04 GiB per chip; Keras' step alone: 6.76).
            return gradients_global(local, state, batch, num_micro, feature_state,
                                    devices=self.shards)
        return super().gradients(local, state, batch, num_micro, feature_state)

    def accumulate(self, local, state, accumulators, batch, k, apply,
                   feature_state) -> Accumulated:
        if self.partitioned:  # a pulled micro-batch as Keras' step takes one
            return accumulate_global(local, state, accumulators, batch, k, apply,
                                     feature_state)
        return super().accumulate(local, state, accumulators, batch, k, apply, feature_state)

    def accumulators(self) -> list:
        if self.partitioned:
            # Global arrays split as each gradient is reduce-scattered (a weight with no
            # such dimension: as the weight).
            return list(self.layout.grad_dims)
        return [PER_DEVICE if d is None else d for d in self.layout.grad_dims]

    # ---------------------------------------- the shard_map's parts (see below)
    def state_specs(self):
        layout = self.layout
        return TrainState(layout.weight_specs(), _REPLICATED, layout.optimizer_specs(),
                          _REPLICATED)

    def grad_specs(self):
        return self.layout.grad_specs()

    def accumulator_specs(self, axis):
        return [spec if d is not None else PartitionSpec(axis)
                for spec, d in zip(self.layout.grad_specs(), self.layout.grad_dims)]

    def enter(self, trainable, in_loop: bool):
        """`(trainable, gather)` for the loss inside the body: the slices with a
        gather in the loss (a reduce-scatter per micro-batch; pulled micro-batches
        always), or the weights gathered once, here."""
        if in_loop and not self.scatter_in_loop:
            return self.layout.gather(trainable), None
        return trainable, self.layout.gather

    def reduce(self, sums, axis):
        # A sharded weight's sum is already its slice's when it was scattered in the
        # loop; else reduce-scattered here.
        return self.layout.reduce(sums, self.scatter_in_loop)

    def add(self, accumulators, grads, axis):
        sums = []
        for a, g, wd, gd in zip(accumulators, grads, self.layout.weight_dims,
                                self.layout.grad_dims):
            if wd is None and gd is not None:
                g = jax.lax.psum_scatter(g, axis, scatter_dimension=gd, tiled=True)
            sums.append(a + g.astype(a.dtype) if gd is not None
                        else a[0] + g.astype(a.dtype))
        return sums

    def reduce_window(self, sums, axis):
        return [s / self.shards if d is not None else jax.lax.psum(s, axis) / self.shards
                for s, d in zip(sums, self.layout.grad_dims)]

    def keep(self, sums):
        return [s if d is not None else s[None] for s, d in zip(sums, self.layout.grad_dims)]


def scatters_in_loop(distribution=None) -> bool:
    """Whether `ShardedShardMap`'s `shard_map` loop scatters every micro-batch's
    gradient: not on a TPU mesh (where `fit` runs that loop only inside
    `in_shard_map()`; its micro-batch loop is XLA:TPU's partitioner's).

    XLA:TPU's compile of 8 x Dense(8192) with Adam under `ShardedDataParallel()` on
    v5e-16, `GradientAccumulation(2)` and `(4)`, held 4.50 GiB per chip scattering in
    the loop against 3.39 GiB gathering once, and its compile of the loop that
    scatters took host memory as large as all the weights (2.5 GB for these 2 GB of
    float32; a 6.7B model's plan was killed for memory), where gathering once took
    0.8 GB (docs/engine.md). On XLA:CPU scattering in the loop holds less.
    """
    return not partitioner_shards_state(distribution)


#: Set inside `in_shard_map()`.
_SHARD_MAP_ONLY = [False]


@contextlib.contextmanager
def in_shard_map():
    """Steps built in the block reduce split state in the engine's `shard_map`, where on
    a TPU mesh XLA:TPU's partitioner would take Keras' step or the micro-batch loop on
    global arrays (`compiled.prepare_step(keras_step=False)`: the two compared)."""
    previous = _SHARD_MAP_ONLY[0]
    _SHARD_MAP_ONLY[0] = True
    try:
        yield
    finally:
        _SHARD_MAP_ONLY[0] = previous


def choose_reducer(model, layout, shards: int):
    """The reducer of a step built now: `ShardedShardMap` for a `layout` (state split
    over the batch axis; on a TPU mesh partitioned by XLA:TPU, with or without features:
    134 against 294 MiB per chip for 4 x Dense(4096) with `MixedBFloat16` on v5e-8),
    `ReplicatedShardMap` for replicated state over more than one data-parallel device,
    else `Spmd`."""
    if layout is not None:
        return ShardedShardMap(
            model, layout, scatter_in_loop=scatters_in_loop(),
            partitioned=partitioner_shards_state() and not _SHARD_MAP_ONLY[0])
    if shards > 1:
        return ReplicatedShardMap(model, shards)
    return Spmd(model)
