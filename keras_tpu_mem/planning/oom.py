"""Explaining an out-of-memory error of the engine's step (issue 16, item 3).

When the step the engine installed fails with RESOURCE_EXHAUSTED (TensorFlow's
`tf.errors.ResourceExhaustedError`; JAX's `JaxRuntimeError` / `XlaRuntimeError`
whose message starts with RESOURCE_EXHAUSTED: each backend's
`backends/<name>/compiled.py` says which), `Engine.explain` asks the explainer
this module registers with the engine (`explain_if_out_of_memory`, so that the
engine never imports the planner) for a clearer error, which the engine raises
chained to the original. It holds:

* XLA's compiled breakdown of **this** step (the same features) at the batch
  that failed: weights, optimizer slots, gradient accumulators, activations
  (per sample), input batch, total against the device's capacity;
* the five largest rows of that step's memory by Keras layer at XLA's peak
  (`CompiledMemory.by_layer()`; a line saying so where it cannot be computed);
* the smallest change that fits, from `plan(..., search=True)`: each candidate
  compiled, cheapest first, and the callbacks that realise it.

The compiles run after the failed step, on symbolic inputs, with the fit's
features taken off the model for their duration (see `Engine.explain`): no
variable changes. The capacity comes from, first, `set_oom_device(...)`; then
the error's own "Used X of Y hbm" (XLA's TPU message); then on JAX the
device's `memory_stats()['bytes_limit']` or the TPU table. Where none says it
(CPU), the explanation gives the breakdown and says how to set it.
"""

from __future__ import annotations

import re

from keras_tpu_mem import backends, devices, engine
from keras_tpu_mem._utils import logger
from keras_tpu_mem.backends.step import batches_per_update
from keras_tpu_mem.planning.budget import DeviceBudget, resolve_device
from keras_tpu_mem.planning.by_layer_text import failing_lines
from keras_tpu_mem.planning.memory_plan import candidates_table
from keras_tpu_mem.planning.planner import plan
from keras_tpu_mem.planning.search import _LEVER_NAMES

