"""XLA:TPU's plan of a TensorFlow user's model, through the model's JAX lowering.

XLA:TPU compiles for a TPU slice this machine does not have only through JAX and libtpu
(`planning.target`), and one process runs one Keras backend. On TensorFlow,
`plan(model, batch, device="v5e-8", compiler="tpu")` therefore plans **the same Keras
model on Keras' JAX backend**: `plan_with_jax` writes the model's config (no weights),
its compile config, the feature callbacks' configs and the data specs to a temporary
folder, and a JAX subprocess (`jax_lowering_worker`) rebuilds the model there with
shapes only (`ktm.shapes_only()`: nothing is allocated), compiles it as it was compiled,
runs `ktm.plan(..., compiler="tpu")` and writes the `MemoryPlan` back as JSON, which is
rebuilt here. The step planned is Keras' JAX train step (the engine's JAX step where
feature callbacks are given), not TensorFlow's own step: the same model, loss and
optimizer, lowered by JAX instead of by the TensorFlow bridge.

The subprocess finds the model's own classes as `keras.saving.deserialize_keras_object`
finds them anywhere: registered with `@keras.saving.register_keras_serializable()` in a
module it imports, or at the top level of an importable module. The modules of the
classes the configs name (and of the model's layers and feature callbacks) are imported
there first, with this process's `sys.path`; a class defined in a function or in
`__main__` (a script, a notebook) cannot be found there and is refused here, by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import check_positive_int

#: The install that brings JAX and XLA:TPU's compiler (libtpu) to a TensorFlow setup.
JAX_PLAN_INSTALL = 'pip install "keras-tpu-mem[jax,tpu-plan]"'
#: The worker module the subprocess runs.
WORKER = "keras_tpu_mem.planning.jax_lowering_worker"
#: The file names inside the temporary folder.
IN_NAME, OUT_NAME = "in.json", "out.json"
#: How `MemoryPlan.compiler` reads: `"XLA:TPU via the JAX lowering (TPU v5 lite, ...)"`.
COMPILER_PREFIX = "XLA:TPU via the JAX lowering"
#: Lines of the worker's errors a RuntimeError carries.
_TAIL_LINES = 25


def plan_with_jax(model, global_batch_size: int, *, device="v5e-8", accumulation_steps=None,
                  precision=None, headroom: float = 0.1, x_spec=None, y_spec=None,
                  callbacks=None, search: bool = False, max_compile_batch: int = 8192,
                  sample_batch=None, by_layer: bool = True, mesh=None,
                  timeout: float = 1800):
    """XLA:TPU's `MemoryPlan` of a Keras model on a TPU slice, from any Keras backend.

    What `ktm.plan(model, ..., compiler="tpu")` runs on TensorFlow: the model is
    rebuilt from its config on Keras' JAX backend in a subprocess, with shapes only
    (its weights are not read or copied), compiled with its compile config, and
    planned there with `ktm.plan(..., compiler="tpu")`: XLA:TPU compiles the model's
    JAX train step (the engine's JAX step for the feature callbacks given) for the
    slice ahead of time, through libtpu, with no TPU attached. A model built under a
    `tf.distribute` strategy is fine: only its config is used.

    The arguments are `ktm.plan`'s (see there); `timeout` is this call's own.

    Args:
        model: A compiled `keras.Model`.
        global_batch_size: Examples per step over all replicas.
        device: The TPU slice, e.g. `"v5e-8"`, `"v4-32"`, `"v6e-64"`.
        accumulation_steps, precision: The levers of a plan without `callbacks`.
        headroom: Fraction of capacity kept free.
        x_spec, y_spec: Data specs (`tf.TensorSpec`, `keras.KerasTensor` or any
            object with `.shape` and `.dtype`, in the structure `fit` takes); only
            their shapes and dtypes are sent.
        callbacks: The callbacks you pass to `fit`. Its keras-tpu-mem feature
            callbacks are rebuilt in the subprocess from their class and
            `get_config()` (a `Distillation` teacher from its config, with shapes
            only); other callbacks do not change the step and are left out.
        search: Also search the levers (`ktm.plan(..., search=True)`).
        max_compile_batch: The largest per-replica batch compiled directly.
        sample_batch: One batch as `fit` takes it; only its arrays' shapes and
            dtypes are sent (the subprocess makes a batch of zeros like it).
        by_layer: Also compile the reported configuration for its memory by layer.
        mesh: Axis sizes of the slice's mesh, e.g. `{"batch": 4, "model": 2}`.
        timeout: Seconds the JAX subprocess may take (default 1800: a large
            model's search compiles many candidates).

    Returns:
        A `MemoryPlan` whose `compiler` reads `"XLA:TPU via the JAX lowering (TPU v5
        lite, v5e:2x4, 8 devices, libtpu ...)"` and whose first note says that the
        step planned is the model's JAX lowering. Its recommendation's
        `callbacks()` are the feature callbacks for your TensorFlow `fit`; its
        `distribution()` is None (a JAX distribution; on TensorFlow the slice is a
        `TPUStrategy`).

    Raises:
        ValueError: JAX is not installed (the message names `pip install
            "keras-tpu-mem[jax,tpu-plan]"`); the model is not compiled, or names a
            class the subprocess cannot find (defined in a function or in
            `__main__`, or not registered); a feature callback cannot be sent; a bad
            argument (also those `ktm.plan` refuses in the subprocess).
        TypeError: An argument of the wrong type.
        RuntimeError: The subprocess failed or timed out (with its last error lines).

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm        # KERAS_BACKEND=tensorflow

    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024),
                              keras.layers.Dense(16)])
    model.compile(optimizer="adam", loss="mse")
    p = ktm.plan(model, 256, device="v5e-8", compiler="tpu")   # calls plan_with_jax
    print(p.compiler)     # XLA:TPU via the JAX lowering (TPU v5 lite, v5e:2x4, ...)
    print(p)
    ```
    """
    check_jax()
    _check_model(model)
    args = _check_args(global_batch_size, device, accumulation_steps, precision, headroom,
                       search, max_compile_batch, by_layer, mesh)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"`timeout` must be a positive number of seconds, got {timeout!r}.")
    classes = set()
    model_config, compile_config = _model_configs(model, classes)
    payload = {
        "model": model_config,
        "compile": compile_config,
        "callbacks": _feature_payloads(callbacks, classes),
        "x_spec": _encode_structure(x_spec, "x_spec", arrays=False),
        "y_spec": _encode_structure(y_spec, "y_spec", arrays=False),
        "sample_batch": _encode_structure(sample_batch, "sample_batch", arrays=True),
        "args": args,
    }
    payload["modules"] = _modules_to_import(
        [model_config, compile_config, payload["callbacks"]], classes)
    result = _run_worker(payload, float(timeout))
    return plan_from_json(result, features=bool(payload["callbacks"]))


# ------------------------------------------------------------------------------- checks
def check_jax() -> None:
    """Raises a ValueError naming the install when JAX cannot be imported here.

    Example:

    ```python
    check_jax()   # nothing on a machine with JAX
    ```
    """
    if importlib.util.find_spec("jax") is None:
        raise ValueError(
            "plan(compiler='tpu') on TensorFlow compiles the model's JAX lowering with "
            "XLA:TPU in a JAX subprocess, and JAX is not installed here. Install JAX and "
            f"XLA:TPU's compiler (libtpu) with `{JAX_PLAN_INSTALL}`, or plan with the "
            "host's XLA:CPU: plan(..., compiler='host').")


def _check_model(model) -> None:
    import keras

    if not isinstance(model, keras.Model):
        raise TypeError(f"plan: `model` must be a keras.Model, got {type(model).__name__}.")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise ValueError(
            "plan: compile the model first (model.compile(optimizer=..., loss=...)): the "
            "train step it plans includes the loss, gradients and optimizer update, and "
            "the JAX subprocess compiles the model as it was compiled.")


def _check_args(global_batch_size, device, accumulation_steps, precision, headroom, search,
                max_compile_batch, by_layer, mesh) -> dict:
    """The plan's arguments as JSON, checked where a wrong one is cheap to tell here."""
    from keras_tpu_mem.devices.tpu_slices import is_tpu_slice_name
    from keras_tpu_mem.planning.budget import _normalise_precision, check_headroom
    from keras_tpu_mem.planning.target import _check_mesh

    check_positive_int(global_batch_size, "global_batch_size")
    check_positive_int(max_compile_batch, "max_compile_batch")
    if accumulation_steps is not None:
        check_positive_int(accumulation_steps, "accumulation_steps")
    _normalise_precision(precision)
    check_headroom(headroom)
    for name, value in (("search", search), ("by_layer", by_layer)):
        if not isinstance(value, bool):
            raise TypeError(f"`{name}` must be True or False, got {value!r}.")
    if not isinstance(device, str) or not is_tpu_slice_name(device):
        raise ValueError(
            "plan: compiler='tpu' needs `device` to name a TPU slice such as 'v5e-8', "
            f"'v4-32' or 'v6e-64' (XLA:TPU compiles for that slice), got {device!r}.")
    _check_mesh(mesh, "plan")
    return {"global_batch_size": global_batch_size, "device": device,
            "accumulation_steps": accumulation_steps, "precision": precision,
            "headroom": float(headroom), "search": search,
            "max_compile_batch": max_compile_batch, "by_layer": by_layer,
            "mesh": None if mesh is None else dict(mesh)}


# -------------------------------------------------------------------------- the model
def _model_configs(model, classes: set) -> tuple[dict, dict]:
    """`(model config, compile config)`, JSON-ready; adds the model's classes to `classes`."""
    import keras

    try:
        config = keras.saving.serialize_keras_object(model)
        compile_config = model.get_compile_config()
    except Exception as err:  # noqa: BLE001 - any failure of a user's get_config
        raise ValueError(
            f"plan(compiler='tpu') on TensorFlow rebuilds the model from its config in a JAX "
            f"subprocess, and the model cannot be serialized: {type(err).__name__}: {err}. "
            "Give its custom layers get_config() (keras.saving docs).") from err
    config = dict(config)
    config.pop("compile_config", None)  # compiled explicitly, with `compile_config`
    config = _json_ready(config, "model")
    compile_config = _json_ready(dict(compile_config or {}), "the model's compile config")
    for layer in keras_compat.flatten_layers(model):
        classes.add(type(layer))
    for obj in (model.optimizer, getattr(model.optimizer, "inner_optimizer", None),
                getattr(model, "loss", None)):
        if obj is not None and not isinstance(obj, (str, dict, list, tuple)):
            classes.add(obj if isinstance(obj, type) else type(obj))
    return config, compile_config


def _json_ready(value, what: str):
    """`value` through JSON and back (NumPy scalars as numbers), or a ValueError."""

    def default(obj):
        if hasattr(obj, "item") and getattr(obj, "shape", None) == ():
            return obj.item()
        if hasattr(obj, "tolist"):
            return obj.tolist()
        raise TypeError(f"{type(obj).__name__} {obj!r}")

    try:
        return json.loads(json.dumps(value, default=default))
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"plan(compiler='tpu') on TensorFlow sends {what} to a JAX subprocess as JSON, "
            f"and it holds a value JSON cannot carry: {err}.") from err


# ------------------------------------------------------------------- feature callbacks
def _feature_payloads(callbacks, classes: set) -> list:
    """The feature callbacks as `{module, qualname, config, teacher}`: what the worker
    rebuilds them from. Other callbacks do not change the step and are left out."""
    import keras

    from keras_tpu_mem.planning.compiled import check_callbacks

    if callbacks is None:
        return None
    out = []
    for feature in check_callbacks(callbacks, "plan"):
        index = next(i for i, c in enumerate(callbacks) if c is feature)
        cls = type(feature)
        where = f"`callbacks[{index}]` ({cls.__name__})"
        if not _importable(cls):
            raise ValueError(
                f"plan(compiler='tpu') on TensorFlow: {where} is defined "
                f"{_where_defined(cls)}, which the JAX subprocess cannot import; define the "
                "feature class at the top level of an importable module.")
        get_config = getattr(feature, "get_config", None)
        if not callable(get_config):
            raise ValueError(
                f"plan(compiler='tpu') on TensorFlow rebuilds the feature callbacks in a JAX "
                f"subprocess from their config, and {where} has no get_config(): give it "
                "get_config() (and from_config(), or a constructor taking its keys).")
        try:
            config = get_config()
        except Exception as err:  # noqa: BLE001 - a user's get_config
            raise ValueError(f"plan(compiler='tpu') on TensorFlow: {where}.get_config() "
                             f"failed: {type(err).__name__}: {err}.") from err
        teacher = getattr(feature, "teacher", None)
        teacher_config = None
        if isinstance(teacher, keras.Model):
            try:
                teacher_config = keras.saving.serialize_keras_object(teacher)
            except Exception as err:  # noqa: BLE001
                raise ValueError(f"plan(compiler='tpu') on TensorFlow: the teacher of {where} "
                                 f"cannot be serialized: {type(err).__name__}: {err}.") from err
            teacher_config.pop("compile_config", None)
            for layer in keras_compat.flatten_layers(teacher):
                classes.add(type(layer))
        classes.add(cls)
        out.append(_json_ready({"module": cls.__module__, "qualname": cls.__qualname__,
                                "config": config, "teacher": teacher_config}, where))
    return out


# -------------------------------------------------------------------------- the data
def _encode_structure(structure, name: str, arrays: bool):
    """Specs (or a sample batch's arrays) as JSON: their shapes and dtypes only."""
    import keras

    def encode(item, path):
        if item is None:
            return None
        if isinstance(item, dict):
            return {"dict": [[str(k), encode(v, f"{path}[{k!r}]")] for k, v in item.items()]}
        if isinstance(item, (list, tuple)):
            kind = "list" if isinstance(item, list) else "tuple"
            return {kind: [encode(v, f"{path}[{i}]") for i, v in enumerate(item)]}
        shape, dtype = getattr(item, "shape", None), getattr(item, "dtype", None)
        if shape is None or dtype is None:
            raise TypeError(
                f"`{name}`: {path} must be "
                + ("an array (NumPy, tf.Tensor)" if arrays else
                   "a spec (tf.TensorSpec, keras.KerasTensor)")
                + f" with a shape and a dtype, got {type(item).__name__}.")
        try:
            dims = [None if d is None else int(d) for d in tuple(shape)]
        except TypeError as err:  # an unknown rank
            raise ValueError(f"`{name}`: {path} has no known rank ({shape}).") from err
        if arrays and dims:
            dims[0] = 1  # a batch of one is shaped and typed like it
        return {"spec": [dims, keras.backend.standardize_dtype(dtype)]}

    if structure is None:
        return None
    return encode(structure, name)


# ----------------------------------------------------------------- classes and modules
def _importable(obj) -> bool:
    """Whether a fresh process can import `obj` by its module and name."""
    module = getattr(obj, "__module__", None)
    return bool(module) and module != "__main__" and "<locals>" not in getattr(
        obj, "__qualname__", "")


def _where_defined(obj) -> str:
    if getattr(obj, "__module__", None) == "__main__":
        return "in __main__ (a script or a notebook)"
    if "<locals>" in getattr(obj, "__qualname__", ""):
        return f"inside a function ({obj.__qualname__})"
    return f"in {getattr(obj, '__module__', '?')}"


def _is_keras(module) -> bool:
    return not module or module.split(".")[0] in ("keras", "builtins")


def named_classes(value):
    """Every `{"module", "class_name", "registered_name"}` entry of a Keras config."""
    if isinstance(value, dict):
        if isinstance(value.get("class_name"), str) and "module" in value:
            yield value
        for item in value.values():
            yield from named_classes(item)
    elif isinstance(value, list):
        for item in value:
            yield from named_classes(item)


def _resolve(entry):
    """The object this process has for a config entry (as Keras would find it), or None."""
    import keras

    name = entry["class_name"]
    if name == "function" and isinstance(entry.get("config"), str):
        name = entry["config"]
    registered = entry.get("registered_name")
    custom = keras.saving.get_custom_objects()
    if registered and registered in custom:
        return custom[registered]
    module = sys.modules.get(entry.get("module") or "")
    if module is None:
        try:
            module = importlib.import_module(entry["module"])
        except Exception:  # noqa: BLE001 - not importable here either
            return None
    return getattr(module, name, None)


def _modules_to_import(configs, classes: set) -> list:
    """The modules the worker imports before rebuilding: those of the non-Keras classes
    the configs name (found through `keras.saving.get_custom_objects()` or their module)
    and of the model's layers and features. Raises a ValueError naming every class the
    subprocess could not find."""
    modules, missing = [], {}  # missing: class name -> where it is defined

    def add(module):
        if module and not _is_keras(module) and module not in modules:
            modules.append(module)

    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        if _importable(cls):
            add(cls.__module__)
        elif not _is_keras(cls.__module__):
            missing.setdefault(cls.__name__, _where_defined(cls))
    for entry in named_classes(configs):
        module, name = entry.get("module"), entry["class_name"]
        if name.startswith("__") or _is_keras(module) or name in missing:
            continue
        obj = _resolve(entry)
        if obj is None or not _importable(obj):
            missing[name] = ("not found in this process" if obj is None
                             else _where_defined(obj))
        else:
            add(obj.__module__)
    if missing:
        raise ValueError(missing_classes_message(
            [f"{name} ({where})" for name, where in missing.items()]))
    return modules


_IMPORTABLE_HINT = (
    "Define them at the top level of an importable module and register them with "
    "@keras.saving.register_keras_serializable() there: the subprocess imports the modules "
    "of the model's classes (and of keras.saving.get_custom_objects()) with this process's "
    "sys.path before it rebuilds the model.")


def missing_classes_message(missing) -> str:
    """The error for classes the JAX subprocess cannot find, naming them."""
    return ("plan(compiler='tpu') on TensorFlow rebuilds the model in a JAX subprocess, "
            f"which cannot find these classes: {', '.join(missing)}. {_IMPORTABLE_HINT}")


# --------------------------------------------------------------------- the subprocess
def _child_env() -> dict:
    """KERAS_BACKEND=jax on the host's CPU (compile-only TPU devices need no TPU), this
    process's `sys.path` (for the user's modules), without TF_USE_LEGACY_KERAS."""
    env = dict(os.environ)
    env.pop("TF_USE_LEGACY_KERAS", None)
    env["KERAS_BACKEND"] = "jax"
    env["JAX_PLATFORMS"] = "cpu"
    prefixes = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if any(path == p or path.startswith(p + os.sep) for p in prefixes):
            continue  # the interpreter's own: the subprocess has them
        if os.path.isdir(path) and path not in paths:
            paths.append(path)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    return env


def _tail(text: str, lines: int = _TAIL_LINES) -> str:
    kept = [line for line in (text or "").splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _run_worker(payload: dict, timeout: float) -> dict:
    """Runs the worker on `payload`; its plan as JSON, or the error it reports, raised."""
    with tempfile.TemporaryDirectory(prefix="ktm_jax_lowering_") as folder:
        in_path, out_path = os.path.join(folder, IN_NAME), os.path.join(folder, OUT_NAME)
        with open(in_path, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        command = [sys.executable, "-m", WORKER, in_path, out_path]
        try:
            done = subprocess.run(command, env=_child_env(), capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except subprocess.TimeoutExpired as err:
            stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) \
                else (err.stderr or "")
            raise RuntimeError(
                f"plan(compiler='tpu'): the JAX subprocess that compiles the model's JAX "
                f"lowering ran past `timeout`={timeout:g} s; pass a larger timeout. Its last "
                f"lines:\n{_tail(stderr)}") from None
        result = None
        if os.path.exists(out_path):
            with open(out_path, encoding="utf-8") as f:
                result = json.load(f)
    if result is None or (done.returncode != 0 and "error" not in result):
        raise RuntimeError(
            f"plan(compiler='tpu'): the JAX subprocess failed (exit status "
            f"{done.returncode}) before it wrote a plan. Its last lines:\n"
            f"{_tail(done.stderr)}")
    if "error" in result:
        _raise_worker_error(result["error"], done.stderr)
    return result["plan"]


def _shorten(message: str, limit: int = 800) -> str:
    """Keras' message without the configs it quotes whole: its first line and the
    exception it encountered, at most `limit` characters."""
    head = re.split(r"\s*(?:Full object config:|config=\{)", message)[0].strip()
    inner = message.rpartition("Exception encountered:")[2] if \
        "Exception encountered:" in message else ""
    inner = re.split(r"\s*Full object config:", inner)[0].strip()
    text = f"{head} ({inner})" if inner else head
    return text if len(text) <= limit else text[:limit] + " ..."


def _raise_worker_error(error: dict, stderr: str):
    """The worker's error, raised here: a model it could not rebuild and a bad argument as
    ValueError / TypeError, anything else as a RuntimeError with its last lines."""
    kind, message = error.get("type", "Error"), error.get("message", "")
    if error.get("stage") == "rebuild":
        failed = error.get("failed_imports") or []
        located = sorted(set(re.findall(r"Could not locate (?:class|function) '([^']+)'",
                                        message)))
        if located:
            reason = f"Keras could not locate {', '.join(located)}"
            hint = _IMPORTABLE_HINT
        else:  # Keras' own message, without the configs it quotes whole
            reason = f"{kind}: {_shorten(message)}"
            hint = ("Every class of the model must rebuild from its get_config() "
                    "(cls.from_config(layer.get_config())), as keras.saving needs.")
        raise ValueError(
            "plan(compiler='tpu') on TensorFlow: the JAX subprocess could not rebuild the "
            f"model from its config: {reason}"
            + (f" (modules it could not import: {'; '.join(failed)})" if failed else "")
            + f". {hint}")
    if error.get("stage") == "plan" and kind in ("ValueError", "TypeError"):
        raised = ValueError if kind == "ValueError" else TypeError
        raise raised(f"{message} (raised by plan in the JAX subprocess that compiles the "
                     "model's JAX lowering)")
    raise RuntimeError(
        f"plan(compiler='tpu'): the JAX subprocess that compiles the model's JAX lowering "
        f"failed: {kind}: {message}\n{_tail(error.get('traceback', ''))}\n"
        f"{_tail(stderr, 8)}".rstrip())


# ------------------------------------------------------------------------- the result
def plan_from_json(data: dict, features: bool = False):
    """The `MemoryPlan` the worker wrote (`jax_lowering_worker.plan_to_json`), its
    `compiler` reading `"XLA:TPU via the JAX lowering (...)"` and a note first saying
    the step planned is the model's JAX lowering.

    Args:
        data: The plan's JSON dict.
        features: Whether feature callbacks were given (the note names the engine's step).

    Example:

    ```python
    plan = plan_from_json(json.load(open("out.json"))["plan"])
    ```
    """
    from keras_tpu_mem.planning.budget import DeviceBudget
    from keras_tpu_mem.planning.by_layer import LayerTable
    from keras_tpu_mem.planning.memory_plan import MemoryPlan, Recommendation

    def recommendation(value):
        if value is None:
            return None
        names = {f.name for f in dataclasses.fields(Recommendation) if f.compare}
        value = {k: v for k, v in value.items() if k in names}
        if value.get("remat_layers") is not None:
            value["remat_layers"] = tuple(value["remat_layers"])
        return Recommendation(**value)

    fields = {f.name for f in dataclasses.fields(MemoryPlan)}
    values = {k: v for k, v in data.items() if k in fields}
    values["device"] = DeviceBudget(**values["device"])
    for name in ("recommendation", "bf16_recommendation"):
        values[name] = recommendation(values.get(name))
    values["candidates"] = tuple(recommendation(c) for c in values.get("candidates") or ())
    for name in ("compiled_batches", "notes", "features"):
        values[name] = tuple(values.get(name) or ())
    table = values.get("by_layer")
    if table is not None:
        rows = {row[0]: tuple(row[1:]) for row in table["rows"]}
        values["by_layer"] = LayerTable(rows, table["peak_bytes"], table["total_bytes"])
    compiler = values.get("compiler") or "XLA:TPU"
    values["compiler"] = (COMPILER_PREFIX + compiler[len("XLA:TPU"):]
                          if compiler.startswith("XLA:TPU") else f"{compiler} via the JAX lowering")
    step = ("the engine's JAX step for " + ", ".join(values["features"])
            if features and values["features"] else "Keras' JAX train step")
    note = (f"The step planned is the model's JAX lowering ({step}), rebuilt from the "
            "model's config with shapes only and compiled by XLA:TPU in a JAX subprocess: "
            "the same model, loss and optimizer as your TensorFlow step, lowered by JAX, "
            "not by the TensorFlow bridge.")
    values["notes"] = (note, *values["notes"])
    return MemoryPlan(**values)


__all__ = ["JAX_PLAN_INSTALL", "check_jax", "plan_from_json", "plan_with_jax"]
