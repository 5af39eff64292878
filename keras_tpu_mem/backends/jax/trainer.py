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
* **the gradient's reduction** is one small object chosen when the step is
  built (`reducers.choose_reducer`): `Spmd` (one data-parallel device, the
  step on global arrays), `ReplicatedShardMap` (replicated state: the
  micro-batch loop inside `shard_map` over the batch axis, one `psum` after
  it) or `ShardedShardMap` (state split over the batch axis, FSDP / ZeRO:
  gathers and reduce-scatters; run without features too once
  `engine.core.engage(model)` was called). What they reduce is computed by
  `gradients.LocalGradients` (the loss, its gradient, the metrics).
* **micro-batching**: the batch is split into `k` equal micro-batches that run
  one after another in a `lax.scan` inside the compiled step (one
  micro-batch's activations alive at a time), gradients summed, **one**
  optimizer update.
* **micro-batches pulled from the data** (`dataset_yields="micro_batches"`,
  `pulled.py`): each micro-batch is one call of an accumulating or (the
  k-th) applying jitted step, `(state, accumulators, data)`; the accumulators
  are arrays held by the train function where the reducer says (a leading
  per-device axis, or the gradient's sharding), so gradients are reduced once,
  in the applying step.
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
from typing import NamedTuple

import jax
import keras
import numpy as np

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem._utils import logger
from keras_tpu_mem.backends.jax.feature_state import (
    FeatureStates,
    FeatureValues,
    carrying_step,
    check_quiet,
    frozen_mapping,
    frozen_variables,
    quiet_steps_possible,
)
from keras_tpu_mem.backends.jax.gradients import Batch, LocalGradients, TrainState
from keras_tpu_mem.backends.jax.host_copy import HostCopier, one_copy_each, wait_for_host_copies
from keras_tpu_mem.backends.jax.layout import (
    make_state_layout,
    model_state_layout,
    partitioner_shards_state,
)
from keras_tpu_mem.backends.jax.pulled import (
    accumulator_shardings,
    pulled_train_function,
    zero_accumulators,
)
from keras_tpu_mem.backends.jax.reducers import choose_reducer
from keras_tpu_mem.backends.jax.train_function import multi_step_train_function, restore_variables
from keras_tpu_mem.backends.mesh import data_parallel_size
from keras_tpu_mem.backends.step import StepContext, check_pulled_micro_batches, micro_batch_count
from keras_tpu_mem.backends.structure import leading_dim as _leading_dim


# ------------------------------------------------------------- distribution
def update_variable(variable, fn, *args):
    """`fn(variable, *args)`: the step is one SPMD program inside a
    `keras.StatelessScope`, where an assignment becomes the step's new value on
    every device (contract: `backends/tensorflow/trainer.py`'s `update_variable`)."""
    return fn(variable, *args)


def _raising(error: Exception):
    """An iterator whose first `next()` raises `error` (the data's own, taken by a peek)."""
    raise error
    yield  # a generator: the error comes at the first `next()`, not at the call


class _StepInputs(NamedTuple):
    """What every step reads first from its data and feature values."""

    has_feature_state: bool  # the features have state or frozen variables: the step
    # takes them as its third argument and returns the new states
    feature_state: FeatureValues
    batch: Batch
    size: int  # the leading batch dimension


def _host_readable(live):
    """`arrays(variables)`: what a copy to host reads of their values where `live` (a
    `live_reader`) finds them (`host_copy.one_copy_each`), refused where one is split
    over several processes' devices: no process holds it whole to read."""
    def arrays(variables) -> list:
        values = live(variables)
        split = [v.path for v, value in zip(variables, values) if _split_over_processes(value)]
        if split:
            raise ValueError(
                f"{len(split)} values (e.g. {split[0]!r}) are split over several processes' "
                f"devices (this job has {jax.process_count()} processes): no process holds "
                "them whole to read.")
        return one_copy_each(values)
    return arrays


def _split_over_processes(value) -> bool:
    """Whether `value` is split over several processes' devices (not fully addressable
    and not replicated)."""
    return (not getattr(value, "is_fully_addressable", True)
            and not value.is_fully_replicated)


class Step:
    """Builds the JAX train function for an `Engine` (keras.distribution).

    Each built step gets one reducer (`reducers.choose_reducer`, from the state's
    layout and the distribution's batch axis), which computes and reduces its
    gradient; the step around it reads the data, applies the optimizer once and
    runs the features' `after_update`.

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
        #: Each feature's state between jitted calls (`Feature.init_state`).
        self.states = FeatureStates(self.model)

    @property
    def features(self) -> list:
        return self.engine.features

    # ------------------------------------------------------ engine protocol
    def num_replicas(self) -> int:
        """Data-parallel shards (the size of the distribution's batch axis)."""
        return data_parallel_size()

    def owns_step(self) -> bool:
        """True when the model's state is split over the batch axis: its `fit` needs
        the engine's step even without features (`reducers.ShardedShardMap`), except
        on a TPU, whose SPMD partitioner shards Keras' own step better
        (`layout.partitioner_shards_state`)."""
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

    def skip_call(self, args, count: int):
        """Runs a call `(state, iterator)` of a resumed fit without its step: reads its
        `count` batches (one super batch where Keras stacks a call's steps) and returns
        `({}, state)` unchanged. The end of the data passes through as in a step."""
        state, iterator = args[0], args[1]
        data = next(iterator)
        if jax_compat.super_batch_steps(self.model, data) is None:
            for _ in range(count - 1):
                try:
                    next(iterator)
                except StopIteration:  # the data ended inside this call
                    break
        return {}, state

    @staticmethod
    def split_over_processes(variables) -> list[str]:
        """The paths of the variables whose values are split over several processes'
        devices (a `jax.distributed` job with state sharded over its processes): no
        process holds them whole, so `state_values` cannot read them. A value
        replicated on every device of several processes is not split."""
        return [v.path for v in variables if _split_over_processes(v.value)]

    def state_values(self, variables) -> list:
        """The variables' values as numpy arrays, outside the step (`state_reader`)."""
        return self.state_reader()(variables)

    def state_reader(self):
        """`read(variables)`: their values as numpy arrays, outside the step, for the
        rest of this fit, read where Keras' `fit` holds them (mid-epoch not synced
        into the variables for it: `jax_compat.fit_state_values`): a replicated
        value from this process's first copy. A value split over several processes'
        devices is refused (`split_over_processes`)."""
        arrays = _host_readable(self.live_reader())
        return lambda variables: wait_for_host_copies(arrays(variables))

    def state_copier(self):
        """`start(variables)`: starts copying their values into host memory, read as
        `state_reader` reads them, without waiting for the steps in flight (into
        each device's pinned host memory: `host_copy`), and returns `collect()`,
        which waits for the copies and gives them as numpy arrays: a checkpoint's
        save starts them on the training thread and writes on its own thread. For
        the rest of this fit."""
        arrays, copier = _host_readable(self.live_reader()), HostCopier()
        return lambda variables: copier.start(arrays(variables))

    def live_reader(self):
        """`read(variables)`: their arrays as they lie on the devices now, where Keras'
        `fit` holds them, for the rest of this fit: no copy, and mid-epoch none synced
        into the variables for it (`jax_compat.fit_state_values`). What Orbax writes
        (`ShardedCheckpoint`: each process its shards, split values too); the next
        step donates them, so a reader copies them off before it is dispatched."""
        model, index = self.model, jax_compat.fit_state_index(self.model)
        return lambda variables: jax_compat.fit_state_values(model, variables, index)

    @staticmethod
    def writes_checkpoints() -> bool:
        """Whether this process writes the checkpoints' files (of split state, its
        record and commit): process 0 of a `jax.distributed` job (each process reads
        the checkpoints back), the only process otherwise."""
        return jax.process_index() == 0

    @staticmethod
    def preemption_sync():
        """Where this process is part of a `jax.distributed` job: JAX's preemption
        service's sync point, `reached(call) -> bool` (the service catches the
        notice, SIGTERM, on any process and makes it true at the same call on every
        process, each calling it at the same update boundaries with consecutive
        numbers). None where no such job runs: the process catches the notice
        itself. Raises RuntimeError where the job runs without the service."""
        if not jax.distributed.is_initialized():
            return None
        if not jax.config.jax_enable_preemption_service:
            raise RuntimeError("this jax.distributed job runs without JAX's preemption "
                               "service (`jax_enable_preemption_service` is off)")
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point

    def abandon_call(self, args) -> None:
        """Puts a call's input state `(state, iterator)` back into the model's variables
        (Keras' fit took their values out for its loop) when the call is refused
        before its step runs (`engine.FitRefused`)."""
        restore_variables(self.model, args[0])

    # ------------------------------------------------------- feature state
    def start_feature_states(self, features) -> bool:
        """Each feature's `init_state`, at the start of a fit. False: a step traced
        before still holds (states are its inputs)."""
        self.states.start(features)
        return False

    def feature_state(self, feature):
        """`feature`'s state as the last call left it (None: none)."""
        return self.states.get(feature)

    def set_feature_state(self, feature, state) -> None:
        """Replaces `feature`'s state for the next call (see `FeatureStates.set`)."""
        self.states.set(feature, state)

    def feature_values(self, features=None) -> FeatureValues:
        """The features' states and frozen values, as the step takes them as its third
        argument."""
        features = self.features if features is None else features
        return FeatureValues(self.states.for_step(features),
                             [v.value for v in frozen_variables(features)])

    def _after_update(self, features, trainable, non_trainable, optimizer_vars,
                      values: FeatureValues, ctx):
        """The features' `after_update` hooks as a function of values: each runs in a
        `keras.StatelessScope` mapping the model's and the optimizer's variables to their
        post-update values (and the frozen ones to theirs), with its state as
        `ctx.state`; its assignments become the model's new values and what it returns
        its new state (the step stays pure, and the same hook runs on TensorFlow, where
        it writes the variables). Returns `(trainable, non_trainable, new states)`."""
        model = self.model
        carried = dict(values.carried)
        hooks = [f for f in features if self.engine.has_hook(f, "after_update")]
        if not hooks:
            return trainable, non_trainable, carried
        groups = [(model.trainable_variables, list(trainable)),
                  (model.non_trainable_variables, list(non_trainable))]
        frozen = frozen_mapping(features, values)
        for feature in hooks:
            mapping = [*zip(model.optimizer.variables, optimizer_vars), *frozen,
                       *zip(groups[0][0], groups[0][1]), *zip(groups[1][0], groups[1][1])]
            ctx.state = carried.get(feature.name)
            with keras.StatelessScope(state_mapping=mapping) as scope:
                new = feature.after_update(ctx)
            if new is not None:
                if feature.name not in carried:
                    raise ValueError(
                        f"{type(feature).__name__}.after_update returned a state, but its "
                        "init_state returned None: a feature's state is made by "
                        "init_state.")
                carried[feature.name] = keras.tree.map_structure(
                    lambda value, old: jax.numpy.asarray(value, old.dtype), new,
                    carried[feature.name])
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
                        "the model's variables (and return their own state).")
        ctx.state = None
        return groups[0][1], groups[1][1], carried

    # --------------------------------------------------------------- the steps
    def _inputs(self, features, data, feature_state, shards, what, instead) -> _StepInputs:
        """What every step reads first; the batch must split over the `shards`
        data-parallel devices (else a `ValueError` naming `what` and `instead`)."""
        if feature_state is None:
            feature_state = self.feature_values(features)
        feature_state = FeatureValues(dict(feature_state[0]), list(feature_state[1]))
        has_feature_state = bool(feature_state.carried) or bool(feature_state.frozen)
        extras = {}
        for feature in features:
            data, more = feature.split_extras(data)
            extras.update(more)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = Batch(x, y, sample_weight, extras)
        size = _leading_dim(batch)
        if size is None:
            raise ValueError("keras_tpu_mem's engine found no batched array in the data.")
        if size % shards:
            raise ValueError(
                f"{what} of {size} does not split over the {shards} data-parallel devices "
                f"of the active keras.distribution; use {instead} that is a multiple of "
                f"{shards}.")
        return _StepInputs(has_feature_state, feature_state, batch, size)

    def _step(self, local, reducer, state, data, feature_state=None, quiet=False):
        """One update, its gradient from `reducer`. `local` holds the build's snapshot
        of the engine's features, so that a later trace of the same step
        (`jitted_step.lower`) builds the same step.

        With features that have state (`init_state`) or frozen variables the step is
        `(state, data, feature_values) -> (logs, state, new states)` (`quiet`: no new
        states, see `Feature.quiet_update`); called without `feature_values`, the held
        states (or `init_state`'s) and the frozen variables' values are used (as
        constants)."""
        model, features = self.model, local.features
        inputs = self._inputs(features, data, feature_state, reducer.shards,
                              "The global batch", "a global batch")
        state = TrainState(*state)
        num_micro = micro_batch_count(features, inputs.size // reducer.shards)
        if isinstance(num_micro, bool) or not isinstance(num_micro, (int, np.integer)):
            raise TypeError(f"A feature returned {num_micro!r} micro-batches; the JAX "
                            "engine needs a Python int (shapes are static under jit).")
        num_micro = int(num_micro)
        reduced = reducer.gradients(local, state, inputs.batch, num_micro,
                                    inputs.feature_state)
        trainable, optimizer_vars = model.optimizer.stateless_apply(
            state.optimizer, reduced.grads, state.trainable)
        logs = (reduced.logs if reduced.logs is not None
                else local.metrics_result(reduced.metrics))
        x, y, sample_weight, extras = inputs.batch
        ctx = StepContext(model, x, y, sample_weight, None, extras, num_micro, quiet=quiet)
        trainable, non_trainable, carried = self._after_update(
            features, trainable, reduced.non_trainable, optimizer_vars,
            inputs.feature_state, ctx)
        new_state = (trainable, non_trainable, optimizer_vars, reduced.metrics)
        if quiet:  # `make_step(quiet=True)`: the states stay as they came
            check_quiet(features, inputs.feature_state.carried, carried)
        elif inputs.has_feature_state:
            return logs, new_state, carried
        return logs, new_state

    def _pulled_step(self, local, reducer, k, apply, state, accumulators, data,
                     feature_state=None):
        """One micro-batch of Keras' accumulation convention (`dataset_yields=
        "micro_batches"`, see `pulled.py`): `(state, accumulators, data[,
        feature_state]) -> (logs, state, accumulators[, carried values])`.

        `reducer.accumulate` adds the gradient of this micro-batch's loss / k to
        the accumulators; with `apply` (the last micro-batch of a window) their
        sum is applied once and the accumulators come back as zeros."""
        model, features = self.model, local.features
        inputs = self._inputs(
            features, data, feature_state, reducer.shards,
            f"GradientAccumulation(steps={k}, dataset_yields='micro_batches'): the "
            "micro-batch", "a dataset batch size")
        state = TrainState(*state)
        out = reducer.accumulate(local, state, list(accumulators), inputs.batch, k, apply,
                                 inputs.feature_state)
        trainable, non_trainable, optimizer_vars = (state.trainable, out.non_trainable,
                                                    state.optimizer)
        carried = inputs.feature_state.carried
        if apply:
            trainable, optimizer_vars = model.optimizer.stateless_apply(
                optimizer_vars, out.grads, trainable)
            x, y, sample_weight, extras = inputs.batch
            ctx = StepContext(model, x, y, sample_weight, None, extras, k)
            trainable, non_trainable, carried = self._after_update(
                features, trainable, non_trainable, optimizer_vars, inputs.feature_state,
                ctx)
        logs = local.metrics_result(out.metrics)
        new_state = (list(trainable), list(non_trainable), list(optimizer_vars),
                     list(out.metrics))
        if inputs.has_feature_state:
            return logs, new_state, out.accumulators, dict(carried)
        return logs, new_state, out.accumulators

    # -------------------------------------------------------- the train function
    def _out_shardings(self, *more, quiet=False):
        """`out_shardings` of a jitted step under a `keras.distribution` (None
        without): the state's, then `more`, then the carried feature values'."""
        if keras.distribution.distribution() is None:
            return None
        out_shardings = (None, jax_compat.state_sharding_spec(self.model), *more)
        values = self.feature_values()
        if (values.carried or values.frozen) and not quiet:
            # The features' states (pruning masks) keep the shardings they were given
            # (a mask: its kernel's), step after step.
            out_shardings += (jax.tree_util.tree_map(lambda v: v.sharding, values.carried),)
        return out_shardings

    def _reducer(self, layout):
        return choose_reducer(self.model, layout, self.num_replicas())

    def make_step(self, jit: bool = True, state_shardings=None, quiet=False) -> Callable:
        """The step `(state, data) -> (logs, state)` for the engine's current features.

        Jitted as `fit` jits it (`donate_argnums=0`; under a `keras.distribution`
        the variables' current shardings as `out_shardings`, so call it before
        `fit` purges them), unless `jit=False`. For compiling the step without
        a `fit` (memory analysis, planning): `make_step().lower(state,
        batch).compile()`. The step keeps a snapshot of the features and its
        reducer, chosen from the state's layout (read from `state_shardings`, else
        from the variables' values: state split over the batch axis gets the
        sharded step), so a later trace builds the same step. `quiet`: the step
        for quiet updates."""
        layout = (model_state_layout(self.model) if state_shardings is None
                  else make_state_layout(self.model, state_shardings))
        step = functools.partial(self._step, LocalGradients(self.model, self.features),
                                 self._reducer(layout), quiet=quiet)
        if not jit:
            return step
        return jax.jit(step, donate_argnums=0, out_shardings=self._out_shardings(quiet=quiet))

    def make_pulled_steps(self, k: int, jit: bool = True, state_shardings=None):
        """`({False: accumulating step, True: applying step}, reducer)` of
        `_pulled_step`, jitted with `donate_argnums=(0, 1)` (state and accumulators)
        unless `jit=False`. The reducer is chosen from the state's layout, read from
        `state_shardings` where given (as `make_step`), else from the variables' values."""
        layout = (model_state_layout(self.model) if state_shardings is None
                  else make_state_layout(self.model, state_shardings))
        reducer = self._reducer(layout)
        local = LocalGradients(self.model, self.features)
        steps = {apply: functools.partial(self._pulled_step, local, reducer, k, apply)
                 for apply in (False, True)}
        if jit:
            out_shardings = self._out_shardings(accumulator_shardings(self.model, reducer))
            steps = {apply: jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)
                     for apply, step in steps.items()}
        return steps, reducer

    def build_train_function(self) -> Callable:
        model = self.model
        if jax_compat.is_nnx_enabled():
            raise NotImplementedError(
                "keras_tpu_mem's JAX engine does not support Keras' Flax NNX mode "
                "(keras.config.is_nnx_enabled() is True); unset KERAS_NNX_ENABLED.")
        jit = not model.run_eagerly and bool(model.jit_compile)
        values = self.feature_values()
        carries = bool(values.carried) or bool(values.frozen)
        pulled = self.engine.batches_per_update()
        if pulled > 1:
            check_pulled_micro_batches(model, pulled)
            steps, reducer = self.make_pulled_steps(pulled, jit=jit)
            self.jitted_step = None
            shardings = accumulator_shardings(model, reducer)
            return pulled_train_function(
                model, self.engine, pulled, steps,
                lambda: zero_accumulators(model, reducer, shardings),
                self.states if carries else None, self.features)
        step = self.make_step(jit=jit)
        self.jitted_step = step if jit else None
        if carries:
            # Carried from call to call beside Keras' state (and a quiet step, if any).
            quiet = (self.make_step(jit=jit, quiet=True) if quiet_steps_possible(
                model, self.features, self.states, self.engine.has_hook) else None)
            step = carrying_step(model, self.features, self.states, step, quiet)
        train_function = multi_step_train_function(
            model, self.engine, step, int(model.steps_per_execution))
        train_function.jitted_step = self.jitted_step
        return train_function
