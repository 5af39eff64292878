"""The JAX trainer: the engine's composable step as one jitted, stateless function.

`keras_tpu_mem.engine` holds what is backend-neutral (features, registration,
lifetime) and builds its step with `backends.current().trainer.Step(engine)`;
this module is that step on JAX, where Keras' `fit` calls
`logs, state = model.train_function(state, iterator)` with
`state = (trainable, non_trainable, optimizer_variables, metrics_variables)`:

* **one step** (`_step`): Keras' documented JAX custom-step pattern —
  `stateless_call` + `stateless_compute_loss` inside `jax.value_and_grad`,
  the features' `transform_loss`, one `optimizer.stateless_apply` — and the
  metrics' stateless updates, jitted with `donate_argnums=0` and the active
  `keras.distribution`'s state shardings as `out_shardings`, as Keras' own
  `make_train_function` does. Everything else (data placement, sharding of
  the forward pass) is the distribution's, unchanged.
* **micro-batching**: the batch is split into `k` equal micro-batches that run
  one after another in a `lax.scan` inside the compiled step (one
  micro-batch's activations alive at a time), gradients summed, **one**
  optimizer update. With a data-parallel axis of more than one device the loop
  runs inside `shard_map` over that axis only (a `ModelParallel` model axis
  stays automatic): every device slices *its own share* of the batch, sums
  its own gradients through the loop, and one `psum` after the loop reduces
  them — no collective inside the loop body (on a plain `scan` over the global
  array XLA puts the gradient all-reduce inside the loop: one per
  micro-batch), and no resharding of the batch.
* **micro-batches pulled from the data** (`dataset_yields="micro_batches"`,
  `trainer_pulled.py`): each micro-batch is one call of an accumulating or (the
  k-th) applying jitted step, `(state, accumulators, data)`; the accumulators
  are arrays held by the train function (a leading per-device axis on a
  data-parallel axis >1), so gradients are reduced once, in the applying step.
* **sharded state** (a state value's sharding names the batch axis: FSDP /
  ZeRO): the gradient in `shard_map`, an `all_gather` per sharded weight and
  reduce-scatters (`trainer_sharded.py`); run without features too once
  `engine.core.engage(model)` was called.
* **"Per replica" on JAX** means per data-parallel shard: the global batch
  divided by the size of the distribution's batch axis (`DataParallel(8)`: per
  device; `ModelParallel` on a (2, 4) mesh: per group of 4 devices that share
  a batch shard; no distribution: the whole batch). `GradientAccumulation`
  splits that share.
* **`steps_per_execution = N`**: like Keras' JAX trainer, N calls of the jitted
  step per train-function call (a Python loop: JAX dispatches them
  asynchronously); the last call of an epoch runs the remainder (9 steps,
  N=4: 4, 4, 1), as the TensorFlow engine does.

State is only ever Keras variables' values, so `BackupAndRestore` and
checkpoints carry everything; nothing here keeps training state of its own.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import logger
from keras_tpu_mem.backends.jax.feature_state import (
    carrying_step,
    check_quiet,
    quiet_steps_possible,
)
from keras_tpu_mem.backends.jax.trainer_pulled import PulledMicroBatchSteps
from keras_tpu_mem.backends.jax.trainer_sharded import (
    ShardMapGradients,
    make_state_layout,
    model_state_layout,
    partitioner_shards_state,
)
from keras_tpu_mem.backends.jax.trainer_shared import leading_dim as _leading_dim
from keras_tpu_mem.backends.jax.trainer_shared import (
    multi_step_train_function as _multi_step_train_function,
)
from keras_tpu_mem.backends.step import StepContext


# ------------------------------------------------------------- distribution
def data_parallel_size(distribution=None) -> int:
    """Devices along the batch axis of a `keras.distribution` (1 without one).

    Args:
        distribution: A `keras.distribution.Distribution`; the active one if None.

    Returns:
        The number of data-parallel shards the global batch is split into.
    """
    if distribution is None:
        distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    names = list(mesh.axis_names)
    if distribution.batch_dim_name not in names:
        return 1
    return int(mesh.shape[names.index(distribution.batch_dim_name)])


def data_parallel_devices(distribution=None) -> list:
    """The JAX devices that hold the batch: the distribution's, else `jax.devices()[:1]`."""
    if distribution is None:
        distribution = keras.distribution.distribution()
    if distribution is None:
        return jax.devices()[:1]
    return list(np.asarray(distribution.device_mesh.devices).flat)


