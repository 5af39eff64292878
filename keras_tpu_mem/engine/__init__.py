"""The training engine: one composable train step per backend that features plug into.

`core` is backend-neutral (the `Feature` protocol, registration, lifetime);
`tensorflow` builds the step under tf.distribute, `jax` under
keras.distribution. See `core`'s docstring for the registration points.
"""

from keras_tpu_mem._utils import logger
from keras_tpu_mem.engine.core import (
    Engine,
    EngineCallback,
    Feature,
    StepContext,
    observe_first_batch,
    overrides,
    scale_for_replicas,
    unscale_for_replicas,
)

#: The name of the reshape that splits a batch into micro-batches on TensorFlow
#: (features recognise it in XLA's errors); here so that importing it needs no TensorFlow.
MICRO_BATCH_SPLIT = "ktm_micro_batch_split"


def update_variable(variable, fn, *args):
    """TensorFlow engine's cross-replica variable update; see `engine.tensorflow`."""
    from keras_tpu_mem.engine.tensorflow import update_variable as update

    return update(variable, fn, *args)


__all__ = [
    "MICRO_BATCH_SPLIT",
    "Engine",
    "EngineCallback",
    "Feature",
    "StepContext",
    "logger",
    "observe_first_batch",
    "overrides",
    "scale_for_replicas",
    "unscale_for_replicas",
    "update_variable",
]
