"""Models your machine can't hold: built with shapes only, given their values later.

Keras defers a variable created in a `keras.StatelessScope(initialize_variables=
False)`: it keeps the shape, dtype, layout and initializer, and no value
(`KerasVariable.__init__`). `shapes_only()` builds whole models that way, so a
planner can trace and compile the training step of a 7B model on a machine that
could not hold its weights, and `materialize(model)` gives the model its values
afterwards, each straight into its layout under a `keras.distribution`.

Four things stand between Keras' stateless scope and a whole model, and are
solved here:

* Keras makes a few variables from constants (the optimizer's `iterations` from
  0, its `learning_rate` from a float), which a stateless scope refuses ("You
  are attempting to create a variable while in a stateless scope"). Inside
  `deferring()` such a constant becomes an equivalent callable initializer.
* Reading a deferred variable's `.value` calls its initializer: a placeholder
  inside a trace, but a 34 GB array of zeros for a 7B model read eagerly (a
  `fit`, a `predict`). Each deferred variable's initializer is therefore guarded:
  outside `deferring()` and `reading_shapes()` a read raises a `ValueError`
  naming `ktm.materialize(model)`, before anything is allocated; so does a write
  (`assign`, `set_weights`, a metric's reset), which Keras' TensorFlow variable
  cannot take without a value and Keras' JAX variable would take silently.
  `fit`, `evaluate` and `predict` of a model with such variables are refused
  before any layer runs, naming the model (any `keras.Model`, keras-hub's tasks
  too: their own `fit` calls Keras').
* Keras initialises every deferred variable when the next outermost
  `StatelessScope` exits (its list of uninitialised variables; the JAX trainer
  opens such scopes): variables made here are taken off that list, so they stay
  deferred until `materialize`.
* Optimizer state follows the weights: an optimizer built on deferred weights
  (`optimizer.build(model.trainable_variables)`, also from `fit`) makes its slots
  deferred, inside `shapes_only()` or after it. Keras' TensorFlow optimizer reads
  each weight's value to colocate and index its slots: for deferred weights the
  slots are made without colocation, indexed by a placeholder key, and indexed
  again by `materialize`.

Known limits: `layer.quantize("int8")` in `shapes_only()` gives the quantized
variables' shapes and dtypes, but reads each float kernel once (Keras quantizes
eagerly) and, as writes to deferred variables are not kept, `materialize` gives
the int8 kernels and scales their initializers' values (load real weights after
it). Under `ShardedDataParallel`, an optimizer built in its scope on deferred
weights is laid out by reading each slot's placeholder (one slot at a time: the
distribution re-assigns each slot to its layout).
"""

from __future__ import annotations

import contextlib
import weakref

import keras
import numpy as np

from keras_tpu_mem import backends
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import unique

_WHAT = "ktm.materialize"


class _Depths:
    """How many `deferring()` and `reading_shapes()` contexts are open (process-wide:
    a planner may trace in another thread than the one that opened them)."""

    deferring = 0
    reading = 0


_DEPTHS = _Depths()
# Optimizers whose `build` makes deferred slots for deferred weights.
_WATCHED = weakref.WeakSet()


