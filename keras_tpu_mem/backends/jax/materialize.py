"""Giving a shapes-only model its values on JAX: each straight into its layout.

`keras_tpu_mem.shapes.materialize` calls `initialize(variable, initializer)` for
every variable that has no value. Keras' own deferred initialisation lays a
value out after making it whole on one device, unless the variable is over
250 MB (`JaxVariable._initialize_with_initializer`, `should_shard_at_init`):
here every variable with a layout is made by one jitted call of its
initializer whose output is laid out as the variable (`out_shardings`), so
each device computes and holds only its own shards and no device or host
ever holds a whole copy of a sharded variable. Keras' random initializers
draw from a counter-based generator keyed by their integer seed, so the
values do not depend on the layout: the same as a normal build.

Contract: `keras_tpu_mem.backends.contracts.Materialize`.
"""

from __future__ import annotations

import contextlib
import inspect

import jax
import keras

from keras_tpu_mem._compat import keras as keras_compat


def scope(model):
    """The context `materialize` runs in: none on JAX (the layouts come from the
    variables and the active `keras.distribution`)."""
    return contextlib.nullcontext()


# Jitted makers of values that depend only on the initializer's config (zeros, ones,
# constants: most of an optimizer's slots), by (class, config, shape, dtype, sharding):
# a 7B model's few hundred slots then compile a handful of programs, not one each.
_MAKERS: dict = {}
_MAX_MAKERS = 256


def place(initializer, shape: tuple, dtype: str, sharding):
    """`initializer(shape, dtype=dtype)` made by one jitted call whose output is laid
    out as `sharding` (a `jax.sharding.Sharding`): each device computes and keeps only
    its own shards."""
    key = _config_key(initializer, shape, dtype, sharding)
    make = _MAKERS.get(key) if key is not None else None
    if make is None:
        make = jax.jit(lambda: initializer(shape, dtype=dtype), out_shardings=sharding)
        if key is not None:
            if len(_MAKERS) >= _MAX_MAKERS:
                _MAKERS.clear()
            _MAKERS[key] = make
    return make()


def _config_key(initializer, shape, dtype, sharding):
    """The maker's cache key for a Keras initializer without a seed, else None (a
    seeded initializer's seed is a constant of its program: one program each)."""
    if not isinstance(initializer, keras.initializers.Initializer) or hasattr(
            initializer, "seed"):
        return None
    try:
        config = repr(sorted(initializer.get_config().items()))
        return (type(initializer), config, tuple(shape), str(dtype), sharding)
    except (NotImplementedError, TypeError):
        return None


def initialize(variable, initializer) -> None:
    """Gives `variable` (without a value) the value `initializer` makes, in its layout.

    The layout is the variable's own, else the active distribution's
    (`get_variable_layout`, as Keras asks it when it initialises a variable).
    Without a layout, or with an initializer that takes `layout=` itself (Keras
    then lays its output out as it makes it), Keras' own initialisation runs.
    """
    keras_compat.set_variable_initializer(variable, initializer)
    keras_compat.initialize_variable_layout(variable)
    layout = keras_compat.variable_layout(variable)
    if layout is None or _takes_layout(initializer):
        keras_compat.initialize_deferred(variable)
        return
    sharding = getattr(layout, "backend_layout", layout)
    value = place(initializer, tuple(variable.shape), variable.dtype, sharding)
    keras_compat.set_initialized_value(variable, value)


def _takes_layout(initializer) -> bool:
    try:
        return "layout" in inspect.signature(initializer).parameters
    except (TypeError, ValueError):
        return False


__all__ = ["initialize", "place", "scope"]
