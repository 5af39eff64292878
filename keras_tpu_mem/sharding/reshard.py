"""`reshard`: move an existing model's state to another distribution's layouts, in place."""

from __future__ import annotations

import keras

from keras_tpu_mem.engine.core import engage
from keras_tpu_mem.sharding.distribution import (
    ShardedDataParallel,
    sharding_concern,
    watch_optimizer,
)
from keras_tpu_mem.sharding.layouts import target_layouts


def reshard(model, distribution):
    """Moves a model's variables and its optimizer's state to `distribution`'s layouts.

    In place: the values are kept, nothing is rebuilt. Every variable of the
    model (weights, seeds, metric state) and of its optimizer (`iteration`,
    the slots such as Adam's momentum and velocity) gets the layout
    `distribution` gives it, keeps it for later assignments, and its value is
    moved there. Under a `ShardedDataParallel` the slots are laid out as
    optimizer state (split also with `shard="optimizer"`); under any other
    distribution they follow their weight, as Keras lays them out. The
    model's compiled train / test / predict functions are dropped, so a `fit`
    in `distribution.scope()` compiles for the new layouts and trains on as if
    the model had been built there; its `fit` is handed to the engine, whose
    step for state split over the data axis all-gathers each weight where it
    is used and reduce-scatters its gradient (docs/engine.md). An optimizer
    that is not built yet lays its slots out when `fit` builds it in the scope.

    Args:
        model: A `keras.Model` (built or not, compiled or not).
        distribution: A `keras.distribution` distribution, e.g. a
            `ShardedDataParallel` or Keras' `DataParallel`.

    Returns:
        The model.

    Raises:
        RuntimeError: on a backend other than JAX.
        TypeError: `model` or `distribution` of the wrong type.

    Example:

    ```python
    import keras
    import numpy as np
    from keras_tpu_mem.sharding import ShardedDataParallel, reshard

    x, y = np.ones((256, 64), "float32"), np.ones((256, 64), "float32")
    with keras.distribution.DataParallel().scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64)])
        model.compile(optimizer="adam", loss="mse")
    sharded = ShardedDataParallel()
    reshard(model, sharded)
    with sharded.scope():
        model.fit(x, y, batch_size=64)
    ```
    """
    concern = sharding_concern("reshard")
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model, got {type(model).__name__}.")
    # Keras exports no base class of its distributions: what reshard uses.
    if not all(hasattr(distribution, name)
               for name in ("get_variable_layout", "scope", "device_mesh")):
        raise TypeError("`distribution` must be a keras.distribution.Distribution (e.g. "
                        "ShardedDataParallel or DataParallel), got "
                        f"{type(distribution).__name__}.")
    optimizer = getattr(model, "optimizer", None)
    sharded = isinstance(distribution, ShardedDataParallel)
    with distribution.scope():
        variables, slots, layouts = target_layouts(model, distribution)
        for variable in [*variables, *slots]:
            concern.move(variable, layouts[id(variable)])
    if optimizer is not None and sharded:
        watch_optimizer(optimizer)
    if sharded:
        distribution.log_replicated()
    model.train_function = model.test_function = model.predict_function = None
    engage(model)  # its next fit asks whether the state needs the engine's sharded step
    return model


__all__ = ["reshard"]
