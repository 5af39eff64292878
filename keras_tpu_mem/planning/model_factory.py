"""`load_model_factory`: the model of `keras-tpu-mem plan --model MODULE:FUNCTION` (and the
batch of `--sample-batch MODULE:FUNCTION`)."""

from __future__ import annotations


def load_model_factory(spec: str, option: str = "--model"):
    """Imports `MODULE:FUNCTION` (a dotted module or a .py path) and returns FUNCTION;
    errors name `option`, the command-line option that gave `spec`."""
    import importlib
    import importlib.util
    import os

    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(
            f"{option} must be MODULE:FUNCTION (e.g. 'examples.bert_memory:build_model' or "
            f"'path/to/file.py:build'), got {spec!r}."
        )
    module_name, _, func_name = spec.rpartition(":")
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.exists(module_name):
            raise ValueError(f"{option}: no such file {module_name!r}.")
        mod_spec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(module_name))[0], module_name)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        import sys

        if os.getcwd() not in sys.path:  # console scripts do not put "." on sys.path
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"{option}: cannot import {module_name!r}: {err}") from err
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"{option}: {module_name!r} has no callable {func_name!r}.")
    return func
