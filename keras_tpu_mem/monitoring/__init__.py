"""Live memory and throughput monitoring inside `model.fit`.

Two callbacks, one concern each:

* `HBMMonitor` reads the allocator's current and peak bytes of every replica
  device (`tf.config.experimental.get_memory_info`), keeps the first-step
  (compile), training and evaluation peaks apart, warns once when the headroom
  to the device's capacity gets small, and prints a per-device table at the end.
  Where a CPU allocator keeps no statistics (oneDNN off) it reads the
  process's resident memory instead and names that source everywhere.
* `ThroughputMonitor` measures samples/s, steps/s, step time and the time of the
  first (compiling) execution, counts `steps_per_execution` correctly, and, given
  the training dataset, measures the input pipeline alone and names the
  bottleneck (`measure_input_rate` is the same measurement as a function).

Both put their numbers into the batch and epoch `logs` (so they show in the
progress bar and in `History`), write TensorBoard scalars to their own run
directory under `log_dir` (`ktm_memory/`, `ktm_throughput/`, beside the
`train/` and `validation/` runs of Keras' `TensorBoard` callback), and append a
JSON-lines timeline there (`timeline.jsonl`) that `keras-tpu-mem report` draws.

Neither callback can break a run: where memory cannot be read, or anything
unexpected happens inside a callback, it says so once and training goes on.
Neither writes `model.train_function`: the batch size of the data `fit`
iterates comes from the engine (`keras_tpu_mem.engine.observe_first_batch`).

Both work on the TensorFlow and the JAX backend; what each reads where is in
`HBMMonitor`'s docstring and docs/monitoring.md ("On the JAX backend").

One job per module: `_layout` (file names, labels and the table format, shared
with the report; imports no framework), `_writer` (the run directory's files,
written from a background thread), `_base` (argument checks, the never-break
guard, the step counter), `_allocators` (which allocators `HBMMonitor` reads,
through `keras_tpu_mem.devices`, and their peak intervals), `_hbm_summary` (its
peaks per phase, summary and table), `hbm` (`HBMMonitor`), `throughput`
(`ThroughputMonitor`) and `input_rate` (`measure_input_rate`). The public names
are importable from this package, loaded from their module on first use (PEP
562): importing `keras_tpu_mem.monitoring._layout` (as `keras-tpu-mem report`
does) loads neither Keras nor a framework. `hbm`, `_allocators` and `throughput`
import no framework and test no backend: the backend's part is in
`keras_tpu_mem.devices` and `backends`.
"""

from __future__ import annotations

import importlib

# Name -> the submodule that defines it.
_EXPORTS = {
    "HBMMonitor": "hbm",
    "ThroughputMonitor": "throughput",
    **dict.fromkeys(("InputRate", "input_verdict", "measure_input_rate"), "input_rate"),
}

__all__ = ["HBMMonitor", "InputRate", "ThroughputMonitor", "measure_input_rate"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
