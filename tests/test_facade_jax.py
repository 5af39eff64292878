"""The package facade (`keras_tpu_mem/__init__.py`) on JAX: every public name of the second
wave and `StepOutOfMemoryError` stay importable from `keras_tpu_mem` through the seam's
refactor, and loading a training feature registers the planner's out-of-memory explainer
with the engine (which never imports the planner)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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


#: A fit whose step raises XLA's RESOURCE_EXHAUSTED, in a fresh process that imports its
#: feature module directly (`{import_line}`), never through the package facade.
_OOM_WITHOUT_THE_FACADE = """
import os, sys
os.environ["KERAS_BACKEND"] = "jax"
{import_line}
import jax, keras, numpy as np
from keras_tpu_mem.engine import EngineCallback

assert "keras_tpu_mem.planning.oom" not in sys.modules

class InjectedOOM(EngineCallback):
    name = "injected_oom"
    armed = True

    def transform_loss(self, loss, ctx):
        if InjectedOOM.armed:
            InjectedOOM.armed = False  # the explanation's own compile traces it again
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB.")
        return loss

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
model.compile("sgd", "mse")
try:
    model.fit(np.zeros((16, 8), "float32"), np.zeros((16, 4), "float32"), batch_size=16,
              epochs=1, verbose=0, callbacks=[InjectedOOM()])
except Exception as err:
    print("RAISED", type(err).__name__)
"""


@pytest.mark.slow  # fresh processes (docs/testing.md: slow)
@pytest.mark.parametrize("import_line", [
    "from keras_tpu_mem.sharding import ShardedDataParallel",
    "from keras_tpu_mem.accumulation import GradientAccumulation",
])
def test_out_of_memory_is_explained_whichever_way_the_features_are_imported(import_line):
    # A fresh process: the suite may have imported the planner already.
    code = _OOM_WITHOUT_THE_FACADE.format(import_line=import_line)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RAISED StepOutOfMemoryError" in done.stdout, (done.stdout, done.stderr[-2000:])
