"""Data specs and byte counts shared by the compile readers and the plan."""

from __future__ import annotations

import re

from keras_tpu_mem import backends
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import check_positive_int
from keras_tpu_mem.devices.units import tensor_bytes


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------
def _check_model(model, what: str):
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"{what}: `model` must be a keras.Model, got {type(model).__name__}.")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise ValueError(
            f"{what}: compile the model first (model.compile(optimizer=..., loss=...)): "
            "the train step it plans includes the loss, gradients and optimizer update."
        )


def _variable_bytes(variables) -> int:
    return sum(tensor_bytes(v) for v in variables)


def _unique(variables):
    seen, out = set(), []
    for v in variables:
        try:
            # A deferred variable (`ktm.shapes_only()`) has no value to share: reading
            # one makes a placeholder array (its initializer's output), new each time.
            key = id(getattr(v, "value", v)) if keras_compat.has_value(v) else id(v)
        except TypeError:
            # A JAX fit purges the variables' values (the state is its own);
            # its variables are distinct objects, so the variable is the key.
            key = id(v)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


# --------------------------------------------------------------------------
# data specs
# --------------------------------------------------------------------------
def _is_sparse_loss(loss) -> bool:
    """True for sparse categorical losses (integer class ids as labels)."""
    if loss is None:
        return False
    if isinstance(loss, str):
        return "sparse_categorical" in loss.lower()
    names = [
        getattr(loss, "__name__", ""),
        getattr(loss, "name", ""),
        getattr(getattr(loss, "fn", None), "__name__", ""),
        re.sub(r"(?<!^)(?=[A-Z])", "_", type(loss).__name__),
    ]
    return any("sparse_categorical" in str(n).lower() for n in names)


def _make_spec(shape, dtype):
    """A static spec of the backend (`backends.current().compiled.make_spec`: a
    `tf.TensorSpec` on TensorFlow, a `jax.ShapeDtypeStruct` on JAX, which has no
    TensorFlow); both expose `.shape` and `.dtype.name`."""
    import keras

    name = keras.backend.standardize_dtype(getattr(dtype, "name", dtype))
    return backends.current().compiled.make_spec(shape, name)


def _is_float_dtype(dtype) -> bool:
    import keras

    name = keras.backend.standardize_dtype(getattr(dtype, "name", dtype))
    return "float" in name


def _spec_hint() -> str:
    """How to give specs, naming only the running backend's classes (no `tf.` on JAX)."""
    name = backends.current().compiled.spec_name()
    return (f"`x_spec=`/`y_spec=` as {name} or keras.KerasTensor structures with the batch "
            "first and every other dimension set")


_SAMPLE_HINT = ("`sample_batch=` (one batch as fit takes it: x, (x, y) or (x, y, "
                "sample_weight), arrays of any batch size)")


def _spec_for(tensor, batch_size: int, name: str, fix: str | None = None):
    """A spec of `batch_size` rows shaped and typed like `tensor` past its first axis."""
    shape = list(getattr(tensor, "shape", ()))
    dtype = getattr(tensor, "dtype", None)
    if not shape or dtype is None:
        raise ValueError(
            f"Cannot build a spec for {name}: {tensor!r} has no shape/dtype (or no batch "
            f"axis). Pass {_SAMPLE_HINT} or {_spec_hint()}."
        )
    rest = shape[1:]
    if any(d is None for d in rest):
        raise ValueError(
            f"{name} has an unknown non-batch dimension (shape {tuple(shape)}); XLA needs "
            f"static shapes. Pass {fix or _SAMPLE_HINT + ' or ' + _spec_hint()}."
        )
    return _make_spec([batch_size, *[int(d) for d in rest]], dtype)


def _map_specs(structure, batch_size: int, name: str):
    import keras

    return keras.tree.map_structure(lambda t: _spec_for(t, batch_size, name), structure)


def _backend_dtype(array):
    """The dtype `fit` gives `array` on this backend (a NumPy int64 is int32 on JAX without
    x64), read by converting an empty array of it; backend tensors keep theirs."""
    import keras
    import numpy as np

    dtype = getattr(array, "dtype", None)
    if not isinstance(array, np.ndarray):
        return dtype
    converted = keras.ops.convert_to_tensor(np.zeros((0,), dtype=array.dtype))
    return keras.backend.standardize_dtype(converted.dtype)


class _Sample:
    """Shape and dtype of one array of a sample batch (what a spec is made from)."""

    def __init__(self, array):
        self.shape = tuple(getattr(array, "shape", ()))
        self.dtype = _backend_dtype(array)

    def __repr__(self):
        return f"array(shape={self.shape}, dtype={self.dtype})"


def sample_structures(sample_batch):
    """`(x, y)` of a batch as `fit` takes it (y None when it holds only inputs); a
    sample weight, if any, is dropped: the compiled step is the one without it."""
    import keras

    if sample_batch is None:
        raise ValueError("`sample_batch` must be a batch as fit takes it, not None.")
    x, y, _ = keras.utils.unpack_x_y_sample_weight(sample_batch)
    if x is None:
        raise ValueError("`sample_batch` has no inputs: pass x, (x, y) or (x, y, "
                         "sample_weight).")

    def wrap(structure):
        return None if structure is None else keras.tree.map_structure(_Sample, structure)

    return wrap(x), wrap(y)


