"""Profiling on TensorFlow: `tf.profiler.experimental`, its server, its errors.

Contract: `keras_tpu_mem.backends.contracts.Profiler` (used by
`keras_tpu_mem.profiling`).
"""

from __future__ import annotations

import tensorflow as tf

from keras_tpu_mem._compat import jax_profiler as jax_profiler_compat
from keras_tpu_mem._compat import profiler as profiler_compat


def start(log_dir: str) -> bool:
    try:
        tf.profiler.experimental.start(log_dir)
    except tf.errors.AlreadyExistsError:  # Keras' TensorBoard profiler, another window
        return False
    return True


def stop() -> bool:
    try:
        tf.profiler.experimental.stop()
    except tf.errors.UnavailableError:  # someone else stopped the capture
        return False
    return True


def step(name: str, step_num: int):
    return profiler_compat.step_trace(name, step_num)


def start_server(port: int) -> None:
    tf.profiler.experimental.server.start(port)


def capture_hint(port: int, log_dir: str) -> str:
    return (f"tf.profiler.experimental.client.trace('grpc://localhost:{port}', "
            f"{log_dir!r}, 2000)")


def counter_after_execution(read):
    # Reading the optimizer's counter is one variable read on TensorFlow; it is
    # exact where Keras' batch index is not (the epoch's last, shorter execution).
    return read()


def replica_devices(model, devices) -> list[str]:
    """Short names of the model's replicas' devices (`"GPU:1"`), each CPU as `"CPU:0"`:
    all logical CPUs share the one host allocator."""
    names = [n.split("device:")[-1]
             for n in devices.replica_device_names(model.distribute_strategy)]
    return ["CPU:0" if devices.is_host_device(name) else name for name in names or ["CPU:0"]]


def check_sweep_input(kind: str, data) -> None:
    if kind != "tf.data":
        raise TypeError("`dataset_fn` must return a tf.data.Dataset, got "
                        f"{type(data).__name__}.")


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, tf.errors.ResourceExhaustedError)


def xspace_class():
    # TensorFlow's own generated class (TensorFlow is loaded already), else the
    # same schema built from protobuf.
    return profiler_compat.xspace_class() or jax_profiler_compat.xspace_class()
