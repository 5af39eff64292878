"""Keras' JAX train function around the engine's jitted step.

`fit` calls `logs, state = model.train_function(state, iterator)`; this runs the
call's steps (`steps_per_execution`), and on an error of the step puts the call's
input state back into the variables before the engine explains the error.
"""

from __future__ import annotations

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem._utils import logger


def restore_variables(model, state) -> bool:
    """Writes a train-function state `(trainable, non_trainable, optimizer, metrics)`
    back into the model's variables; False (and a warning) where the step's donation
    already freed it (an error while the step ran on the device)."""
    groups = (model.trainable_variables, model.non_trainable_variables,
              model.optimizer.variables, model.metrics_variables)
    try:
        pairs = [(v, value) for variables, values in zip(groups, state)
                 for v, value in zip(variables, values)]
        if any(getattr(value, "is_deleted", lambda: False)() for _, value in pairs):
            logger.warning("The failed step had already consumed the training state on the "
                           "device (its buffers are donated), and Keras' fit keeps no other "
                           "copy: the model's variables hold no values now. Load the last "
                           "checkpoint (BackupAndRestore resumes from it) before using it.")
            return False
        for variable, value in pairs:
            variable.assign(value)
    except Exception as err:  # the step's own error is the one to raise
        logger.debug("could not restore the variables after a failed step: %s", err)
        return False
    return True


def multi_step_train_function(model, engine, step, default_count, on_error=None):
    """Keras' JAX train function `(state, iterator) -> (logs, state)` around `step`.

    Runs `engine.steps_for_this_call()` steps (`default_count` when that is
    unknown), stopping early where the data ends inside the call. A callback's
    `model` property syncs Keras' training state into the variables
    (`jax_state_sync`); if a feature reads it while the step is traced (every
    call with run_eagerly, or a retrace for a new shape), Keras would take the
    variables as current and reload the state from them next step, dropping
    this call's updates: the flag is put back as it was. On an error of the
    step, `on_error()` runs, the variables get back this call's input state
    (Keras' fit took the values out of them for its loop and puts them back
    only after a clean epoch), and the engine explains the error and ends the
    fit (`Engine.explain`).
    """

    def train_function(state, iterator):
        count = engine.steps_for_this_call() or default_count
        synced = jax_compat.state_synced(model)
        given = state
        try:
            data = next(iterator)
            # Keras >= 3.16 hands one call's steps over at once (a super batch). It
            # stacks steps_per_execution batches even for an epoch's last call; that
            # call runs only the steps left in the epoch (9 steps, N=4: 4, 4, 1).
            steps = jax_compat.super_batch_steps(model, data)
            if steps is not None:
                for data in steps[:count]:
                    logs, state = step(state, data)
                return logs, state
            logs, state = step(state, data)
            for _ in range(count - 1):
                try:
                    data = next(iterator)
                except StopIteration:  # the data ended inside this call
                    break
                logs, state = step(state, data)
        except StopIteration:
            raise
        except Exception as error:
            if on_error is not None:
                on_error()
            restore_variables(model, given)
            clearer = engine.explain(error)
            if clearer is not None:
                raise clearer from error
            raise
        finally:
            # Only when changed: Keras tracks every attribute a model is given.
            if jax_compat.state_synced(model) != synced:
                jax_compat.set_state_synced(model, synced)
        return logs, state

    return train_function
