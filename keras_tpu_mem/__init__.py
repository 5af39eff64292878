"""keras-tpu-mem: fit bigger models into TPU memory with ordinary Keras 3 callbacks.

Public names are flat: `import keras_tpu_mem as ktm; ktm.TPUStrategyWrapper()`.
The package does not choose a Keras backend; its training features need the
TensorFlow backend and say so when another is active.
"""

__version__ = "0.1.0.dev0"

try:
    import tensorflow as _tf  # noqa: F401
except ImportError as _err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "keras_tpu_mem needs TensorFlow. Install it with "
        "`pip install keras-tpu-mem[tensorflow]` (or [cpu] for tensorflow-cpu); on a "
        "TPU VM install `tensorflow-tpu` as Google's TPU guide says."
    ) from _err

from keras_tpu_mem.accumulation import GradientAccumulation
from keras_tpu_mem.devices import HBM_TABLE, AcceleratorSpec, MemoryReading, lookup_tpu
from keras_tpu_mem.distillation import (
    Distillation,
    cache_teacher_logits,
    distillation_kl,
    load_teacher_logits,
    prepare_student,
    strip_teacher_logits,
)
from keras_tpu_mem.monitoring import HBMMonitor, InputRate, ThroughputMonitor, measure_input_rate
from keras_tpu_mem.planning import CompiledMemory, MemoryPlan, compiled_memory, plan
from keras_tpu_mem.precision import (
    MixedBFloat16,
    PrecisionReport,
    PrecisionRow,
    device_notice,
    enable_mixed_bfloat16,
    precision_report,
    to_mixed_bfloat16,
)
from keras_tpu_mem.profiling import ProfileSummary, ProfileWindow, SweepResult, batch_size_sweep
from keras_tpu_mem.pruning import (
    ConstantSparsity,
    PolynomialDecay,
    Pruning,
    PruningSchedule,
    SparsityReport,
    sparsity_report,
    strip_pruning,
)
from keras_tpu_mem.report import write_report
from keras_tpu_mem.strategy import TPUStrategyWrapper

__all__ = [
    "Distillation",
    "GradientAccumulation",
    "HBMMonitor",
    "HBM_TABLE",
    "InputRate",
    "AcceleratorSpec",
    "CompiledMemory",
    "ConstantSparsity",
    "MemoryPlan",
    "MemoryReading",
    "MixedBFloat16",
    "PolynomialDecay",
    "PrecisionReport",
    "ProfileSummary",
    "ProfileWindow",
    "Pruning",
    "PruningSchedule",
    "SparsityReport",
    "PrecisionRow",
    "SweepResult",
    "TPUStrategyWrapper",
    "ThroughputMonitor",
    "batch_size_sweep",
    "cache_teacher_logits",
    "compiled_memory",
    "device_notice",
    "distillation_kl",
    "enable_mixed_bfloat16",
    "load_teacher_logits",
    "lookup_tpu",
    "measure_input_rate",
    "plan",
    "precision_report",
    "prepare_student",
    "sparsity_report",
    "strip_pruning",
    "strip_teacher_logits",
    "to_mixed_bfloat16",
    "write_report",
]