def _label_spec(output, loss, batch_size: int):
    shape = list(output.shape)
    if any(d is None for d in shape[1:]):
        raise ValueError(
            f"The model output has an unknown non-batch dimension (shape {tuple(shape)}), "
            f"so the labels' shape is unknown. Pass the labels in {_SAMPLE_HINT[:-1]}, "
            f"with y) or {_spec_hint()}."
        )
    if _is_sparse_loss(loss):
        return _make_spec([batch_size, *[int(d) for d in shape[1:-1]]], "int32")
    dtype = output.dtype
    if _is_float_dtype(dtype):
        dtype = "float32"  # labels come from the data, not the compute policy
    return _make_spec([batch_size, *[int(d) for d in shape[1:]]], dtype)


def _symbolic_or_explain(model, which: str, what: str, why: str, argument: str):
    """`_symbolic(model, which)`, or a ValueError naming the argument that gives it."""
    try:
        return _symbolic(model, which)
    except (AttributeError, ValueError) as err:
        raise ValueError(
            f"Cannot infer {what}: the model has no symbolic {which}{why}. Pass "
            f"{_SAMPLE_HINT} or {_spec_hint()}."
        ) from err


def _symbolic(model, which: str):
    """The model's symbolic inputs or outputs, in the structure `call` uses."""
    import keras

    functional = model
    if isinstance(model, keras.Sequential):
        functional = getattr(model, "_functional", None)
    struct = getattr(functional, f"_{which}_struct", None) if functional is not None else None
    if struct is None:
        struct = getattr(model, which)  # raises AttributeError/ValueError when unknown
    if struct is None:
        raise ValueError(f"the model has no symbolic {which}")
    if isinstance(struct, (list, tuple)) and len(struct) == 1:
        struct = struct[0]
    return struct


def infer_data_specs(model, batch_size: int, x_spec=None, y_spec=None, sample_batch=None):
    """Returns `(x_spec, y_spec)` as structures of backend specs for one batch.

    Inputs come from `model.input` (functional and Sequential models built with
    `keras.Input`); labels from the loss (sparse categorical losses take int32
    class ids of the output's shape without its last axis, other losses take
    float32 labels shaped like the output). `sample_batch`, a batch as `fit`
    takes it (x, (x, y) or (x, y, sample_weight), any batch size), gives both
    instead (labels from the loss where it has none): every array's shape past
    the first axis and its dtype. Or `x_spec` / `y_spec` override either: a
    backend spec (`tf.TensorSpec` on TensorFlow, `jax.ShapeDtypeStruct` on JAX),
    `keras.KerasTensor` or a nested structure of them, whose first dimension is
    the batch. The batch dimension becomes `batch_size` in every case.

    Raises:
        ValueError: if a shape cannot be inferred (the message says what to pass), or
            `sample_batch` together with `x_spec`/`y_spec`.
    """
    check_positive_int(batch_size, "batch_size")
    if sample_batch is not None:
        if x_spec is not None or y_spec is not None:
            raise ValueError("Pass either `sample_batch` or `x_spec`/`y_spec`, not both: "
                             "the sample batch's arrays already define the specs.")
        x_sample, y_sample = sample_structures(sample_batch)
        xs = _map_specs(x_sample, batch_size, "`sample_batch`'s x")
        if y_sample is not None:
            return xs, _map_specs(y_sample, batch_size, "`sample_batch`'s y")
    elif x_spec is not None:
        xs = _map_specs(x_spec, batch_size, "`x_spec`")
    else:
        inputs = _symbolic_or_explain(
            model, "inputs", "the input shape", " (a subclassed model or a Sequential "
            "without keras.Input)", "x_spec")
        xs = _map_specs(inputs, batch_size, "The model's input")
    if y_spec is not None:
        return xs, _map_specs(y_spec, batch_size, "`y_spec`")
    outputs = _symbolic_or_explain(model, "outputs", "the label shape", "", "y_spec")
    import keras

    loss = getattr(model, "loss", None)
    flat_outputs = keras.tree.flatten(outputs)
    if len(flat_outputs) == 1:
        single_loss = loss
        if isinstance(loss, (list, tuple)) and len(loss) == 1:
            single_loss = loss[0]
        elif isinstance(loss, dict) and len(loss) == 1:
            single_loss = next(iter(loss.values()))
        return xs, _label_spec(flat_outputs[0], single_loss, batch_size)
    if isinstance(loss, dict) and isinstance(outputs, dict):
        ys = {k: _label_spec(v, loss.get(k), batch_size) for k, v in outputs.items()}
    elif isinstance(loss, (list, tuple)) and len(loss) == len(flat_outputs):
        ys = [_label_spec(o, lo, batch_size) for o, lo in zip(flat_outputs, loss)]
    elif isinstance(loss, dict):
        names = getattr(model, "output_names", None) or []
        if len(names) != len(flat_outputs):
            raise ValueError(
                "Cannot match the dict of losses to the outputs; pass `y_spec`."
            )
        ys = {n: _label_spec(o, loss.get(n), batch_size) for n, o in zip(names, flat_outputs)}
    else:
        ys = keras.tree.map_structure(lambda o: _label_spec(o, loss, batch_size), outputs)
    return xs, ys


def _spec_bytes(structure) -> int:
    import keras

    return sum(tensor_bytes(s) for s in keras.tree.flatten(structure))


