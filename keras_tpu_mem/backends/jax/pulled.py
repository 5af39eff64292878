"""Keras' accumulation convention on JAX: the train function of pulled micro-batches.

`GradientAccumulation(steps=k, dataset_yields="micro_batches")`: the dataset
yields micro-batches and each `fit` step is one of them. Two jitted steps
(`Step._pulled_step`) take `(state, accumulators, data)`: one adds this
micro-batch's gradient of loss / k to the accumulators, the other (the k-th)
applies their sum once, runs the features' `after_update` and hands back zeros;
Python picks one from the window position, so no conditional surrounds the
optimizer. Where each accumulator lives is the step's reducer's choice
(`reducers.py`): a leading per-device axis on the batch axis for a gradient the
applying step `psum`s once, the gradient's own sharding for one reduce-scattered
every micro-batch. The accumulators are JAX arrays held here, by the train
function (`Window`: transient, zero at every window's end, and windows never
span epochs), never Keras variables.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import keras
from jax.sharding import PartitionSpec

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.backends.jax.reducers import PER_DEVICE
from keras_tpu_mem.backends.jax.train_function import multi_step_train_function


def accumulator_shardings(model, reducer, weight_shardings=None):
    """Shardings of the accumulators (None without a distribution): each trainable
    weight's, with a leading per-device axis on the batch axis, or the batch axis
    moved to the dimension its gradient is reduce-scattered on, as
    `reducer.accumulators()` says. The weights' shardings are `weight_shardings` where
    given (a compile's, read from the layouts), else their values'."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    mesh = jax_compat.backend_mesh(distribution.device_mesh)
    axis = distribution.batch_dim_name
    if weight_shardings is None:
        weight_shardings = [getattr(v.value, "sharding", None)
                            for v in model.trainable_variables]
    shardings = []
    for variable, where, sharding in zip(model.trainable_variables, reducer.accumulators(),
                                         weight_shardings):
        spec = tuple(getattr(sharding, "spec", ()) or ())
        spec = spec + (None,) * (len(variable.shape) - len(spec))
        if where == PER_DEVICE:
            spec = (axis, *spec)
        elif where is not None:
            spec = tuple(axis if d == where else (None if s == axis else s)
                         for d, s in enumerate(spec))
        shardings.append(jax.sharding.NamedSharding(mesh, PartitionSpec(*spec)))
    return shardings


def accumulator_shapes(model, reducer) -> list:
    """Each accumulator's shape: its weight's, with a leading per-device axis where
    `reducer.accumulators()` says `PER_DEVICE`."""
    return [((reducer.shards,) if where == PER_DEVICE else ()) + tuple(variable.shape)
            for variable, where in zip(model.trainable_variables, reducer.accumulators())]


def zero_accumulators(model, reducer, shardings=None) -> list:
    """Fresh zero accumulators, one per trainable weight (see `accumulator_shardings`)."""
    zeros = []
    for i, (variable, shape) in enumerate(zip(model.trainable_variables,
                                              accumulator_shapes(model, reducer))):
        value = jnp.zeros(shape, variable.dtype)
        if shardings is not None:
            value = jax.device_put(value, shardings[i])
        zeros.append(value)
    return zeros


class Window:
    """The accumulators of the window in progress, and the position they were left at.

    A fit starts at position 0 (the engine resets it), so a window an interrupted
    fit left behind never leaks into the next one; a step in flight leaves the
    position at -1, so a failure leaves nothing to reuse.

    Args:
        zeros: Makes fresh zero accumulators.
    """

    def __init__(self, zeros: Callable[[], list]):
        self.zeros = zeros
        self.accumulators = None
        self.position = 0

    def take(self, position: int) -> list:
        """The accumulators for the micro-batch at `position` (zeros unless this window
        left them there), marked in flight."""
        if self.accumulators is None or position != self.position:
            self.accumulators = self.zeros()
        self.position = -1
        return self.accumulators

    def keep(self, accumulators, position: int) -> None:
        """A step returned `accumulators`; the window now stands at `position`."""
        self.accumulators, self.position = accumulators, position

    def forget(self) -> None:
        """A failed step leaves no window to continue."""
        self.accumulators, self.position = None, 0


def pulled_train_function(model, engine, k: int, steps: dict, zeros: Callable[[], list],
                          states, features) -> Callable:
    """Keras' train function over pulled micro-batches.

    Args:
        model: The model being fit.
        engine: Its engine (the window position: `pending_micro_batches`,
            `advance_window`).
        k: Micro-batches per update.
        steps: `{False: accumulating step, True: applying step}`, each `(state,
            accumulators, data[, feature values]) -> (logs, state, accumulators[,
            new feature states])`.
        zeros: Makes fresh zero accumulators.
        states: The features' `FeatureStates` the steps take and return, or None
            where no feature has state or frozen variables.
        features: The step's features.
    """
    window = Window(zeros)
    features = tuple(features)  # the build's snapshot (the engine's list changes)

    def micro_step(state, data):
        position = engine.pending_micro_batches()
        accumulators = window.take(position)
        step = steps[position == k - 1]
        if states is not None:
            logs, state, accumulators, carried = step(state, accumulators, data,
                                                      states.inputs(features))
            states.carry(carried)
        else:
            logs, state, accumulators = step(state, accumulators, data)
        window.keep(accumulators, engine.advance_window(1, k))
        return logs, state

    def forget_window():
        window.forget()

    train_function = multi_step_train_function(model, engine, micro_step,
                                               int(model.steps_per_execution),
                                               on_error=forget_window)
    train_function.jitted_step = None
    train_function.pulled_steps = steps
    train_function.zero_accumulators = zeros
    return train_function
