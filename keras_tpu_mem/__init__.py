"""keras-tpu-mem: fit bigger models into TPU memory with ordinary Keras 3 callbacks.

Public names are flat: `import keras_tpu_mem as ktm; ktm.TPUStrategyWrapper()`.
The package does not choose a Keras backend; its features run on Keras'
TensorFlow and JAX backends (`keras_tpu_mem.backends` holds what differs) and say
so when another is active.

Importing the package loads none of its modules: each public name is loaded from its
module on first use (PEP 562). That keeps `keras-tpu-mem --help` free of
TensorFlow's start-up cost and log lines, and lets the framework-free parts
(`HBM_TABLE`, `lookup_tpu`, the command line) work with any Keras backend or
none installed.
"""

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0.dev0"

# Public name -> the submodule that defines it. The one table both `__getattr__`
# and `__all__` read, so a name cannot be exported without a home.
_EXPORTS = {
    "GradientAccumulation": "accumulation",
    "AcceleratorSpec": "devices",
    "HBM_TABLE": "devices",
    "MemoryReading": "devices",
    "lookup_tpu": "devices",
    "Distillation": "distillation",
    "cache_teacher_logits": "distillation",
    "distillation_kl": "distillation",
    "load_teacher_logits": "distillation",
    "prepare_student": "distillation",
    "strip_teacher_logits": "distillation",
    "TeacherLogits": "distillation",
    "HBMMonitor": "monitoring",
    "InputRate": "monitoring",
    "ThroughputMonitor": "monitoring",
    "measure_input_rate": "monitoring",
    "CompiledMemory": "planning",
    "LayerMemory": "planning",
    "LayerTable": "planning",
    "MemoryPlan": "planning",
    "compiled_memory": "planning",
    "plan": "planning",
    "Recommendation": "planning",
    "SearchNote": "planning",
    "StepOutOfMemoryError": "planning",
    "Rematerialize": "remat",
    "CheckpointInfo": "resume.store",
    "ResumableCheckpoint": "resume.callback",
    "list_checkpoints": "resume.store",
    "MixedBFloat16": "precision",
    "PrecisionReport": "precision",
    "PrecisionRow": "precision",
    "device_notice": "precision",
    "enable_mixed_bfloat16": "precision",
    "precision_report": "precision",
    "to_mixed_bfloat16": "precision",
    "ProfileSummary": "profiling",
    "ProfileWindow": "profiling",
    "SweepResult": "profiling",
    "batch_size_sweep": "profiling",
    "ConstantSparsity": "pruning",
    "PolynomialDecay": "pruning",
    "Pruning": "pruning",
    "PruningSchedule": "pruning",
    "SparsityReport": "pruning",
    "sparsity_report": "pruning",
    "strip_pruning": "pruning",
    "write_report": "report",
    "is_shapes_only": "shapes",
    "materialize": "shapes",
    "reading_shapes": "shapes",
    "shapes_only": "shapes",
    "KNOWN_SLICES": "devices.tpu_slices",
    "TPUSlice": "devices.tpu_slices",
    "tpu_slice": "devices.tpu_slices",
    "ShardedDataParallel": "sharding",
    "reshard": "sharding",
    "sharded_dim": "sharding",
    "state_bytes_per_device": "sharding",
    "TPUStrategyWrapper": "strategy",
    "observe_first_batch": "engine",
}

__all__ = sorted(_EXPORTS)

#: Modules that train through the engine. Loading one also loads the planner's
#: out-of-memory explainer, which registers itself with the engine
#: (`engine.register_error_explainer`): the engine never imports the planner, so
#: that a failed step's `StepOutOfMemoryError` (the compiled breakdown and the
#: smallest change that fits) needs no import cycle. The engine also loads it
#: by name when a step fails (`engine.core._EXPLAINER_MODULES`), for features
#: imported from their own modules rather than through this facade.
_TRAINS = frozenset({"accumulation", "distillation", "engine", "monitoring", "precision",
                     "profiling", "pruning", "remat", "sharding", "strategy"})

_NEEDS_TENSORFLOW = (
    "{what} needs TensorFlow, which is not installed. Install it with "
    "`pip install keras-tpu-mem[tensorflow]` (or [cpu] for tensorflow-cpu); on a TPU VM "
    "install `tensorflow-tpu` as Google's TPU guide says."
)


def _load(module_name: str, what: str):
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
        if module_name in _TRAINS:
            importlib.import_module(f"{__name__}.planning.oom")
        return module
    except ModuleNotFoundError as err:
        # The eager `import tensorflow` this package used to do gave this hint at
        # import time; now the module that needs TensorFlow gives it, naming
        # what was asked for.
        if (err.name or "").split(".")[0] == "tensorflow":
            raise ImportError(_NEEDS_TENSORFLOW.format(what=what)) from err
        raise


def __getattr__(name: str):
    module_name = _EXPORTS.get(name)
    if module_name is not None:
        value = getattr(_load(module_name, f"keras_tpu_mem.{name}"), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    # Submodules (`ktm.planning`, `ktm.engine`, ...) were attributes of the
    # package when it imported them eagerly; keep that working.
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return _load(name, f"keras_tpu_mem.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
