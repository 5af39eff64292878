"""The JAX side of `plan_with_jax`: rebuilds a model with shapes only and plans it with
XLA:TPU.

Run as `python -m keras_tpu_mem.planning.jax_lowering_worker IN_JSON OUT_JSON` with
`KERAS_BACKEND=jax` (`jax_lowering.plan_with_jax` does). It reads what the parent wrote
(the model's config, its compile config, the feature callbacks' classes and configs, the
data's shapes and dtypes, the plan's arguments and the modules to import first), imports
those modules, rebuilds and compiles the model inside `ktm.shapes_only()` (nothing is
allocated), rebuilds the feature callbacks, runs `ktm.plan(..., compiler="tpu")` and
writes `{"plan": ...}` (`plan_to_json`) or `{"error": {"stage", "type", "message",
"traceback"}}` to OUT_JSON. Stages: `"rebuild"` (the model or its features could not be
rebuilt from their configs), `"plan"` (`ktm.plan` raised), `"worker"` (anything else).

Imports Keras and the keras-tpu-mem public API only.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import traceback


def _shapes_only():
    from keras_tpu_mem.shapes import shapes_only

    return shapes_only()


def _import_modules(modules) -> list:
    """Imports the modules that define (and register) the model's classes; returns the
    failures as `"module: error"` lines."""
    failed = []
    for module in modules or ():
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - reported if the rebuild fails
            failed.append(f"{module}: {type(err).__name__}: {err}")
    return failed


def _decode(value):
    """A structure `jax_lowering._encode_structure` wrote, as `keras.KerasTensor` specs."""
    import keras

    if value is None:
        return None
    if "spec" in value:
        shape, dtype = value["spec"]
        return keras.KerasTensor(tuple(shape), dtype=dtype)
    if "dict" in value:
        return {key: _decode(item) for key, item in value["dict"]}
    if "list" in value:
        return [_decode(item) for item in value["list"]]
    return tuple(_decode(item) for item in value["tuple"])


def _zeros(spec):
    """A batch of zeros shaped and typed like `spec` (NumPy where NumPy has the dtype)."""
    import keras
    import numpy as np

    try:
        return np.zeros(spec.shape, dtype=np.dtype(spec.dtype))
    except TypeError:  # bfloat16 and other dtypes NumPy does not name
        return keras.ops.zeros(spec.shape, dtype=spec.dtype)


def _sample_batch(value):
    import keras

    specs = _decode(value)
    if specs is None:
        return None
    return keras.tree.map_structure(_zeros, specs)


def custom_objects(configs) -> dict:
    """The configs' classes and functions from modules outside Keras, by the names Keras
    looks them up by (registered name and class name): a class defined at the top level
    of an importable module is found without registration, as `load_model(...,
    custom_objects=...)` finds it."""
    from keras_tpu_mem.planning.jax_lowering import named_classes

    found = {}
    for entry in named_classes(configs):
        module, name = entry.get("module") or "", entry["class_name"]
        if not module or module.split(".")[0] in ("keras", "builtins") or name.startswith("__"):
            continue
        if name == "function" and isinstance(entry.get("config"), str):
            name = entry["config"]
        try:
            obj = getattr(importlib.import_module(module), name)
        except Exception:  # noqa: BLE001 - Keras says what it cannot find
            continue
        for key in (entry.get("registered_name"), name):
            if key:
                found.setdefault(key, obj)
    return found


def _feature(entry, safe_mode):
    """A feature callback rebuilt from its class and config (a teacher: shapes only)."""
    import keras

    module = importlib.import_module(entry["module"])
    cls = module
    for part in entry["qualname"].split("."):
        cls = getattr(cls, part)
    kwargs = {}
    if entry.get("teacher") is not None:
        with _shapes_only():
            kwargs["teacher"] = keras.saving.deserialize_keras_object(
                entry["teacher"], safe_mode=safe_mode)
    from_config = getattr(cls, "from_config", None)
    if from_config is not None:
        return from_config(entry["config"], **kwargs)
    return cls(**kwargs, **entry["config"])


def rebuild(payload: dict):
    """`(model, callbacks)` from the parent's payload: the model built and compiled in
    `ktm.shapes_only()`, the feature callbacks rebuilt (None where none were given).

    The compile config is the model's own, jit-compiled (`jit_compile="auto"`: JAX's
    default) and not eager: the TensorFlow setting of either is not the JAX lowering's.
    """
    import keras

    safe_mode = False  # the configs are the parent process's own model
    found = custom_objects([payload.get("model"), payload.get("compile"),
                            payload.get("callbacks")])
    with keras.saving.custom_object_scope(found), _shapes_only():
        model = keras.saving.deserialize_keras_object(payload["model"], safe_mode=safe_mode)
        config = dict(payload.get("compile") or {})
        config["jit_compile"] = "auto"
        config["run_eagerly"] = False
        config = keras.saving.deserialize_keras_object(config, safe_mode=safe_mode)
        model.compile(**config)
        if model.built:
            model.optimizer.build(model.trainable_variables)
    callbacks = payload.get("callbacks")
    if callbacks is not None:
        with keras.saving.custom_object_scope(found):
            callbacks = [_feature(entry, safe_mode) for entry in callbacks]
    return model, callbacks


def plan_to_json(plan) -> dict:
    """A `MemoryPlan` as plain JSON: its fields; `device` as a dict; the recommendations
    and candidates as dicts of their plain fields (not `compiled_under` nor `target`);
    `by_layer` as `{"rows": [[name, weights, optimizer, saved_activations, at_peak]],
    "peak_bytes", "total_bytes"}`."""

    def recommendation(rec):
        if rec is None:
            return None
        return {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec) if f.compare}

    out = {}
    for field in dataclasses.fields(plan):
        value = getattr(plan, field.name)
        if field.name == "device":
            value = dataclasses.asdict(value)
        elif field.name in ("recommendation", "bf16_recommendation"):
            value = recommendation(value)
        elif field.name == "candidates":
            value = [recommendation(c) for c in value]
        elif field.name == "by_layer" and value is not None:
            value = {"rows": [list(row) for row in value.rows],
                     "peak_bytes": value.peak_bytes, "total_bytes": value.total_bytes}
        out[field.name] = value
    return json.loads(json.dumps(out, default=_plain))


def _plain(obj):
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _error(stage: str, err: Exception, **more) -> dict:
    return {"error": {"stage": stage, "type": type(err).__name__, "message": str(err),
                      "traceback": traceback.format_exc(), **more}}


def run(in_path: str, out_path: str) -> int:
    """Reads `in_path`, plans, writes `out_path`; 0 on a plan, 1 on an error."""
    import keras

    with open(in_path, encoding="utf-8") as f:
        payload = json.load(f)
    if keras.backend.backend() != "jax":
        result = {"error": {"stage": "worker", "type": "RuntimeError", "message":
                            "the JAX lowering's worker runs with KERAS_BACKEND=jax, not "
                            f"{keras.backend.backend()!r}", "traceback": ""}}
    else:
        result = _plan(payload)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0 if "plan" in result else 1


def _plan(payload: dict) -> dict:
    from keras_tpu_mem.planning.planner import plan as plan_fn

    failed = _import_modules(payload.get("modules"))
    try:
        model, callbacks = rebuild(payload)
    except Exception as err:  # noqa: BLE001 - reported to the parent
        return _error("rebuild", err, failed_imports=failed)
    args = dict(payload["args"])
    try:
        plan = plan_fn(
            model, args.pop("global_batch_size"), compiler="tpu", callbacks=callbacks,
            x_spec=_decode(payload.get("x_spec")), y_spec=_decode(payload.get("y_spec")),
            sample_batch=_sample_batch(payload.get("sample_batch")), **args)
    except Exception as err:  # noqa: BLE001 - reported to the parent
        return _error("plan", err)
    try:
        return {"plan": plan_to_json(plan)}
    except Exception as err:  # noqa: BLE001
        return _error("worker", err)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m keras_tpu_mem.planning.jax_lowering_worker IN_JSON OUT_JSON",
              file=sys.stderr)
        return 2
    os.environ.setdefault("KERAS_BACKEND", "jax")
    return run(*argv)


if __name__ == "__main__":
    sys.exit(main())
