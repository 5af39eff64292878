"""`keras-tpu-mem report LOGDIR`: charts and a table from the monitors' timelines.

`HBMMonitor` and `ThroughputMonitor` append JSON-lines timelines to
`LOGDIR/ktm_memory/timeline.jsonl` and `LOGDIR/ktm_throughput/timeline.jsonl`.
This package reads them (every run directory under LOGDIR that has one), and
writes, next to them:

* `ktm_memory/memory.png`: memory of every device over the training steps,
  the device capacity as a line, the peak marked, the first (compiling) step
  and the evaluation peaks drawn apart, epoch and resume boundaries;
* `ktm_throughput/throughput.png`: samples/s (or steps/s) and step time over
  the steps, the warm-up greyed, the mean, and the input pipeline's own rate;
* `ktm_report.png` in the run directory: memory and throughput on one page;

and returns a text summary table. matplotlib is imported only here, lazily,
and through its object API (no pyplot), so a report never changes the
plotting backend of the calling program.

The report only reads files: it imports neither Keras nor a framework
(TensorFlow, JAX), and reads the timelines of either backend alike. Peaks
recorded as upper bounds (`"peak_exact": false`, written where a device's
peak counter cannot be reset, as on JAX's TPU/GPU allocators) are shown as
`<= X`.

The package reads (`timeline`), sums up and writes the tables (`summary`),
draws (`charts`) and puts them together (`write`).
"""

from keras_tpu_mem.report.summary import summarize_memory, summarize_throughput
from keras_tpu_mem.report.timeline import (
    TrainingRun,
    find_runs,
    load_timeline,
    split_training_runs,
)
from keras_tpu_mem.report.write import Report, write_report

__all__ = ["Report", "TrainingRun", "find_runs", "load_timeline", "split_training_runs",
           "summarize_memory", "summarize_throughput", "write_report"]
