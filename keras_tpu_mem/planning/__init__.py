"""Know before you run: XLA's memory plan of the train step, `plan()` and its search.

The package (formerly one module, `keras_tpu_mem/planning.py`):

* `specs` – data specs for a batch and byte counts of variables;
* `compiled` – `compiled_memory`: compiles the train step (Keras' own, or the
  engine's step for the given feature callbacks) with XLA and reads its buffer
  assignment (TensorFlow: the `HloProto`; JAX: `memory_analysis()`);
* `budget` – `DeviceBudget`, precisions, the activation model;
* `planner` – `plan()`, `MemoryPlan`;
* `search` – the lever search behind `plan(..., search=True)`.

Every name importable from the old module is importable from here.
"""

# The private helpers of the former module are re-exported too, for code that
# reached into it: hence no F401 for them.
# ruff: noqa: F401
from keras_tpu_mem.planning.budget import (
    _BF16_NAMES,
    _DEVICE_SIZE_RE,
    _F32_NAMES,
    _UNITS,
    ActivationModel,
    DeviceBudget,
    _normalise_precision,
    model_precision,
    resolve_device,
)
from keras_tpu_mem.planning.compiled import (
    _CACHE,
    CompiledMemory,
    _buffer_stats,
    _build_for,
    _compile_step,
    _Compiler,
    _hlo_proto_class,
    _host_copy,
    _non_default_strategy,
    _platform,
    _state_key,
    compiled_memory,
)
from keras_tpu_mem.planning.oom import (
    StepOutOfMemoryError,
    explain_out_of_memory,
    is_resource_exhausted,
    set_oom_device,
)
from keras_tpu_mem.planning.planner import (
    _DEFAULT_COMPILE_BATCHES,
    _LINEARITY_TOLERANCE,
    _MAX_DIRECT_BATCH,
    _NOT_MODELLED,
    MemoryPlan,
    Recommendation,
    _bf16_estimate,
    _divisors,
    _largest_batch,
    _recommend,
    _validate_plan_args,
    load_model_factory,
    plan,
)
from keras_tpu_mem.planning.specs import (
    _check_model,
    _dtype_size,
    _is_sparse_loss,
    _label_spec,
    _map_specs,
    _spec_bytes,
    _spec_for,
    _symbolic,
    _unique,
    _variable_bytes,
    infer_data_specs,
)

__all__ = [
    "ActivationModel",
    "CompiledMemory",
    "DeviceBudget",
    "MemoryPlan",
    "Recommendation",
    "StepOutOfMemoryError",
    "compiled_memory",
    "infer_data_specs",
    "load_model_factory",
    "model_precision",
    "plan",
    "resolve_device",
    "set_oom_device",
]
