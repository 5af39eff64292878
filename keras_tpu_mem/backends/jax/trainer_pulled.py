"""Keras' accumulation convention on JAX: micro-batches pulled from the dataset.

`GradientAccumulation(steps=k, dataset_yields="micro_batches")`: the dataset
yields micro-batches and each `fit` step is one of them. Two jitted steps take
`(state, accumulators, data)`: one adds this micro-batch's gradient of loss / k
to the accumulators, the other (the k-th) applies their sum once, runs the
features' `after_update` and hands back zeros; Python picks one from the window
position, so no conditional surrounds the optimizer. Under a data-parallel axis
of more than one device each accumulator has a leading per-device axis on the
batch axis and the gradients stay per device inside `shard_map`: the applying
step's one `psum` is the only gradient reduction. The accumulators are JAX
arrays held by the train function (transient: zero at every window's end, and
windows never span epochs), never Keras variables.

`PulledMicroBatchSteps` is a mixin of `backends.jax.trainer.Step`, whose loss, metric
and feature helpers it uses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.backends.jax.feature_state import CarriedFeatureState
from keras_tpu_mem.backends.jax.trainer_sharded import model_state_layout
from keras_tpu_mem.backends.jax.trainer_shared import PerDeviceState as _PerDeviceState
from keras_tpu_mem.backends.jax.trainer_shared import (
    multi_step_train_function as _multi_step_train_function,
)
from keras_tpu_mem.backends.step import StepContext, check_pulled_micro_batches


class PulledMicroBatchSteps:
    """The pulled-micro-batch train function of `Step` (see the module docstring)."""

    def _pulled_step(self, features, k, apply, state, accumulators, data,
                     feature_state=None, layout=None):
        """One micro-batch of Keras' accumulation convention (`dataset_yields=
        "micro_batches"`): `(state, accumulators, data[, feature_state]) -> (logs,
        state, accumulators[, carried values])`.

        Adds the gradient of this micro-batch's loss / k to the local
        accumulators; with `apply` (the last micro-batch of a window) applies
        their sum once and hands back zeros. Under a data-parallel axis of more
        than one device the accumulators carry a leading per-device axis
        sharded on the batch axis and the gradients stay per device (inside
        `shard_map`): the only gradient reduction is the applying step's one
        `psum`. Under sharded state (`layout`, see `trainer_sharded`) each
        micro-batch's gradient is reduce-scattered into accumulators held in
        the state's sharding.
        """
        model = self.model
        has_feature_state, feature_state, batch, micro, shards = self._step_inputs(
            features, data, feature_state)
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y, sample_weight, extras = batch
        if micro % shards:
            raise ValueError(
                f"GradientAccumulation(steps={k}, dataset_yields='micro_batches'): the "
                f"micro-batch of {micro} does not split over the {shards} data-parallel "
                f"devices of the active keras.distribution; use a dataset batch size that "
                f"is a multiple of {shards}.")
        accumulators = list(accumulators)
        if layout is not None:
            grads, accumulators, non_trainable, metrics_vars = self._sharded_state_pulled(
                features, apply, trainable, non_trainable, optimizer_vars, metrics_vars,
                accumulators, batch, k, shards, feature_state, layout)
        elif shards == 1:
            grads, non_trainable, metrics_vars, _ = self._one_micro_batch(
                features, trainable, non_trainable, optimizer_vars, metrics_vars, batch, k,
                feature_state)
            sums = [a + g.astype(a.dtype) for a, g in zip(accumulators, grads)]
            if apply:
                grads, accumulators = sums, [jnp.zeros_like(a) for a in sums]
            else:
                accumulators = sums
        else:
            grads, accumulators, non_trainable, metrics_vars = self._sharded_pulled(
                features, apply, trainable, non_trainable, optimizer_vars, metrics_vars,
                accumulators, batch, k, shards, feature_state)
        carried = feature_state[0]
        if apply:
            trainable, optimizer_vars = model.optimizer.stateless_apply(
                optimizer_vars, grads, trainable)
            ctx = StepContext(model, x, y, sample_weight, None, extras, k)
            trainable, non_trainable, carried = self._after_update(
                features, trainable, non_trainable, optimizer_vars, feature_state, ctx)
        logs = self._metrics_result(metrics_vars)
        new_state = (list(trainable), list(non_trainable), list(optimizer_vars),
                     list(metrics_vars))
        if has_feature_state:
            return logs, new_state, accumulators, list(carried)
        return logs, new_state, accumulators

    def _sharded_pulled(self, features, apply, trainable, non_trainable, optimizer_vars,
                        metrics_vars, accumulators, batch, k, shards, feature_state):
        """`_pulled_step`'s gradient under a data-parallel axis: inside `shard_map` over
        the batch axis, each device adds its own share's gradient to its own slice
        of the accumulators (leading axis); only `apply` reduces (one `psum`)."""
        state = _PerDeviceState(self.model, keras.distribution.distribution(), shards)
        axis, mesh = state.axis, state.mesh

        def local(trainable, non_trainable, optimizer_vars, metrics_vars, accumulators,
                  batch, feature_state):
            offset, (grads, local_non_trainable, local_metrics, updated) = state.run(
                non_trainable, lambda start: self._one_micro_batch(
                    features, trainable, start, optimizer_vars, metrics_vars, batch, k,
                    feature_state))
            sums = [a[0] + g.astype(a.dtype) for a, g in zip(accumulators, grads)]
            if apply:
                # The one gradient reduction of the window (see `_sharded_micro_batches`).
                grads = [jax.lax.psum(s, axis) / shards for s in sums]
                accumulators = [jnp.zeros_like(a) for a in accumulators]
            else:
                grads = []
                accumulators = [s[None] for s in sums]
            non_trainable, metrics_vars = state.combine(
                non_trainable, local_non_trainable, updated, metrics_vars, local_metrics,
                offset)
            return grads, accumulators, non_trainable, metrics_vars

        replicated, per_device = PartitionSpec(), PartitionSpec(axis)
        mapped = jax_compat.shard_map(
            local, mesh=mesh,
            in_specs=(replicated, replicated, replicated, replicated, per_device, per_device,
                      replicated),
            out_specs=(replicated, per_device, replicated, replicated),
            manual_axes={axis})
        return mapped(list(trainable), list(non_trainable), list(optimizer_vars),
                      list(metrics_vars), list(accumulators), batch,
                      (list(feature_state[0]), list(feature_state[1])))

    def accumulator_shardings(self, layout=None):
        """Shardings of the pulled-micro-batch accumulators (None without a
        distribution): each trainable weight's, with a leading per-device axis on
        the batch axis when that axis has more than one device; under sharded
        state (`layout`), a weight whose gradient is reduce-scattered gets its
        gradient's sharding and no leading axis."""
        distribution = keras.distribution.distribution()
        if distribution is None:
            return None
        mesh = jax_compat.backend_mesh(distribution.device_mesh)
        shards = self.num_replicas()
        axis = distribution.batch_dim_name
        shardings = []
        for i, variable in enumerate(self.model.trainable_variables):
            sharding = getattr(variable.value, "sharding", None)
            spec = tuple(getattr(sharding, "spec", ()) or ())
            spec = spec + (None,) * (len(variable.shape) - len(spec))
            dim = None if layout is None else layout.grad_dims[i]
            if dim is not None:
                spec = tuple(axis if d == dim else (None if s == axis else s)
                             for d, s in enumerate(spec))
            elif shards > 1:
                spec = (axis, *spec)
            shardings.append(jax.sharding.NamedSharding(mesh, PartitionSpec(*spec)))
        return shardings

    def zero_accumulators(self, shardings=None, layout=None):
        """Fresh zero accumulators for `dataset_yields="micro_batches"` (one per
        trainable weight; a leading per-device axis under a data-parallel axis >1,
        except for a sharded gradient of a `layout`)."""
        shards = self.num_replicas()
        zeros = []
        for i, variable in enumerate(self.model.trainable_variables):
            shape = tuple(variable.shape)
            if shards > 1 and (layout is None or layout.grad_dims[i] is None):
                shape = (shards, *shape)
            value = jnp.zeros(shape, variable.dtype)
            if shardings is not None:
                value = jax.device_put(value, shardings[i])
            zeros.append(value)
        return zeros

    def make_pulled_steps(self, k: int, jit: bool = True) -> dict:
        """`{False: accumulating step, True: applying step}` of `_pulled_step`, jitted
        with `donate_argnums=(0, 1)` (state and accumulators) unless `jit=False`."""
        features = tuple(self.features)
        layout = model_state_layout(self.model)
        steps = {apply: functools.partial(self._pulled_step, features, k, apply,
                                          layout=layout)
                 for apply in (False, True)}
        if not jit:
            return steps
        out_shardings = None
        if keras.distribution.distribution() is not None:
            out_shardings = (None, jax_compat.state_sharding_spec(self.model),
                             self.accumulator_shardings(layout))
            carried, frozen = self._feature_variables(self.features)
            if carried or frozen:
                out_shardings += ([v.value.sharding for v in carried],)
        return {apply: jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)
                for apply, step in steps.items()}

    def _build_pulled_train_function(self, k: int) -> Callable:
        model = self.model
        check_pulled_micro_batches(model, k)
        spe = int(model.steps_per_execution)
        jit = not model.run_eagerly and bool(model.jit_compile)
        steps = self.make_pulled_steps(k, jit=jit)
        self.jitted_step = None
        layout = model_state_layout(model)
        shardings = self.accumulator_shardings(layout)
        engine = self.engine
        carried, frozen = self._feature_variables(self.features)
        # The accumulators live here, beside Keras' state, never in a variable:
        # transient (zero at every window's end; windows never span epochs).
        # `position` is the window position they were left at: a fit starts at
        # position 0 (the engine resets it), so a window an interrupted fit left
        # behind never leaks into the next one.
        held = {"accumulators": None, "position": 0}

        # The features' values are carried beside Keras' state (see
        # `CarriedFeatureState`), written into their variables when Keras syncs.
        features = CarriedFeatureState(model, carried, frozen).attach() if (
            carried or frozen) else None

        def run(apply, state, data):
            if features is not None:
                logs, state, accumulators, values = steps[apply](
                    state, held["accumulators"], data, features.inputs())
                features.carry(values)
            else:
                logs, state, accumulators = steps[apply](state, held["accumulators"], data)
            held["accumulators"] = accumulators
            return logs, state

        def micro_step(state, data):
            position = engine._window_position
            if held["accumulators"] is None or position != held["position"]:
                held["accumulators"] = self.zero_accumulators(shardings, layout)
            apply = position == k - 1
            held["position"] = -1  # in flight: a failure leaves nothing to reuse
            logs, state = run(apply, state, data)
            engine._window_position = (position + 1) % k
            held["position"] = engine._window_position
            return logs, state

        def forget_window():  # a failed step leaves no window to continue
            held["accumulators"], held["position"] = None, 0
            if features is not None:
                features.sync()

        train_function = _multi_step_train_function(model, engine, micro_step, spe,
                                                    on_error=forget_window)
        train_function.jitted_step = None
        train_function.pulled_steps = steps
        train_function.zero_accumulators = lambda: self.zero_accumulators(shardings, layout)
        return train_function
