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
guard, the step counter), `hbm` (`HBMMonitor`), `throughput`
(`ThroughputMonitor`) and `input_rate` (`measure_input_rate`). Every name that
`keras_tpu_mem.monitoring` offered as one module is importable from it still,
loaded from its module on first use (PEP 562): importing
`keras_tpu_mem.monitoring._layout` (as `keras-tpu-mem report` does) loads
neither Keras nor a framework.
"""

from __future__ import annotations

import importlib

# Name -> the submodule that defines it. The private names are re-exported for
# report.py and the tests, which import them from here as they did from the
# single module.
_EXPORTS = {
    **dict.fromkeys(("_check_fraction", "_check_int", "_check_log_dir",
                     "_check_optional_positive_int", "_MonitorBase", "_never_raise",
                     "_read_iterations", "_StepCounter"), "_base"),
    **dict.fromkeys(("SUMMARY_FILE", "TIMELINE_FILE", "MEMORY_SUBDIR", "THROUGHPUT_SUBDIR",
                     "SHARED_CPU_LABEL", "HOST_RSS_LABEL", "SOURCE_TAG", "UPPER_BOUND_MARK",
                     "format_table", "_fmt_bytes", "source_column"), "_layout"),
    **dict.fromkeys(("_last_attempt", "_RunFiles", "_tail_lines"), "_writer"),
    **dict.fromkeys(("HBMMonitor", "_GIB", "_PHASES", "_assign_capacity", "_Device",
                     "_DeviceStats", "_gpu_capacity", "_max", "_read", "_reset",
                     "_resolve_devices", "_resolve_jax_devices", "_short", "_tag",
                     "_tpu_capacity"), "hbm"),
    **dict.fromkeys(("InputRate", "_check_dataset", "_leading_dim", "input_verdict",
                     "measure_input_rate"), "input_rate"),
    "ThroughputMonitor": "throughput",
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
