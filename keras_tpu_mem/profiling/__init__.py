"""Measure while you run: `ProfileWindow` (XProf capture) and `batch_size_sweep`.

* `ProfileWindow(log_dir, steps=(start, stop))` is a Keras callback that
  captures an XProf trace of training steps `start .. stop-1` into
  `log_dir/plugins/profile/<run>/`, which TensorBoard's Profile tab opens
  (`mode="local"`), or starts the profiler server so a TPU profile can be
  captured from TensorBoard's "Capture Profile" button (`mode="server"`).
  After a local capture it logs a short summary read with xprof's converters,
  without a server: the step time from the overview page and, for XLA-compiled
  steps, the memory viewer's peak heap. xprof is optional (the `[profile]`
  extra): the capture needs only the framework, and where no converter is
  found one notice names the extra that adds the summary. On the JAX backend
  the same files come from `jax.profiler.start_trace` / `stop_trace`, each
  traced execution marked with `jax.profiler.StepTraceAnnotation`, and
  `mode="server"` starts `jax.profiler.start_server(port)`; nothing of it
  imports TensorFlow.
* `batch_size_sweep(build_fn, dataset_fn, batch_sizes)` trains a few steps at
  each batch size and returns samples per second and the peak memory (the
  allocator's, or the process's resident memory where a CPU allocator keeps
  no statistics, each row naming its source), stopping at the first
  out-of-memory error; it can draw both against the batch size in a PNG.
  On JAX it takes arrays, a `keras.utils.PyDataset` or (where TensorFlow is
  installed) a `tf.data.Dataset`, and reads each device's `memory_stats()`
  (TPU, GPU) or the host RSS (JAX's CPU devices keep no statistics).

One module per job: `window` (the callback), `summary` (reading a capture
back), `sweep` (running the sweep) and `sweep_result` (its rows, table and
figure). What TensorFlow and JAX do differently (start and stop a capture,
mark a step, the server, the sweep's devices, inputs and out-of-memory error)
lives in `keras_tpu_mem/backends/<name>/profiler.py`.
"""

from keras_tpu_mem.profiling.summary import ProfileSummary, executed_xla_modules, summarize_profile
from keras_tpu_mem.profiling.sweep import batch_size_sweep
from keras_tpu_mem.profiling.sweep_result import SweepResult, SweepRow
from keras_tpu_mem.profiling.window import ProfileWindow

__all__ = [
    "ProfileSummary",
    "ProfileWindow",
    "SweepResult",
    "SweepRow",
    "batch_size_sweep",
    "executed_xla_modules",
    "summarize_profile",
]
