"""Know before you run: XLA's memory plan of the train step, `plan()` and its search.

The package (formerly one module, `keras_tpu_mem/planning.py`):

* `specs` – data specs for a batch and byte counts of variables;
* `memory` – `CompiledMemory`, XLA's buffer assignment of one compiled step;
* `by_layer` – `LayerTable`, that memory by Keras layer (`CompiledMemory.by_layer()`);
* `compiled` – `compiled_memory` and the `Compiler` behind it: compiles the
  train step (Keras' own, or the engine's step for the given feature
  callbacks) through the backend seam (`backends.current().compiled`:
  TensorFlow reads the `HloProto`, JAX `memory_analysis()`);
* `budget` – `DeviceBudget`, precisions, the activation model, what fits;
* `memory_plan` – `MemoryPlan` and `Recommendation`, what a plan says;
* `planner` – `plan()` and its estimate;
* `search` – the plan on compiles and the lever search (`plan(..., search=True)`);
* `oom` – the explanation of an out-of-memory step, registered with the engine;
* `model_factory` – the model of `keras-tpu-mem plan --model MODULE:FUNCTION`.
"""

from keras_tpu_mem.planning.budget import DeviceBudget
from keras_tpu_mem.planning.by_layer import LayerMemory, LayerTable
from keras_tpu_mem.planning.compiled import compiled_memory
from keras_tpu_mem.planning.memory import CompiledMemory
from keras_tpu_mem.planning.memory_plan import MemoryPlan, Recommendation, SearchNote
from keras_tpu_mem.planning.oom import StepOutOfMemoryError, set_oom_device
from keras_tpu_mem.planning.planner import plan

__all__ = [
    "CompiledMemory",
    "DeviceBudget",
    "LayerMemory",
    "LayerTable",
    "MemoryPlan",
    "Recommendation",
    "SearchNote",
    "StepOutOfMemoryError",
    "compiled_memory",
    "plan",
    "set_oom_device",
]