# ---------------------------------------------------------------- initializers
class _Constant:
    """The initializer of a variable Keras makes from a constant (`iterations` from 0,
    `learning_rate` from a float): it makes the tensor Keras would have made of the
    constant, so the materialised variable equals a normally built one."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        return keras.ops.convert_to_tensor(self.value, dtype=dtype)


def _from_constant(value, dtype):
    """`(initializer, shape, dtype)` for a variable made from the constant `value`; the
    dtype is the one Keras infers when none is given."""
    if isinstance(value, (np.ndarray, np.generic)):
        shape = tuple(int(d) for d in np.shape(value))
        if dtype is None:
            # Keras converts the whole array (JAX without x64 narrows float64); one
            # element gives the same dtype without a copy of the array.
            dtype = keras.ops.convert_to_tensor(np.reshape(value, -1)[:1]).dtype
    elif hasattr(value, "shape") and hasattr(value, "dtype"):  # a backend tensor
        shape = tuple(int(d) for d in value.shape)
        dtype = value.dtype if dtype is None else dtype
    else:  # a Python number or nested list: small, converted as Keras converts it
        tensor = keras.ops.convert_to_tensor(value, dtype=dtype)
        shape = tuple(int(d) for d in tensor.shape)
        dtype = tensor.dtype if dtype is None else dtype
    return _Constant(value), shape, keras.backend.standardize_dtype(dtype)


class _Deferred:
    """The initializer of a variable created in `deferring()`.

    Keras calls a deferred variable's initializer whenever its `.value` is read.
    Where shapes are read (inside `deferring()` or `reading_shapes()`) this gives
    Keras' own placeholder; anywhere else it raises, so that a `fit` of a
    shapes-only model fails at its first read instead of allocating the model.
    """

    def __init__(self, initializer, path: str, shape: tuple, dtype: str):
        self.initializer = initializer
        self.path, self.shape, self.dtype = path, shape, dtype

    def __call__(self, shape, dtype=None, **kwargs):
        if not (_DEPTHS.deferring or _DEPTHS.reading):
            raise self.refusal("read")
        return self.initializer(shape, dtype=dtype, **kwargs)

    def refusal(self, action: str) -> ValueError:
        return ValueError(
            f"Variable '{self.path}' (shape {self.shape}, {self.dtype}) has no value to "
            f"{action}: it was built in ktm.shapes_only() (or ktm.deferring()), which "
            "records shapes only. Call ktm.materialize(model) to give the model its values "
            "before fit, evaluate, predict, get_weights, set_weights or saving; code that "
            "only traces shapes reads them inside ktm.reading_shapes().")


def _own_initializer(variable):
    initializer = keras_compat.variable_initializer(variable)
    return initializer.initializer if isinstance(initializer, _Deferred) else initializer


def _is_deferred(variable) -> bool:
    return isinstance(variable, keras.Variable) and not keras_compat.has_value(variable)


# ----------------------------------------------------------------- interceptors
def _create_variable(init, variable, initializer, shape, dtype, *args, **kwargs):
    """Keras' variable construction, deferred and guarded inside `deferring()`."""
    if not _DEPTHS.deferring:
        return init(variable, initializer, shape, dtype, *args, **kwargs)
    if not callable(initializer) and not isinstance(initializer, str):
        initializer, shape, dtype = _from_constant(initializer, dtype)
    init(variable, initializer, shape, dtype, *args, **kwargs)
    if keras_compat.has_value(variable):
        return  # made outside any stateless scope: nothing deferred
    # Keras asks the distribution for a layout only when it makes a value; asking
    # now, in the name scope the variable is created in, gives the layout a normal
    # build gives (ShardedDataParallel tells optimizer slots by that name scope).
    keras_compat.initialize_variable_layout(variable)
    keras_compat.set_variable_initializer(variable, _Deferred(
        keras_compat.variable_initializer(variable), variable.path, tuple(variable.shape),
        variable.dtype))
    optimizer = _creating_optimizer()
    if optimizer is not None:
        _watch(optimizer)


def _create_slot(own, base, optimizer, reference, name, initializer):
    """An optimizer slot: deferred when its weight is (Keras' TensorFlow optimizer reads
    the weight's value to colocate the slot with it: the neutral method skips that)."""
    if _is_deferred(reference):
        with deferring():
            return base(optimizer, reference, name=name, initializer=initializer)
    return own(optimizer, reference, name=name, initializer=initializer)


def _variable_key(own, optimizer, variable):
    """The key an optimizer indexes a weight by (TensorFlow's reads the weight's
    `tf.Variable`): a placeholder for a deferred weight, replaced by the real key when
    `materialize` makes the weight (`keras_compat.rekey_optimizer`)."""
    if _is_deferred(variable):
        return f"ktm_deferred_{id(variable)}"
    return own(optimizer, variable)


def _write(own, variable, value):
    """A write of a value outside a stateless scope: refused for a deferred variable
    (Keras' TensorFlow variable has no `tf.Variable` to write to yet, and JAX's
    would take the value without its initializer ever running)."""
    initializer = keras_compat.variable_initializer(variable)
    if isinstance(initializer, _Deferred) and not keras_compat.has_value(variable):
        raise initializer.refusal("write")
    return own(variable, value)


def _run(own, model, method, *args, **kwargs):
    """`fit`, `evaluate` or `predict` of any Keras model: refused, naming the model,
    while any of its variables is deferred (before a layer runs; a read inside a
    layer call would be refused too, but named after one variable and wrapped in
    Keras' "Exception encountered when calling ..."). Where shapes are read
    (`deferring()`, `reading_shapes()`) it runs as Keras runs it."""
    if not (_DEPTHS.deferring or _DEPTHS.reading):
        deferred = [v for v in _state_variables(model) if _guarded(v)]
        if deferred:
            raise ValueError(
                f"{type(model).__name__} '{model.name}' was built in ktm.shapes_only() (or "
                f"ktm.deferring()) and has no values to {method} with: {len(deferred)} of its "
                f"variables are shapes only (e.g. '{deferred[0].path}'). Call "
                "ktm.materialize(model) to give it its values before fit, evaluate or "
                "predict (then load real weights into it, if you have them).")
    return own(model, *args, **kwargs)


