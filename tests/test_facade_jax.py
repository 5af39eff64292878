"""The package facade (`keras_tpu_mem/__init__.py`) on JAX: every public name of the second
wave and `StepOutOfMemoryError` stay importable from `keras_tpu_mem` through the seam's
refactor, and loading a training feature registers the planner's out-of-memory explainer
with the engine (which never imports the planner)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import keras_tpu_mem as ktm

#: The flat API as it stood before the seam (issue 20): none may disappear.
PUBLIC_BEFORE_THE_SEAM = (
    "GradientAccumulation", "AcceleratorSpec", "HBM_TABLE", "MemoryReading", "lookup_tpu",
    "Distillation", "cache_teacher_logits", "distillation_kl", "load_teacher_logits",
    "prepare_student", "strip_teacher_logits", "TeacherLogits", "HBMMonitor", "InputRate",
    "ThroughputMonitor", "measure_input_rate", "CompiledMemory", "MemoryPlan",
    "compiled_memory", "plan", "Recommendation", "Rematerialize", "MixedBFloat16",
    "PrecisionReport", "PrecisionRow", "device_notice", "enable_mixed_bfloat16",
    "precision_report", "to_mixed_bfloat16", "ProfileSummary", "ProfileWindow", "SweepResult",
    "batch_size_sweep", "ConstantSparsity", "PolynomialDecay", "Pruning", "PruningSchedule",
    "SparsityReport", "sparsity_report", "strip_pruning", "write_report",
    "TPUStrategyWrapper", "observe_first_batch",
)


def test_every_public_name_of_before_and_step_out_of_memory_error_load_on_jax():
    from keras_tpu_mem.planning.oom import StepOutOfMemoryError

    for name in PUBLIC_BEFORE_THE_SEAM + ("StepOutOfMemoryError",):
        assert name in ktm.__all__, name
        assert getattr(ktm, name) is not None, name
    assert ktm.StepOutOfMemoryError is StepOutOfMemoryError
    assert issubclass(ktm.StepOutOfMemoryError, RuntimeError)


def test_loading_a_feature_registers_the_out_of_memory_explainer():
    # A fresh process: the suite may have imported the planner already.
    code = textwrap.dedent("""
        import os, sys
        os.environ["KERAS_BACKEND"] = "jax"
        import keras_tpu_mem as ktm
        from keras_tpu_mem.engine import core
        before = len(core._ERROR_EXPLAINERS)
        ktm.GradientAccumulation
        print(before, len(core._ERROR_EXPLAINERS), "keras_tpu_mem.planning.oom" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1", "True"]