def update_variable(variable, fn, *args):
    """`fn(variable, *args)`: the step is one SPMD program inside a
    `keras.StatelessScope`, where an assignment becomes the step's new value on
    every device (contract: `backends/tensorflow/trainer.py`'s `update_variable`)."""
    return fn(variable, *args)


def _raising(error: Exception):
    """An iterator whose first `next()` raises `error` (the data's own, taken by a peek)."""
    raise error
    yield  # a generator: the error comes at the first `next()`, not at the call


class Step(PulledMicroBatchSteps, ShardMapGradients):
    """Builds the JAX train function for an `Engine` (keras.distribution).

    Attributes:
        jitted_step: The last built `jax.jit` step `(state, data) -> (logs,
            state)` (None before the first build, or with `run_eagerly` /
            `jit_compile=False`), for `lower(...).compile()` (memory analysis,
            the HLO); the train function carries it too, as `.jitted_step`.
    """

    #: Supports `Feature.batches_per_update` (Keras' accumulation convention).
    pulls_micro_batches = True

    def __init__(self, engine):
        self.engine = engine
        self.model = engine.model
        self.jitted_step = None

    @property
    def features(self) -> list:
        return self.engine.features

    # ------------------------------------------------------ engine protocol
    def num_replicas(self) -> int:
        """Data-parallel shards (the size of the distribution's batch axis)."""
        return data_parallel_size()

    def owns_step(self) -> bool:
        """True when the model's state is split over the batch axis: its `fit` needs
        the engine's step even without features (`trainer_sharded`), except on a TPU,
        whose SPMD partitioner shards Keras' own step better
        (`partitioner_shards_state`)."""
        return model_state_layout(self.model) is not None and not partitioner_shards_state()

    def distribution_key(self):
        # The object itself, compared by identity: the cache key keeps it alive,
        # so an id can never be reused by another distribution. Sharded state adds
        # its layout: a reshard under the same distribution builds a new step.
        layout = model_state_layout(self.model)
        if layout is None:
            return keras.distribution.distribution()
        return keras.distribution.distribution(), layout.weight_dims, layout.optimizer_dims

    def global_batch_size_of_call(self, args):
        """Always None: the data of a call `(state, iterator)` is an iterator, which
        cannot be read without consuming it; `peek_first_call` reads and puts back."""
        return None

    def peek_first_call(self, args):
        """Returns `(global_batch_size, args)` for a call `(state, iterator)`.

        Takes the first batch from the iterator and returns args whose iterator
        yields it again first, followed by the rest of the original iterator. It
        never raises and never loses a batch: once the batch is taken it goes
        back in front whatever reading its size does (a size that cannot be read
        is None, with a warning), and an error of the data itself comes out of
        the step's own first `next()`, as it would without the peek (the end of
        the data too: nothing was taken).
        """
        state, iterator, rest = args[0], args[1], args[2:]
        try:
            first = next(iterator)
        except StopIteration:
            return None, args
        except Exception as err:
            return None, (state, _raising(err), *rest)
        try:
            steps = jax_compat.super_batch_steps(self.model, first)
            size = _leading_dim(steps[0] if steps else first)
        except Exception as err:
            logger.warning("Could not read the global batch size of the first step (it "
                           "is reported as unknown): %s", err)
            size = None
        return size, (state, itertools.chain([first], iterator), *rest)

    # --------------------------------------------------------- loss and grads
    def _loss(self, features, trainable, non_trainable, metrics_vars, optimizer_vars, x, y,
              sample_weight, extras, num_micro, feature_state=((), ())):
        """The loss to differentiate, as Keras' `compute_loss_and_updates` computes it,
        with the features' loss terms, divided by `num_micro`."""
        model = self.model
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
                   *self._feature_mapping(features, feature_state)]
        # Loss terms may read Keras variables (a temperature schedule, a
        # teacher's weights): they must see this step's values, not the purged
        # model variables nor concrete arrays jit would embed as constants.
        with keras.StatelessScope(state_mapping=mapping):
            for feature in features:
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
        return loss, (unscaled, y_pred, non_trainable, metrics_vars)

    def _grad_fn(self, features, gather=None):
        """`value_and_grad` of `_loss`; with `gather` (whole weights from the slices
        given, see `trainer_sharded`), the gradients are the slices'."""
        loss = functools.partial(self._loss, features)
        if gather is not None:
            def loss(trainable, *args, _loss=loss):
                return _loss(gather(trainable), *args)
        return jax.value_and_grad(loss, has_aux=True)

    def _update_metrics(self, metrics_vars, unscaled_loss, x, y, y_pred, sample_weight):
        """The loss tracker and compiled metrics, updated as Keras' JAX train_step does."""
        model = self.model
        with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables,
                                                         metrics_vars))) as scope:
            batch = _leading_dim(x)
            keras_compat.loss_tracker(model).update_state(unscaled_loss, sample_weight=batch)
            logs = model.compute_metrics(x, y, y_pred, sample_weight)
        new = []
        for variable, old in zip(model.metrics_variables, metrics_vars):
            value = scope.get_current_value(variable)
            new.append(old if value is None else value)
        return logs, new

    def _metrics_result(self, metrics_vars):
        model = self.model
        with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables,
                                                         metrics_vars))):
            return model.get_metrics_result()

    def _micro_batch_loop(self, features, trainable, non_trainable, optimizer_vars,
                          metrics_vars, batch, num_micro, feature_state=((), ()), gather=None):
        """Sum of the micro-batch gradients of `batch` (its rows, split in order),
        with the non-trainable and metric state threaded through the loop
        (`gather`: whole weights from the `trainable` given, which the gradients
        are of; see `trainer_sharded`).

        Returns `(gradient sums, non_trainable, metrics_vars, updated)`, where
        `updated[i]` says whether the step writes non-trainable variable `i`
        (learnt while the loop body is traced: Keras hands back the very input
        value of every variable nothing assigned).
        """
        updated = [False] * len(non_trainable)
        grad_fn = self._grad_fn(features, gather)
        micro = jax.tree_util.tree_map(
            lambda t: t.reshape(num_micro, t.shape[0] // num_micro, *t.shape[1:]), batch)

        def body(carry, micro_batch):
            sums, non_trainable, metrics_vars = carry
            x, y, sample_weight, extras = micro_batch
            (_, aux), grads = grad_fn(trainable, non_trainable, metrics_vars, optimizer_vars,
                                      x, y, sample_weight, extras, num_micro, feature_state)
            unscaled, y_pred, new_non_trainable, metrics_vars = aux
            for i, (old, new) in enumerate(zip(non_trainable, new_non_trainable)):
                updated[i] = updated[i] or new is not old
            _, metrics_vars = self._update_metrics(metrics_vars, unscaled, x, y, y_pred,
                                                   sample_weight)
            sums = [s + g.astype(s.dtype) for s, g in zip(sums, grads)]
            return (sums, list(new_non_trainable), metrics_vars), None

        zeros = [jnp.zeros(w.shape, w.dtype) for w in trainable]
        (sums, non_trainable, metrics_vars), _ = jax.lax.scan(
            body, (zeros, list(non_trainable), list(metrics_vars)), micro)
        return sums, non_trainable, metrics_vars, updated

    # ------------------------------------------------------- feature state
    @staticmethod
    def _feature_variables(features):
        """`(carried, frozen)` Keras variables the features own (see
        `Feature.step_variables` / `Feature.frozen_variables`), in feature order."""
        carried, frozen = [], []
        for feature in features:
            carried.extend(feature.step_variables())
            frozen.extend(feature.frozen_variables())
        return carried, frozen

    def _feature_mapping(self, features, feature_state):
        carried, frozen = self._feature_variables(features)
        values, frozen_values = feature_state
        if len(values) != len(carried) or len(frozen_values) != len(frozen):
            raise ValueError(
                f"The step got {len(values)} carried and {len(frozen_values)} frozen feature "
                f"values for {len(carried)} and {len(frozen)} feature variables; pass "
                "`Step.feature_state()` as the step's third argument.")
        return [*zip(carried, values), *zip(frozen, frozen_values)]

    def feature_state(self, features=None):
        """`(carried values, frozen values)` of the features' own variables, as the
        step takes them as its third argument."""
        carried, frozen = self._feature_variables(
            self.features if features is None else features)
        return [v.value for v in carried], [v.value for v in frozen]

    def _after_update(self, features, trainable, non_trainable, optimizer_vars, feature_state,
                      ctx):
        """The features' `after_update` hooks as a function of values: each runs in a
        `keras.StatelessScope` mapping the model's, the optimizer's and the features'
        variables to their post-update values; its assignments become the new values
        (the step stays pure, and the same hook runs on TensorFlow, where it writes
        the variables)."""
        model = self.model
        carried, _ = self._feature_variables(features)
        values = list(feature_state[0])
        hooks = [f for f in features if self.engine.has_hook(f, "after_update")]
        if not hooks:
            return trainable, non_trainable, values
        groups = [(model.trainable_variables, list(trainable)),
                  (model.non_trainable_variables, list(non_trainable)),
                  (carried, values)]
        for feature in hooks:
            mapping = [*zip(model.optimizer.variables, optimizer_vars),
                       *self._feature_mapping(features, (values, feature_state[1]))]
            mapping += [*zip(groups[0][0], groups[0][1]), *zip(groups[1][0], groups[1][1])]
            with keras.StatelessScope(state_mapping=mapping) as scope:
                feature.after_update(ctx)
            for variables, current in groups:
                for i, variable in enumerate(variables):
                    value = scope.get_current_value(variable)
                    if value is not None and value is not current[i]:
                        current[i] = value.astype(current[i].dtype)
            for variable, value in zip(model.optimizer.variables, optimizer_vars):
                if scope.get_current_value(variable) is not value:
                    raise ValueError(
                        f"{type(feature).__name__}.after_update assigned the optimizer "
                        f"variable {variable.path!r}; after-update hooks may write only "
                        "model and feature variables.")
            values = groups[2][1]
        return groups[0][1], groups[1][1], groups[2][1]

    # ---------------------------------------------------------------- the step
    def _step_inputs(self, features, data, feature_state):
        """What every step reads first: `(has_feature_state, feature_state, (x, y,
        sample_weight, extras), leading batch size, data-parallel shards)`."""
        has_feature_state = any(self._feature_variables(features))
        if feature_state is None:
            feature_state = self.feature_state(features)
        feature_state = (list(feature_state[0]), list(feature_state[1]))
        extras = {}
        for feature in features:
            data, more = feature.split_extras(data)
            extras.update(more)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = (x, y, sample_weight, extras)
        size = _leading_dim(batch)
        if size is None:
            raise ValueError("keras_tpu_mem's engine found no batched array in the data.")
        return has_feature_state, feature_state, batch, size, self.num_replicas()

    def _step(self, features, state, data, feature_state=None, layout=None, quiet=False):
        """One update. `features` is the build's snapshot of the engine's features, so
        that a later trace of the same step (`jitted_step.lower`) builds the same step.

        With features that own variables (`step_variables`/`frozen_variables`) the step
        is `(state, data, feature_state) -> (logs, state, carried values)` (`quiet`: no
        carried values, see `Feature.quiet_update`); called without `feature_state`,
        the variables' current values are used (as constants). `layout`: the state's
        `trainer_sharded.StateLayout` (None: replicated state)."""
        model = self.model
        has_feature_state, feature_state, batch, global_batch, shards = self._step_inputs(
            features, data, feature_state)
        trainable, non_trainable, optimizer_vars, metrics_vars = state
        x, y, sample_weight, extras = batch
        if global_batch % shards:
            raise ValueError(
                f"The global batch of {global_batch} does not split over the "
                f"{shards} data-parallel devices of the active keras.distribution; "
                f"use a global batch that is a multiple of {shards}.")
        num_micro = _micro_batch_count(features, global_batch // shards)
        if isinstance(num_micro, bool) or not isinstance(num_micro, (int, np.integer)):
            raise TypeError(f"A feature returned {num_micro!r} micro-batches; the JAX "
                            "engine needs a Python int (shapes are static under jit).")
        num_micro = int(num_micro)

        if layout is not None:  # sharded state: see trainer_sharded
            grads, non_trainable, metrics_vars = self._sharded_micro_batches(
                features, trainable, non_trainable, optimizer_vars, metrics_vars, batch,
                num_micro, shards, feature_state, layout=layout)
            trainable, optimizer_vars = model.optimizer.stateless_apply(
                optimizer_vars, grads, trainable)
            logs = self._metrics_result(metrics_vars)
        elif num_micro == 1:
            grad_fn = self._grad_fn(features)
            (_, aux), grads = grad_fn(trainable, non_trainable, metrics_vars, optimizer_vars,
                                      x, y, sample_weight, extras, 1, feature_state)
            unscaled, y_pred, non_trainable, metrics_vars = aux
            trainable, optimizer_vars = model.optimizer.stateless_apply(
                optimizer_vars, grads, trainable)
            logs, metrics_vars = self._update_metrics(metrics_vars, unscaled, x, y, y_pred,
                                                      sample_weight)
        else:
            if shards == 1:
                grads, non_trainable, metrics_vars, _ = self._micro_batch_loop(
                    features, trainable, non_trainable, optimizer_vars, metrics_vars, batch,
                    num_micro, feature_state)
            else:
                grads, non_trainable, metrics_vars = self._sharded_micro_batches(
                    features, trainable, non_trainable, optimizer_vars, metrics_vars, batch,
                    num_micro, shards, feature_state)
            trainable, optimizer_vars = model.optimizer.stateless_apply(
                optimizer_vars, grads, trainable)
            logs = self._metrics_result(metrics_vars)
        ctx = StepContext(model, x, y, sample_weight, None, extras, num_micro, quiet=quiet)
        trainable, non_trainable, carried = self._after_update(
            features, trainable, non_trainable, optimizer_vars, feature_state, ctx)
        new_state = (trainable, non_trainable, optimizer_vars, metrics_vars)
        if quiet:  # `make_step(quiet=True)`: the carried values stay as they came
            check_quiet(features, feature_state[0], carried)
        elif has_feature_state:
            return logs, new_state, carried
        return logs, new_state

    # ------------------------------------- micro-batches pulled from the data
    def _one_micro_batch(self, features, trainable, non_trainable, optimizer_vars,
                         metrics_vars, batch, k, feature_state, gather=None):
        """Gradient of one pulled micro-batch's loss / k, with the metrics updated.

        Returns `(grads, non_trainable, metrics_vars, updated)` as
        `_micro_batch_loop` does."""
        x, y, sample_weight, extras = batch
        grad_fn = self._grad_fn(features, gather)
        (_, aux), grads = grad_fn(trainable, non_trainable, metrics_vars, optimizer_vars,
                                  x, y, sample_weight, extras, k, feature_state)
        unscaled, y_pred, new_non_trainable, metrics_vars = aux
        updated = [new is not old for old, new in zip(non_trainable, new_non_trainable)]
        _, metrics_vars = self._update_metrics(metrics_vars, unscaled, x, y, y_pred,
                                               sample_weight)
        return grads, list(new_non_trainable), metrics_vars, updated

    # -------------------------------------------------------- the train function
    def make_step(self, jit: bool = True, state_shardings=None, quiet=False) -> Callable:
        """The step `(state, data) -> (logs, state)` for the engine's current features.

        Jitted as `fit` jits it (`donate_argnums=0`; under a `keras.distribution`
        the variables' current shardings as `out_shardings`, so call it before
        `fit` purges them), unless `jit=False`. For compiling the step without
        a `fit` (memory analysis, planning): `make_step().lower(state,
        batch).compile()`. The step keeps a snapshot of the features and of the
        state's layout (read from `state_shardings`, else from the variables'
        values: state split over the batch axis gets the sharded step), so a
        later trace builds the same step. `quiet`: the step for quiet updates."""
        layout = (model_state_layout(self.model) if state_shardings is None
                  else make_state_layout(self.model, state_shardings))
        step = functools.partial(self._step, tuple(self.features), layout=layout, quiet=quiet)
        if not jit:
            return step
        out_shardings = None
        if keras.distribution.distribution() is not None:
            out_shardings = (None, jax_compat.state_sharding_spec(self.model))
            carried, frozen = self._feature_variables(self.features)
            if (carried or frozen) and not quiet:
                # Carried feature values (pruning masks) keep the shardings they were
                # given (a mask: its kernel's), step after step.
                out_shardings += ([v.value.sharding for v in carried],)
        return jax.jit(step, donate_argnums=0, out_shardings=out_shardings)

    def build_train_function(self) -> Callable:
        model = self.model
        if jax_compat.is_nnx_enabled():
            raise NotImplementedError(
                "keras_tpu_mem's JAX engine does not support Keras' Flax NNX mode "
                "(keras.config.is_nnx_enabled() is True); unset KERAS_NNX_ENABLED.")
        pulled = self.engine.batches_per_update()
        if pulled > 1:
            return self._build_pulled_train_function(pulled)
        jit = not model.run_eagerly and bool(model.jit_compile)
        step = self.make_step(jit=jit)
        self.jitted_step = step if jit else None
        engine = self.engine
        per_call = int(model.steps_per_execution)
        carried, frozen = self._feature_variables(self.features)
        on_error = None
        if carried or frozen:
            # Carried from call to call beside Keras' state (and a quiet step, if any).
            quiet = (self.make_step(jit=jit, quiet=True) if quiet_steps_possible(
                model, self.features, self.engine.has_hook) else None)
            step, on_error = carrying_step(model, self.features, carried, frozen, step, quiet)
        train_function = _multi_step_train_function(model, engine, step, per_call,
                                                    on_error=on_error)
        train_function.jitted_step = self.jitted_step
        return train_function


def _micro_batch_count(features, per_replica_batch):
    """`Engine.micro_batch_count` over a snapshot of the features."""
    for feature in features:
        count = feature.micro_batches(per_replica_batch)
        if count is not None:
            return count
    return 1
