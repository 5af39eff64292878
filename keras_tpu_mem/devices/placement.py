"""Where a model's variables live, and running a function on every replica.

Written once for both backends; each function asks the running backend's
`strategy` concern (`backends/<name>/strategy.py`). On TensorFlow a model's
variables are made under a `tf.distribute.Strategy`; on JAX the active
`keras.distribution` lays them out, so there is no strategy (None).
"""

from __future__ import annotations

from keras_tpu_mem import backends


def _strategy_concern(what: str):
    return backends.current(what).strategy


def training_strategy(model, what: str = "keras_tpu_mem"):
    """The strategy `model` trains under (None on JAX, and where Keras runs a backend
    without this package's adapter: no strategy there either)."""
    if backends.running() is None:
        return None
    return _strategy_concern(what).training_strategy(model)


def variable_owner(variable, what: str = "keras_tpu_mem"):
    """The strategy a Keras variable is distributed by, None for a plain variable."""
    return _strategy_concern(what).variable_owner(variable)


def active_strategy(what: str = "keras_tpu_mem"):
    """The strategy whose scope is entered, None outside any."""
    return _strategy_concern(what).active_strategy()


def replica_runner(fn, strategy, what: str = "keras_tpu_mem"):
    """`call(x) -> dict of numpy arrays`: `fn` (a batch -> dict of per-example
    tensors) compiled on every replica of `strategy`, each on its slice of the
    batch, results in batch order."""
    return _strategy_concern(what).replica_runner(fn, strategy)


__all__ = ["active_strategy", "replica_runner", "training_strategy", "variable_owner"]
