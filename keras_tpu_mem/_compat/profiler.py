"""Private profiler APIs: XSpace converters, the XSpace proto, step markers.

`ProfileWindow` and `summarize_profile` (keras_tpu_mem.profiling) read back a
capture with the C++ converters behind TensorBoard's Profile tab, which only
private modules expose. Each accessor names the versions it was checked on;
`tests/test_compat_profiler.py` calls every one by name.

xprof (`pip install "keras-tpu-mem[profile]"`, through tensorboard-plugin-profile)
is optional: without it the capture itself still works (TensorFlow writes the
`*.xplane.pb`), and only the summary, which needs the converters, says once
which extra adds them.
"""

from __future__ import annotations

import importlib

#: The pip extra that installs xprof's converters.
PROFILE_EXTRA = 'pip install "keras-tpu-mem[profile]"'

# Where `xspace_to_tools_data(paths, tool, options)` lives. All wrap the same
# C++ function; the pure-Python wrapper of newer xprof releases can fail to
# import on an older protobuf (TensorFlow 2.19 pins protobuf 5, xprof 2.22 is
# generated with protobuf 6), so the raw bindings are named directly.
XSPACE_CONVERTERS = (
    # xprof, which tensorboard-plugin-profile 2.22 installs (checked: xprof 2.22.1).
    ("xprof", "xprof.convert._pywrap_profiler_plugin"),
    # Older tensorboard-plugin-profile releases, before the code moved into xprof
    # (not installed here: kept for environments that pin one).
    ("tensorboard_plugin_profile",
     "tensorboard_plugin_profile.convert._pywrap_profiler_plugin"),
)
# TensorFlow 2.21 still carries an older copy of the binding
# (tensorflow/python/profiler/internal), but its overview page is not the JSON
# that xprof's is (measured: json.loads fails on it), so it is not a candidate:
# without xprof the summary says which extra adds it.

# The XSpace message a `*.xplane.pb` holds.
XSPACE_PROTOS = (
    # TensorFlow 2.16-2.21 (checked 2.21.0) ships TSL's protos inside its wheel.
    "tensorflow.tsl.profiler.protobuf.xplane_pb2",
    # A standalone TSL/XLA install.
    "tsl.profiler.protobuf.xplane_pb2",
)


def find_xspace_converter(candidates=None):
    """`(name, xspace_to_tools_data)` of the first converter that imports.

    Returns `(None, reason)` where none does; `reason` lists why each failed.
    """
    errors = []
    for name, module_name in XSPACE_CONVERTERS if candidates is None else candidates:
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # ImportError, protobuf VersionError, ...
            errors.append(f"{module_name}: {type(err).__name__}")
            continue
        fn = getattr(module, "xspace_to_tools_data", None)
        if callable(fn):
            return name, fn
        errors.append(f"{module_name}: no xspace_to_tools_data")
    return None, "no XSpace converter could be imported (" + "; ".join(errors) + ")"


def profile_plugin_installed() -> bool:
    """Whether TensorBoard has its Profile tab here (tensorboard-plugin-profile)."""
    import importlib.util

    try:
        return importlib.util.find_spec("tensorboard_plugin_profile") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules
        return False


def xspace_class():
    """The `XSpace` protobuf class that parses a `*.xplane.pb`, or None."""
    for module_name in XSPACE_PROTOS:
        try:
            return importlib.import_module(module_name).XSpace
        except Exception:
            continue
    return None


def step_trace(name: str, step_num: int):
    """A profiler trace context that XProf's overview page counts as one step.

    TF 2.4-2.21 (checked 2.21.0): `tf.profiler.experimental.Trace(name,
    step_num=..., _r=1)`, the private `_r=1` marking a root step event, as
    Keras' own TensorBoard callback sets it.
    """
    import tensorflow as tf

    return tf.profiler.experimental.Trace(name, step_num=step_num, _r=1)
