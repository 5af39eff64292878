"""keras_tpu_mem/backends/tensorflow/profiler.py: TensorFlow's half of profiling,
and the contract both backends' profiler modules share."""

from __future__ import annotations

import ast
import os

import pytest
import tensorflow as tf
from profiling_models import capture_twice, digits_model

from keras_tpu_mem import backends, devices
from keras_tpu_mem.backends import contracts
from keras_tpu_mem.backends.tensorflow import profiler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _functions(backend):
    path = os.path.join(ROOT, "keras_tpu_mem", "backends", backend, "profiler.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {node.name: [a.arg for a in node.args.args] for node in tree.body
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}


def test_both_backends_offer_the_same_functions():
    tensorflow = _functions("tensorflow")
    assert tensorflow == _functions("jax")
    for name in tensorflow:  # the contract names and documents each one
        assert getattr(contracts.Profiler, name).__doc__, name


def test_current_backend_serves_this_module():
    assert backends.current().profiler is profiler


def test_start_stop_report_a_busy_or_stopped_profiler(tmp_path):
    answers, written = capture_twice(profiler, tmp_path, lambda: tf.reduce_sum(tf.ones((8, 8))))
    assert answers == (True, False, True, False)  # the second stop finds nothing running
    assert len(written) == 1


def test_capture_hint_and_the_step_counter():
    assert "grpc://localhost:6011" in profiler.capture_hint(6011, "logs")
    assert profiler.counter_after_execution(lambda: 7) == 7


def test_replica_devices_are_short_names_with_one_cpu(mirrored):
    assert profiler.replica_devices(digits_model(jit_compile=False), devices) == ["CPU:0"]
    with mirrored.strategy.scope():
        model = digits_model(jit_compile=False)
    assert profiler.replica_devices(model, devices) == ["CPU:0", "CPU:0"]


def test_sweep_inputs_and_out_of_memory_errors():
    profiler.check_sweep_input("tf.data", tf.data.Dataset.range(3))
    with pytest.raises(TypeError, match="tf.data.Dataset, got tuple"):
        profiler.check_sweep_input("arrays", (1, 2))
    oom = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating")
    assert profiler.is_out_of_memory(oom) is True
    assert profiler.is_out_of_memory(tf.errors.InternalError(None, None, "other")) is False
    assert profiler.is_out_of_memory(ValueError("RESOURCE_EXHAUSTED")) is False


def test_xspace_class_is_tensorflows_own_then_the_schema(monkeypatch):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    from keras_tpu_mem._compat import jax_profiler
    from keras_tpu_mem._compat import profiler as profiler_compat

    assert profiler.xspace_class() is xplane_pb2.XSpace
    monkeypatch.setattr(profiler_compat, "xspace_class", lambda: None)
    assert profiler.xspace_class() is jax_profiler.xspace_class()
