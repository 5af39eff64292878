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

`PulledMicroBatchSteps` is a mixin of `engine.jax.JaxStep`, whose loss, metric
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
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.engine.core import StepContext
from keras_tpu_mem.engine.jax_shared import SEED_STRIDE as _SEED_STRIDE
from keras_tpu_mem.engine.jax_shared import combine as _combine
from keras_tpu_mem.engine.jax_shared import leading_dim as _leading_dim
from keras_tpu_mem.engine.jax_shared import offset_seed as _offset_seed
from keras_tpu_mem.engine.jax_shared import restore_variables as _restore_variables


class PulledMicroBatchSteps:
    """The pulled-micro-batch train function of `JaxStep` (see the module docstring)."""

    def _pulled_step(self, features, k, apply, state, accumulators, data,
                     feature_state=None):
        """One micro-batch of Keras' accumulation convention (`dataset_yields=
        "micro_batches"`): `(state, accumulators, data[, feature_state]) -> (logs,
        state, accumulators[, carried values])`.

        Adds the gradient of this micro-batch's loss / k to the local
        accumulators; with `apply` (the last micro-batch of a window) applies
        their sum once and hands back zeros. Under a data-parallel axis of more
        than one device the accumulators carry a leading per-device axis
        sharded on the batch axis and the gradients stay per device (inside
        `shard_map`): the only gradient reduction is the applying step's one
        `psum`.
        """
        model = self.model
        has_feature_state = any(self._feature_variables(features))
        if feature_state is None:
            feature_state = self.feature_state(features)
        feature_state = (list(feature_state[0]), list(feature_state[1]))
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        extras = {}
        for feature in features:
            data, more = feature.split_extras(data)
            extras.update(more)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = (x, y, sample_weight, extras)
        micro = _leading_dim(batch)
        if micro is None:
            raise ValueError("keras_tpu_mem's engine found no batched array in the data.")
        shards = self.num_replicas()
        if micro % shards:
            raise ValueError(
                f"GradientAccumulation(steps={k}, dataset_yields='micro_batches'): the "
                f"micro-batch of {micro} does not split over the {shards} data-parallel "
                f"devices of the active keras.distribution; use a dataset batch size that "
                f"is a multiple of {shards}.")
        accumulators = list(accumulators)
        if shards == 1:
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
        model = self.model
        distribution = keras.distribution.distribution()
        axis = distribution.batch_dim_name
        mesh = jax_compat.backend_mesh(distribution.device_mesh)
        seed_ids = {id(generator.state)
                    for layer in keras_compat.flatten_layers(model, include_self=True)
                    for generator in jax_compat.seed_generators(layer)}
        seeds = [id(v) in seed_ids for v in model.non_trainable_variables]
        non_trainable_agg = [v.aggregation for v in model.non_trainable_variables]
        metrics_agg = [v.aggregation for v in model.metrics_variables]

        def local(trainable, non_trainable, optimizer_vars, metrics_vars, accumulators,
                  batch, feature_state):
            offset = (jax.lax.axis_index(axis).astype(jnp.uint32)
                      * jnp.uint32(_SEED_STRIDE))
            start = [_offset_seed(v, offset) if s else v
                     for v, s in zip(non_trainable, seeds)]
            with jax_compat.tensor_layouts_for_manual_axes(distribution, {axis}):
                grads, local_non_trainable, local_metrics, updated = self._one_micro_batch(
                    features, trainable, start, optimizer_vars, metrics_vars, batch, k,
                    feature_state)
            sums = [a[0] + g.astype(a.dtype) for a, g in zip(accumulators, grads)]
            if apply:
                # The one gradient reduction of the window (see `_sharded_micro_batches`).
                grads = [jax.lax.psum(s, axis) / shards for s in sums]
                accumulators = [jnp.zeros_like(a) for a in accumulators]
            else:
                grads = []
                accumulators = [s[None] for s in sums]
            local_non_trainable = [_offset_seed(v, -offset) if s else v
                                   for v, s in zip(local_non_trainable, seeds)]
            non_trainable = [_combine(axis, shards, before, after, agg) if changed else before
                             for before, after, agg, changed in zip(
                                 non_trainable, local_non_trainable, non_trainable_agg,
                                 updated)]
            metrics_vars = [_combine(axis, shards, before, after, agg)
                            for before, after, agg in zip(metrics_vars, local_metrics,
                                                          metrics_agg)]
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

    def accumulator_shardings(self):
        """Shardings of the pulled-micro-batch accumulators (None without a
        distribution): each trainable weight's, with a leading per-device axis on
        the batch axis when that axis has more than one device."""
        distribution = keras.distribution.distribution()
        if distribution is None:
            return None
        mesh = jax_compat.backend_mesh(distribution.device_mesh)
        shards = self.num_replicas()
        shardings = []
        for variable in self.model.trainable_variables:
            sharding = getattr(variable.value, "sharding", None)
            spec = tuple(getattr(sharding, "spec", ()) or ())
            spec = spec + (None,) * (len(variable.shape) - len(spec))
            if shards > 1:
                spec = (distribution.batch_dim_name, *spec)
            shardings.append(jax.sharding.NamedSharding(mesh, PartitionSpec(*spec)))
        return shardings

    def zero_accumulators(self, shardings=None):
        """Fresh zero accumulators for `dataset_yields="micro_batches"` (one per
        trainable weight; a leading per-device axis under a data-parallel axis >1)."""
        shards = self.num_replicas()
        zeros = []
        for i, variable in enumerate(self.model.trainable_variables):
            shape = tuple(variable.shape)
            if shards > 1:
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
        steps = {apply: functools.partial(self._pulled_step, features, k, apply)
                 for apply in (False, True)}
        if not jit:
            return steps
        out_shardings = None
        if keras.distribution.distribution() is not None:
            out_shardings = (None, jax_compat.state_sharding_spec(self.model),
                             self.accumulator_shardings())
            carried, frozen = self._feature_variables(self.features)
            if carried or frozen:
                out_shardings += ([v.value.sharding for v in carried],)
        return {apply: jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)
                for apply, step in steps.items()}

    def _build_pulled_train_function(self, k: int) -> Callable:
        model = self.model
        spe = int(model.steps_per_execution)
        if spe % k and k % spe:
            raise ValueError(
                f"GradientAccumulation(steps={k}, dataset_yields='micro_batches') with "
                f"steps_per_execution={spe}: one must divide the other (steps_per_execution "
                "counts micro-batches here, Keras' unit), e.g. steps_per_execution="
                f"{k} or {2 * k}.")
        if not model.built or not model.trainable_variables:
            raise ValueError(
                "GradientAccumulation(dataset_yields='micro_batches') needs a built model: "
                "build it (an `Input` layer, or call it once on a batch) before `fit`.")
        jit = not model.run_eagerly and bool(model.jit_compile)
        steps = self.make_pulled_steps(k, jit=jit)
        self.jitted_step = None
        shardings = self.accumulator_shardings()
        engine = self.engine
        carried, frozen = self._feature_variables(self.features)
        # The accumulators live here, beside Keras' state, never in a variable:
        # transient (zero at every window's end; windows never span epochs).
        # `position` is the window position they were left at: a fit starts at
        # position 0 (the engine resets it), so a window an interrupted fit left
        # behind never leaks into the next one.
        held = {"accumulators": None, "position": 0}

        def run(apply, state, data):
            if carried or frozen:
                logs, state, accumulators, values = steps[apply](
                    state, held["accumulators"], data, self.feature_state())
                for variable, value in zip(carried, values):
                    jax_compat.set_variable_value(variable, value)
            else:
                logs, state, accumulators = steps[apply](state, held["accumulators"], data)
            held["accumulators"] = accumulators
            return logs, state

        def micro_step(state, data):
            position = engine._window_position
            if held["accumulators"] is None or position != held["position"]:
                held["accumulators"] = self.zero_accumulators(shardings)
            apply = position == k - 1
            held["position"] = -1  # in flight: a failure leaves nothing to reuse
            logs, state = run(apply, state, data)
            engine._window_position = (position + 1) % k
            held["position"] = engine._window_position
            return logs, state

        def train_function(state, iterator):
            count = engine.steps_for_this_call() or spe
            synced = jax_compat.state_synced(model)
            given = state
            try:
                logs, state = micro_step(state, next(iterator))
                for _ in range(count - 1):
                    try:
                        data = next(iterator)
                    except StopIteration:  # the data ended inside this call
                        break
                    logs, state = micro_step(state, data)
            except StopIteration:
                raise
            except Exception as error:
                held["accumulators"], held["position"] = None, 0
                # As in `JaxStep.build_train_function`: the variables get back
                # this call's input state, where the failed step left it alive.
                _restore_variables(model, given)
                clearer = engine.explain(error)
                if clearer is not None:
                    raise clearer from error
                raise
            finally:
                jax_compat.set_state_synced(model, synced)
            return logs, state

        train_function.jitted_step = None
        train_function.pulled_steps = steps
        train_function.zero_accumulators = lambda: self.zero_accumulators(shardings)
        return train_function