_DEVICE = None
_USED_OF = re.compile(r"Used\s+([\d.]+)([KMGT])?\s+of\s+([\d.]+)([KMGT])?\s+hbm", re.IGNORECASE)
_UNIT = {None: 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


class StepOutOfMemoryError(RuntimeError):
    """The engine's step ran out of device memory; the message says why and what fits.

    Attributes:
        plan: The `MemoryPlan` of the failed configuration (with the search's
            candidates), or None where the analysis could not be made.
        global_batch_size: The global batch of the failed step (None: unknown).
    """

    def __init__(self, message, plan=None, global_batch_size=None):
        super().__init__(message)
        self.plan = plan
        self.global_batch_size = global_batch_size


def set_oom_device(device) -> None:
    """Sets the capacity the OOM explanation plans against (None: detect).

    Args:
        device: What `plan(device=...)` takes: a TPU type (`"v5litepod-8"`), a
            size (`"16GiB"`, `"16GB-4"`), a `DeviceBudget`, or None.

    Example:

    ```python
    ktm.planning.set_oom_device("v5litepod-8")
    model.fit(...)   # an OOM of the engine's step now names the smallest fix for v5e
    ```
    """
    global _DEVICE
    if device is not None:
        resolve_device(device)  # a bad value is an error here, not during a failing fit
    _DEVICE = device


def is_resource_exhausted(error) -> bool:
    """Whether `error` is an out-of-memory error of a compiled step on the running backend
    (`backends.current().compiled.is_out_of_memory`)."""
    return backends.current().compiled.is_out_of_memory(error)


def _capacity(error, replicas):
    """A `DeviceBudget` for the explanation, or None where nothing says the capacity."""
    if _DEVICE is not None:
        budget = resolve_device(_DEVICE)
        return DeviceBudget(budget.name, budget.capacity_bytes, replicas, budget.source)
    match = _USED_OF.search(str(error))
    if match:
        capacity = int(float(match.group(3)) * _UNIT[match.group(4) and match.group(4).upper()])
        return DeviceBudget("the failing device", capacity, replicas,
                            "the error's 'Used ... of ... hbm'")
    # Where the runtime reports the device's limit (JAX: `memory_stats()`), or
    # the TPU table names it.
    device = backends.current().compiled.capacity_device()
    if device is not None:
        capacity, source = devices.jax_capacity(device)
        if capacity:
            return DeviceBudget("the device", int(capacity), replicas, source)
    return None


def explain_out_of_memory(model, features, global_batch_size, error,
                          headroom: float = 0.10) -> StepOutOfMemoryError:
    """The clearer error for an OOM of the engine's step (see the module docstring).

    Args:
        model: The model whose step failed.
        features: The engine features of that step.
        global_batch_size: The global batch of the failed step, or None.
        error: The original error.
        headroom: Fraction of capacity the recommendation keeps free.
    """
    fb = devices.format_bytes
    names = ", ".join(type(f).__name__ for f in features) or "none"
    head = (f"The training step ran out of device memory (RESOURCE_EXHAUSTED) at global "
            f"batch {global_batch_size} with keras_tpu_mem features: {names}.")
    if global_batch_size is None:
        return StepOutOfMemoryError(
            head + " The batch size of the step is unknown (not static), so no compiled "
            "breakdown: run ktm.plan(model, global_batch_size, device=..., "
            "callbacks=[...], search=True) for it.")
    compiled = backends.current().compiled
    replicas = compiled.replicas(model)
    budget = _capacity(error, replicas)
    known = budget is not None
    # Micro-batches the dataset yields are split by the dataset: the search's levers,
    # which split a global batch, do not apply (`plan` refuses them).
    pulled = batches_per_update(features) > 1
    searched = known and not pulled
    if budget is None:
        budget = DeviceBudget("unknown", 0, replicas, "unknown")
    try:
        memory = plan(model, global_batch_size, device=budget, callbacks=list(features),
                      search=searched, headroom=headroom if known else 0.0)
    except Exception as err:  # the analysis must not hide the OOM itself
        logger.debug("OOM explanation failed", exc_info=True)
        return StepOutOfMemoryError(
            head + f" The compiled breakdown could not be made ({type(err).__name__}: "
            f"{err}); the original error follows.", None, global_batch_size)
    per = compiled.unit()  # what one compile's bytes are of: "replica", or "device" (JAX)
    lines = [head,
             f"XLA's compile of this step, per {per} (per-{per} batch "
             f"{memory.per_replica_batch}):",
             f"  weights {fb(memory.weight_bytes)}, optimizer slots "
             f"{fb(memory.optimizer_bytes)}, gradient accumulators "
             f"{fb(memory.accumulator_bytes)}, activations+workspace "
             f"{fb(memory.activation_bytes)} ({fb(memory.activations_per_sample)}/sample), "
             f"input {fb(memory.data_bytes)}, other {fb(memory.other_bytes)}",
             f"  compiled total {fb(memory.total_bytes)} vs capacity "
             + (f"{fb(budget.capacity_bytes)} ({budget.source})" if known else
                "unknown (set it with ktm.planning.set_oom_device('v5litepod-8' or "
                "'16GiB') for a recommendation)")]
    lines.extend(failing_lines(model, features, memory, compiled.unit()))
    rec = memory.recommendation
    if searched and rec is not None:
        lines.append(f"Smallest change that fits ({headroom:.0%} headroom): {rec.describe()}, "
                     f"{fb(rec.total_bytes)} compiled. Pass callbacks="
                     f"{_callbacks_repr(rec, features)} to fit "
                     "(ktm.plan(..., search=True).recommendation.callbacks()).")
        if rec.sharding is not None:
            lines.append(f"It splits the model state over the data-parallel devices "
                         f"(shard={rec.sharding!r}): ktm.reshard(model, "
                         "error.plan.recommendation.distribution()) moves it in place; "
                         "then fit in that distribution's scope.")
        if memory.candidates:
            lines.append(candidates_table(memory.candidates, memory.usable_bytes))
    elif searched:
        lines.append("No candidate of the search fits: a smaller global batch, more "
                     "replicas or a larger device.")
    elif known and pulled:
        lines.append("Nothing smaller was searched for: the dataset yields the micro-batches "
                     "(GradientAccumulation(dataset_yields='micro_batches')). Yield smaller "
                     "ones with more of them per update, or plan GradientAccumulation(k) on "
                     "global batches with ktm.plan(..., search=True).")
    return StepOutOfMemoryError("\n".join(line for line in lines if line), memory,
                                global_batch_size)


def _callbacks_repr(rec, features) -> str:
    kept = [type(f).__name__ + "(...)" for f in features if f.name not in _LEVER_NAMES]
    levers = []
    if rec.accumulation_steps > 1:
        levers.append(f"GradientAccumulation({rec.accumulation_steps})")
    if rec.bf16:
        levers.append("MixedBFloat16()")
    if rec.rematerialize:
        levers.append("Rematerialize()" if rec.remat_layers is None else
                      f"Rematerialize(layers={list(rec.remat_layers)!r})")
    return "[" + ", ".join([*kept, *levers]) + "]"


def explain_if_out_of_memory(model, features, global_batch_size, error):
    """The engine's error explainer: `explain_out_of_memory` for RESOURCE_EXHAUSTED, else None.

    Registered with the engine when this module is imported, so the engine
    explains an out-of-memory step without importing the planner.
    """
    if not is_resource_exhausted(error):
        return None
    return explain_out_of_memory(model, features, global_batch_size, error)


# The engine asks its registered explainers after the features' own; the package
# facade loads this module with any training feature, and the engine loads it by
# name when a step fails (`engine.core._EXPLAINER_MODULES`), so a failed fit's
# RESOURCE_EXHAUSTED is explained without the engine importing the planner.
engine.register_error_explainer(explain_if_out_of_memory)
