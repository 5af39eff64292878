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

One job per module: `_writer` (the run directory's files, written from a
background thread), `_base` (argument checks, the never-break guard, the step
counter), `hbm` (`HBMMonitor`), `throughput` (`ThroughputMonitor`) and
`input_rate` (`measure_input_rate`). Every name that `keras_tpu_mem.monitoring`
offered as one module is importable from it still.
"""

from __future__ import annotations

from keras_tpu_mem.monitoring._base import (
    _check_fraction,
    _check_int,
    _check_log_dir,
    _check_optional_positive_int,
    _MonitorBase,
    _never_raise,
    _read_iterations,
    _StepCounter,
    format_table,
)
from keras_tpu_mem.monitoring._writer import (
    SUMMARY_FILE,
    TIMELINE_FILE,
    _last_attempt,
    _RunFiles,
    _tail_lines,
)
from keras_tpu_mem.monitoring.hbm import (
    _GIB,
    _PHASES,
    HOST_RSS_LABEL,
    MEMORY_SUBDIR,
    SHARED_CPU_LABEL,
    SOURCE_TAG,
    HBMMonitor,
    _assign_capacity,
    _Device,
    _DeviceStats,
    _fmt_bytes,
    _gpu_capacity,
    _max,
    _read,
    _reset,
    _resolve_devices,
    _short,
    _tag,
    _tpu_capacity,
    source_column,
)
from keras_tpu_mem.monitoring.input_rate import (
    InputRate,
    _check_dataset,
    _leading_dim,
    input_verdict,
    measure_input_rate,
)
from keras_tpu_mem.monitoring.throughput import THROUGHPUT_SUBDIR, ThroughputMonitor

__all__ = ["HBMMonitor", "InputRate", "ThroughputMonitor", "measure_input_rate"]

# The private names above are re-exported for report.py and the tests, which
# import them from here as they did from the single module.
_REEXPORTED = (
    _check_fraction, _check_int, _check_log_dir, _check_optional_positive_int, _MonitorBase,
    _never_raise, _read_iterations, _StepCounter, format_table, SUMMARY_FILE, TIMELINE_FILE,
    _last_attempt, _RunFiles, _tail_lines, _GIB, _PHASES, HOST_RSS_LABEL, MEMORY_SUBDIR,
    SHARED_CPU_LABEL, SOURCE_TAG, _assign_capacity, _Device, _DeviceStats, _fmt_bytes,
    _gpu_capacity, _max, _read, _reset, _resolve_devices, _short, _tag, _tpu_capacity,
    source_column, _check_dataset, _leading_dim, input_verdict, THROUGHPUT_SUBDIR,
)
