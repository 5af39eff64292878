"""keras_tpu_mem/backends/jax/profiler.py: JAX's half of profiling (the contract is
checked in test_backends_profiler.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from helpers import make_distribution, scope
from profiling_models import capture_twice, small_model

from keras_tpu_mem import backends, devices
from keras_tpu_mem._compat import jax_profiler
from keras_tpu_mem.backends.jax import profiler


def test_current_backend_serves_this_module():
    assert backends.current().profiler is profiler


def test_start_stop_report_a_busy_or_stopped_profiler(tmp_path):
    answers, written = capture_twice(
        profiler, tmp_path, lambda: jnp.ones((8, 8)).sum().block_until_ready())
    assert answers == (True, False, True, False)  # the second stop finds nothing running
    assert len(written) == 1


def test_capture_hint_and_the_step_counter_left_unread():
    assert "jax.collect_profile 6011" in profiler.capture_hint(6011, "logs")
    read = []
    assert profiler.counter_after_execution(lambda: read.append(1) or 7) is None
    assert read == []  # reading it would copy the training state back every step


def test_replica_devices_are_the_distributions():
    assert profiler.replica_devices(small_model(), devices) == jax.local_devices()[:1]
    with scope(make_distribution("dp8")):
        assert profiler.replica_devices(small_model(), devices) == jax.devices()[:8]


def test_sweep_inputs_and_out_of_memory_errors():
    profiler.check_sweep_input("arrays", (1, 2))  # the caller cuts arrays into batches
    profiler.check_sweep_input("PyDataset", None)
    assert profiler.is_out_of_memory(jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."))
    assert not profiler.is_out_of_memory(jax.errors.JaxRuntimeError("INTERNAL: other"))
    assert not profiler.is_out_of_memory(ValueError("RESOURCE_EXHAUSTED"))


def test_xspace_class_is_the_tensorflow_free_schema():
    assert profiler.xspace_class() is jax_profiler.xspace_class()
