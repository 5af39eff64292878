"""The gradient of a batch where it runs: the loss, its gradient and the metrics, unreduced.

What every JAX step computes on the arrays it is given, whether those are the
global arrays (`reducers.Spmd`) or one device's share inside `shard_map`
(`reducers.ReplicatedShardMap`, `reducers.ShardedShardMap`): Keras' documented
custom-step pattern (`stateless_call` + `stateless_compute_loss` inside
`jax.value_and_grad`) with the features' `transform_loss`, and the metrics'
stateless updates. No collective is written here; where the gradient is reduced
is the reducer's choice.

The values travel as named tuples rather than positional ones: `TrainState` is
Keras' four-part state, `Batch` the unpacked data, `Local` what a batch leaves on
the devices that ran it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.backends.jax.feature_state import FeatureValues, frozen_mapping
from keras_tpu_mem.backends.step import StepContext
from keras_tpu_mem.backends.structure import leading_dim


class TrainState(NamedTuple):
    """Keras' JAX train state, `(trainable, non_trainable, optimizer, metrics)` values.

    Only inside the step: `fit` hands the step a plain tuple and gets one back (a
    named tuple is another pytree, which would retrace the jitted step).
    """

    trainable: list
    non_trainable: list
    optimizer: list
    metrics: list


class Batch(NamedTuple):
    """One step's (or micro-batch's) data, unpacked as Keras unpacks it."""

    x: Any
    y: Any
    sample_weight: Any
    extras: dict


class LossAux(NamedTuple):
    """What `LocalGradients.loss` computes besides the loss it differentiates."""

    unscaled: Any  # the loss before the optimizer's scale and the 1/k of micro-batches
    y_pred: Any
    non_trainable: list
    metrics: list


class Local(NamedTuple):
    """What a batch's gradient leaves on the devices that ran it (no reduction).

    Attributes:
        grads: The gradients (or their sums over the micro-batches).
        non_trainable: The non-trainable values after the batch.
        metrics: The metric values after the batch.
        updated: Per non-trainable variable, whether the step writes it (learnt
            while the step is traced: Keras hands back the very input value of
            every variable nothing assigned).
    """

    grads: list
    non_trainable: list
    metrics: list
    updated: list


class LocalGradients:
    """The loss, gradient and metrics of a batch for a snapshot of the features.

    Args:
        model: The compiled Keras model.
        features: The build's snapshot of the engine's features (a later trace of
            the same step builds the same step).
    """

    def __init__(self, model, features):
        self.model = model
        self.features = tuple(features)

    def loss(self, trainable, non_trainable, metrics_vars, optimizer_vars, batch: Batch,
             num_micro, feature_state: FeatureValues):
        """The loss to differentiate (with respect to `trainable`), as Keras'
        `compute_loss_and_updates` computes it, with the features' loss terms, divided
        by `num_micro`. Returns `(loss, LossAux)`."""
        model = self.model
        x, y, sample_weight, extras = batch
        kwargs = {"training": True} if keras_compat.call_has_training_arg(model) else {}
        y_pred, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs)
        with jax_compat.losses_override(model, losses):
            loss, (_, non_trainable, metrics_vars) = model.stateless_compute_loss(
                trainable, non_trainable, metrics_vars, x=x, y=y, y_pred=y_pred,
                sample_weight=sample_weight, training=True)
        ctx = StepContext(model, x, y, sample_weight, y_pred, extras, num_micro)
        mapping = [*zip(model.trainable_variables, trainable),
                   *zip(model.non_trainable_variables, non_trainable),
                   *zip(model.metrics_variables, metrics_vars),
                   *frozen_mapping(self.features, feature_state)]
        # Loss terms may read Keras variables (a teacher's weights): they must see
        # this step's values, not the purged model variables nor concrete arrays jit
        # would embed as constants. Their own state is `ctx.state`.
        with keras.StatelessScope(state_mapping=mapping):
            for feature in self.features:
                ctx.state = feature_state.carried.get(feature.name)
                loss = feature.transform_loss(loss, ctx)
        unscaled = loss
        if model.optimizer is not None:
            # LossScaleOptimizer reads its scale variable (in a sharded step's body
            # the slots are slices, which a scope refuses and scale_loss never reads).
            with keras.StatelessScope(state_mapping=[
                    (v, value) for v, value in zip(model.optimizer.variables, optimizer_vars)
                    if tuple(value.shape) == tuple(v.shape)]):
                loss = model.optimizer.scale_loss(loss)
        if num_micro > 1:
            loss = loss * (1.0 / num_micro)
        return loss, LossAux(unscaled, y_pred, non_trainable, metrics_vars)

    def value_and_grad(self, gather=None):
        """`jax.value_and_grad` of `loss`; with `gather` (whole weights from the slices
        given, see `reducers.ShardedShardMap`), the gradients are the slices'."""
        loss = self.loss
        if gather is not None:
            def loss(trainable, *args, _loss=self.loss):
                return _loss(gather(trainable), *args)
        return jax.value_and_grad(loss, has_aux=True)

    def update_metrics(self, metrics_vars, unscaled_loss, batch: Batch, y_pred):
        """`(logs, metrics)`: the loss tracker and compiled metrics, updated as Keras'
        JAX train_step does."""
        model = self.model
        x, y, sample_weight, _ = batch
        with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables,
                                                         metrics_vars))) as scope:
            keras_compat.loss_tracker(model).update_state(unscaled_loss,
                                                          sample_weight=leading_dim(x))
            logs = model.compute_metrics(x, y, y_pred, sample_weight)
        new = []
        for variable, old in zip(model.metrics_variables, metrics_vars):
            value = scope.get_current_value(variable)
            new.append(old if value is None else value)
        return logs, new

    def metrics_result(self, metrics_vars):
        """The logs of the metric values given."""
        model = self.model
        with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables,
                                                         metrics_vars))):
            return model.get_metrics_result()

    def one_batch(self, state: TrainState, batch: Batch, num_micro, feature_state,
                  gather=None) -> Local:
        """The gradient of one (micro-)batch's loss / `num_micro`, metrics updated."""
        (_, aux), grads = self.value_and_grad(gather)(
            state.trainable, state.non_trainable, state.metrics, state.optimizer, batch,
            num_micro, feature_state)
        updated = [new is not old for old, new in zip(state.non_trainable, aux.non_trainable)]
        _, metrics_vars = self.update_metrics(aux.metrics, aux.unscaled, batch, aux.y_pred)
        return Local(grads, list(aux.non_trainable), metrics_vars, updated)

    def micro_batch_loop(self, state: TrainState, batch: Batch, num_micro, feature_state,
                         gather=None, devices: int = 1) -> Local:
        """Sum of the micro-batch gradients of `batch` (its rows, split in order, one
        micro-batch at a time in a `lax.scan`), with the non-trainable and metric state
        threaded through the loop (`gather`: whole weights from the `trainable` given,
        which the gradients are of). `devices`: global arrays whose rows lie over that
        many devices, in blocks: each micro-batch takes its rows from every block
        (`micro_batches`), so it lies over all of them as the batch does."""
        updated = [False] * len(state.non_trainable)
        grad_fn = self.value_and_grad(gather)
        micro = jax.tree_util.tree_map(
            lambda t: micro_batches(t, num_micro, devices), batch)

        def body(carry, micro_batch):
            sums, non_trainable, metrics_vars = carry
            (_, aux), grads = grad_fn(state.trainable, non_trainable, metrics_vars,
                                      state.optimizer, micro_batch, num_micro, feature_state)
            for i, (old, new) in enumerate(zip(non_trainable, aux.non_trainable)):
                updated[i] = updated[i] or new is not old
            _, metrics_vars = self.update_metrics(aux.metrics, aux.unscaled, micro_batch,
                                                  aux.y_pred)
            sums = [s + g.astype(s.dtype) for s, g in zip(sums, grads)]
            return (sums, list(aux.non_trainable), metrics_vars), None

        zeros = [jnp.zeros(w.shape, w.dtype) for w in state.trainable]
        (sums, non_trainable, metrics_vars), _ = jax.lax.scan(
            body, (zeros, list(state.non_trainable), list(state.metrics)), micro)
        return Local(sums, non_trainable, metrics_vars, updated)


def micro_batches(rows, num_micro: int, devices: int = 1):
    """`rows` as `num_micro` micro-batches along a new first axis: the j-th holds the
    j-th of `num_micro` equal runs of each of `devices` equal blocks of rows, blocks in
    order. One block: the rows split in order. Over the blocks a device each (a batch
    split over the batch axis), each micro-batch lies over every device, as each
    device's own loop in a `shard_map` would take it; split in order instead, a
    micro-batch would lie on a few devices only."""
    size = rows.shape[0] // (devices * num_micro)
    blocks = rows.reshape(devices, num_micro, size, *rows.shape[1:])
    return jnp.swapaxes(blocks, 0, 1).reshape(num_micro, devices * size, *rows.shape[1:])


__all__ = ["Batch", "Local", "LocalGradients", "LossAux", "TrainState", "micro_batches"]
