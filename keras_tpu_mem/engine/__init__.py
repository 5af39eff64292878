"""The training engine: one composable train step that features plug into.

`feature` is the `Feature` protocol (the registration points), `core` the
engine's lifetime (one owner of `model.train_function`), `compile` the step
compiled without a fit (for the planner). The step itself is built by the
running backend's trainer, `backends/tensorflow/trainer.py` (tf.distribute) or
`backends/jax/trainer.py` (keras.distribution); nothing here names a backend.
"""

from keras_tpu_mem import backends
from keras_tpu_mem._utils import logger
from keras_tpu_mem.backends.step import MICRO_BATCH_SPLIT, StepContext
from keras_tpu_mem.engine.core import (
    Engine,
    EngineCallback,
    FitRefused,
    observe_first_batch,
    register_error_explainer,
)
from keras_tpu_mem.engine.feature import (
    Feature,
    overrides,
    scale_for_replicas,
    unscale_for_replicas,
)


def update_variable(variable, fn, *args):
    """Updates a model variable from inside the step, consistently on every replica.

    For `after_update` hooks: `fn(variable, *args)` must assign. On TensorFlow
    it runs on every device through a merge call (see
    `backends/tensorflow/trainer.py`); on JAX it runs once, in the step's
    `keras.StatelessScope`.

    Example (inside `after_update`): clip a kernel

    ```python
    update_variable(layer.kernel, lambda v: v.assign(keras.ops.clip(v, -1.0, 1.0)))
    ```
    """
    return backends.current("update_variable").trainer.update_variable(variable, fn, *args)


__all__ = [
    "MICRO_BATCH_SPLIT",
    "Engine",
    "EngineCallback",
    "Feature",
    "FitRefused",
    "StepContext",
    "logger",
    "observe_first_batch",
    "overrides",
    "register_error_explainer",
    "scale_for_replicas",
    "unscale_for_replicas",
    "update_variable",
]
