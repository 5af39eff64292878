"""Profiling on JAX: `jax.profiler`'s public API (checked: jax 0.10.2), writing
the same XProf files as TensorFlow's profiler; nothing of it imports TensorFlow.

Contract: `keras_tpu_mem.backends.contracts.Profiler`.
"""

from __future__ import annotations

import sys

import jax

from keras_tpu_mem._compat import jax_profiler as jax_profiler_compat


def start(log_dir: str) -> bool:
    try:
        jax.profiler.start_trace(log_dir)
    except RuntimeError:  # "Profile has already been started"
        return False
    return True


def stop() -> bool:
    try:
        jax.profiler.stop_trace()
    except RuntimeError:  # "No profile started"
        return False
    return True


def step(name: str, step_num: int):
    # XProf's overview page measures step time from these (checked on
    # jax 0.10.2 with xprof 2.22.1), as from TensorFlow's `_r=1` traces.
    return jax.profiler.StepTraceAnnotation(name, step_num=step_num)


def start_server(port: int) -> None:
    # JAX keeps its one server in a module global until the process ends.
    jax.profiler.start_server(port)


def capture_hint(port: int, log_dir: str) -> str:
    return (f"python -m jax.collect_profile {port} 2000 --log_dir={log_dir} "
            "--no_perfetto_link (it needs xprof)")


def counter_after_execution(read):
    # Not read: between executions of an epoch that would make Keras copy the
    # whole training state back into the model every step.
    return None


def replica_devices(model, devices) -> list:
    """The `jax.Device`s of the active distribution (`devices.monitored_jax_devices`)."""
    return devices.monitored_jax_devices()


def check_sweep_input(kind: str, data) -> None:
    # JAX also trains on a keras.utils.PyDataset and on arrays: the caller
    # takes those and refuses anything else.
    return None


def is_out_of_memory(error: BaseException) -> bool:
    # XlaRuntimeError / JaxRuntimeError whose message starts RESOURCE_EXHAUSTED.
    if (type(error).__name__ in ("XlaRuntimeError", "JaxRuntimeError")
            and "RESOURCE_EXHAUSTED" in str(error)):
        return True
    # A tf.data input (where TensorFlow is installed and already loaded) raises
    # TensorFlow's own error; looked up, never imported, on JAX.
    errors = getattr(sys.modules.get("tensorflow"), "errors", None)
    return errors is not None and isinstance(error, errors.ResourceExhaustedError)


def xspace_class():
    # The schema built from protobuf, never TensorFlow's generated class: where
    # TensorFlow is installed, importing that would load all of it into a JAX run.
    return jax_profiler_compat.xspace_class()