def _guarded(variable) -> bool:
    """Whether `variable` was deferred here (`deferring()`) and has no value yet."""
    return (isinstance(keras_compat.variable_initializer(variable), _Deferred)
            and not keras_compat.has_value(variable))


def _creating_optimizer():
    for caller in reversed(keras_compat.name_scope_callers()):
        if isinstance(caller, keras.optimizers.Optimizer):
            return caller
    return None


def _watch(optimizer) -> None:
    """Makes `optimizer.build` run inside `deferring()` when it is given deferred
    weights (once per optimizer): its slots, and whatever a distribution's wrapper
    of `build` does with them, stay shapes only."""
    if optimizer in _WATCHED:
        return
    build = optimizer.build

    def build_deferred_for_deferred_weights(variables, *args, **kwargs):
        variables = list(variables)
        if _DEPTHS.deferring or not any(_is_deferred(v) for v in variables):
            return build(variables, *args, **kwargs)
        with deferring():
            return build(variables, *args, **kwargs)

    optimizer.build = build_deferred_for_deferred_weights
    _WATCHED.add(optimizer)


def _install() -> None:
    keras_compat.intercept_variable_init(_create_variable)
    keras_compat.intercept_slot_creation(_create_slot)
    keras_compat.intercept_variable_key(_variable_key)
    keras_compat.intercept_direct_assign(_write)
    keras_compat.intercept_model_runs(_run)


def _keep_deferred(also=()) -> None:
    """Takes the variables made in `deferring()` (and `also`) off Keras' list of
    variables to initialise when the next outermost `StatelessScope` exits."""
    drop = {id(v) for v in also}
    keras_compat.set_uninitialized_variables(
        v for v in keras_compat.uninitialized_variables()
        if id(v) not in drop and not isinstance(keras_compat.variable_initializer(v), _Deferred))


# --------------------------------------------------------------------- contexts
class _DeferringScope(keras.StatelessScope):
    """Keras' stateless scope that keeps no write to a variable made in `deferring()`.

    Inside a stateless scope Keras records `variable.assign(value)` in the scope
    (until it exits) instead of writing it. A deferred variable has no value to
    keep, and such writes are whole arrays: `ShardedDataParallel` lays out an
    optimizer built in its scope by re-assigning each slot, and `quantize` assigns
    every quantized kernel. Not keeping them frees each at once, so building a
    shapes-only model's optimizer holds at most one slot, never all of them.
    """

    def add_update(self, update):
        variable, _ = update
        if isinstance(keras_compat.variable_initializer(variable), _Deferred):
            return
        super().add_update(update)


@contextlib.contextmanager
def deferring():
    """Context in which every Keras variable created is deferred: shape, no value.

    A `keras.StatelessScope(initialize_variables=False)` (the active stateless
    scope, if one is open), plus: variables Keras makes from constants get an
    equivalent callable initializer, and each variable created gets the guard
    that makes a read or write of its value outside `deferring()` /
    `reading_shapes()` raise a `ValueError` naming `ktm.materialize(model)`.
    Inside, a deferred variable's value reads as Keras' placeholder (its
    initializer's output: symbolic inside a trace, a real array if read
    eagerly), and writes to it are not kept. Variables created here stay
    deferred after the context, until `materialize`; optimizers created here
    build deferred slots whenever they are built on deferred weights.

    `shapes_only()` is this context, for building models; a planner uses this
    one to build the missing optimizer or feature state of a shapes-only model.

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm

    with ktm.shapes_only():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss="mse")
    with ktm.deferring():
        model.optimizer.build(model.trainable_variables)
    assert ktm.is_shapes_only(model)
    ```
    """
    _install()
    scope = (contextlib.nullcontext() if keras_compat.in_stateless_scope()
             else _DeferringScope(initialize_variables=False))
    _DEPTHS.deferring += 1
    try:
        with scope:
            yield
    finally:
        _DEPTHS.deferring -= 1
        _keep_deferred()


@contextlib.contextmanager
def shapes_only():
    """Context in which models are built with shapes and no values.

    Build, compile, `enable_lora`, `optimizer.build(...)` as usual inside it:
    every variable (weights, optimizer state, metric state, seed generators) gets
    its shape, dtype, layout under an active `keras.distribution`, and an
    initializer, but no value, so a model far larger than the host's memory
    builds in seconds and a few MB. The model can then be summarised, traced
    and compiled (inside `reading_shapes()`), and trained after
    `materialize(model)`. Reading a value outside these contexts (`fit`,
    `evaluate`, `predict`, `get_weights`, `save`) raises a `ValueError` naming
    `ktm.materialize(model)`, before anything is allocated.

    An optimizer built later on the model's deferred weights (by
    `optimizer.build` or by `fit`) makes deferred slots too.

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm

    with ktm.shapes_only():
        model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    assert ktm.is_shapes_only(model)
    model.count_params()             # shapes only: 1059850
    ktm.materialize(model)           # now it has values, and trains
    ```
    """
    with deferring():
        yield


@contextlib.contextmanager
def reading_shapes():
    """Context in which deferred variables read as Keras' placeholders.

    For code that only needs shapes: symbolic builds, `jax.jit(...).lower`, XLA
    compiles. Inside it a deferred variable's `.value` is its initializer's
    output, as in Keras' own stateless scope: symbolic inside a trace, but a real
    array if read eagerly, so read eagerly only what is small. Variables created
    here are not deferred (open `deferring()` for that).

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm

    with ktm.shapes_only():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    with ktm.reading_shapes():
        spec = model.compute_output_spec(keras.KerasTensor((2, 8)))
    spec.shape                       # (2, 4)
    ```
    """
    _DEPTHS.reading += 1
    try:
        yield
    finally:
        _DEPTHS.reading -= 1


# ----------------------------------------------------------------------- models
def _check_model(model, what: str) -> None:
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"{what}: `model` must be a keras.Model (or another keras.layers.Layer), "
                        f"got {type(model).__name__}.")


def _state_variables(model) -> list:
    """The model's weights and seed states, its optimizer's variables and its metrics'."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    variables += list(getattr(model, "metrics_variables", None) or ())
    # Metric objects given to compile made their variables already (in shapes_only(),
    # deferred), before any fit builds the compiled metrics that list them.
    variables += keras_compat.compile_metric_variables(model)
    return unique(variables)


def is_shapes_only(model) -> bool:
    """Whether any variable of `model` has no value yet.

    Looks at `model.variables`, its optimizer's variables and its metrics'.

    Args:
        model: A `keras.Model` (or `keras.layers.Layer`).

    Returns:
        True when at least one of them is deferred (built in `shapes_only()` and
        not materialised).

    Raises:
        TypeError: `model` is not a Keras model or layer.

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm

    with ktm.shapes_only():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    ktm.is_shapes_only(model)                 # True
    ktm.is_shapes_only(ktm.materialize(model))  # False
    ```
    """
    _check_model(model, "ktm.is_shapes_only")
    return any(_is_deferred(v) for v in _state_variables(model))


def materialize(model):
    """Gives every deferred variable of `model` its value, in place.

    The model's weights and seed states, its optimizer's variables and its
    metrics' are made from their initializers. Under an active
    `keras.distribution` (JAX) each value is made directly in its variable's
    layout: one jitted call of the initializer whose output is laid out as the
    variable (`out_shardings`), so no device or host ever holds a whole copy of
    a sharded variable (Keras' own deferred initialisation does that only above
    250 MB). On TensorFlow the values are made in the `tf.distribute` strategy
    the model was created under.

    The values are those a normal build gives with the same seed: Keras'
    random initializers draw their integer seed from Keras' seed when they are
    constructed (the same in both builds) and make their values from that seed
    alone, whenever and wherever they run.

    Args:
        model: A `keras.Model` (or `keras.layers.Layer`), typically built in
            `shapes_only()`.

    Returns:
        `model` (unchanged if it has no deferred variable).

    Raises:
        TypeError: `model` is not a Keras model or layer.
        ValueError: Called inside `shapes_only()`, `deferring()` or another
            `keras.StatelessScope`, where Keras makes no values.

    Example:

    ```python
    import keras
    import numpy as np
    import keras_tpu_mem as ktm

    with ktm.shapes_only():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss="mse")
    ktm.materialize(model)
    model.fit(np.zeros((16, 8)), np.zeros((16, 4)), verbose=0)
    ```
    """
    _check_model(model, "ktm.materialize")
    pending = [v for v in _state_variables(model) if _is_deferred(v)]
    if not pending:
        return model
    if keras_compat.in_stateless_scope():
        raise ValueError(
            "ktm.materialize(model) makes values, which Keras refuses inside a stateless "
            "scope: call it after the `with ktm.shapes_only():` block, not inside "
            "shapes_only(), deferring() or a keras.StatelessScope.")
    concern = backends.current(_WHAT).materialize
    with concern.scope(model):
        for variable in pending:
            concern.initialize(variable, _own_initializer(variable))
    optimizer = getattr(model, "optimizer", None)
    for built in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if built is not None:
            keras_compat.rekey_optimizer(built)
    # Variables a user's own StatelessScope deferred are on Keras' list too: once
    # made, Keras would refuse to initialise them again ("already initialized").
    _keep_deferred(also=pending)
    return model


__all__ = ["deferring", "is_shapes_only", "materialize", "reading_shapes", "shapes_only"]
