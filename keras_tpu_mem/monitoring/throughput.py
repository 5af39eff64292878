"""`ThroughputMonitor`: samples/s, step time and the first-step time of `fit`."""

from __future__ import annotations

import time

from keras_tpu_mem._utils import logger
from keras_tpu_mem.monitoring._base import (
    _check_int,
    _check_optional_positive_int,
    _MonitorBase,
    _never_raise,
    _StepCounter,
)
from keras_tpu_mem.monitoring._layout import THROUGHPUT_SUBDIR
from keras_tpu_mem.monitoring.input_rate import (
    _check_dataset,
    _dataset_batch_size,
    _dataset_kind,
    input_verdict,
    measure_input_rate,
)


# ========================================================== ThroughputMonitor
class ThroughputMonitor(_MonitorBase):
    """Logs samples/s, steps/s, step time and the first-step (compile) time of `fit`.

    Time is taken on the host around each execution Keras runs (one
    `on_train_batch_begin`/`on_train_batch_end` pair per `steps_per_execution`
    steps): an interval runs from the end of the previous execution (or the
    start of the epoch) to the end of this one, so it includes waiting for
    input and the callbacks' own time, and excludes validation and epoch-end
    work. Steps are counted per execution, the last, shorter execution of an
    epoch included.

    Samples per step (the global batch) come from, in order: `batch_size`; the
    static batch dimension of `dataset`; the static batch dimension of the
    data `fit` iterates, which the training engine reports before the first
    step (`keras_tpu_mem.engine.observe_first_batch`: per-replica parts
    summed; the monitor never touches `model.train_function`). A batch whose
    size is not static
    (`drop_remainder=False`, or arrays whose length is not a multiple of the
    batch) gives `None` there: pass `batch_size` then, or only steps/s and step
    time are logged.

    Logged keys (batch logs: per logged interval; epoch logs: over the epoch's
    steps after the first `warmup_steps` steps of the `fit`, NaN if none):
    `samples_per_sec`, `steps_per_sec`, `step_time_ms`; epoch logs also
    `first_step_s`, the wall time of the first execution of the `fit` (trace,
    XLA compilation and the first `steps_per_execution` steps).

    With `dataset`, at the end of training the input pipeline is timed alone
    (`measure_input_rate`) and compared with the training step rate; the
    result names the bottleneck (`"input"`, `"balanced"` or `"compute"`) and
    is logged, written to TensorBoard and kept in `self.summary`.

    Args:
        log_dir: Directory for TensorBoard events and the timeline; files go to
            `log_dir/ktm_throughput/`. `None` logs to `logs` and the console only.
        warmup_steps: Steps at the start of the `fit` left out of the epoch and
            run averages, >= 0 (the first execution, which compiles, is always
            reported separately as `first_step_s`).
        every_n_steps: Log an interval every this many training steps, >= 1.
        batch_size: Global batch size (samples per step), if it cannot be read
            from the data (needed with `dataset=` arrays).
        dataset: What `fit` trains on, to time the input pipeline at the end of
            training (`measure_input_rate`): the batched `tf.data.Dataset`
            (where TensorFlow is installed), whose static batch dimension also
            gives the batch size; a `keras.utils.PyDataset`; or in-memory
            arrays (a tuple or dict of arrays) together with `batch_size`.
        input_batches: Batches to time when measuring `dataset`, >= 1.

    On the JAX backend everything above holds as on TensorFlow: the global
    batch of a step under a `keras.distribution` is the whole batch `fit`
    hands the step (all devices together), as the JAX engine reports it to
    `observe_first_batch`. JAX batches are concrete arrays, so there the
    first batch's size is taken for every step: a shorter last batch (arrays
    whose length is no multiple of the batch; XLA compiles the step again for
    it) is counted as full. `TPUStrategyWrapper.distribute` (or
    `drop_remainder`) avoids it, as XLA on a TPU wants anyway.

    Example:

    ```python
    import keras
    import numpy as np
    import tensorflow as tf
    import keras_tpu_mem as ktm

    x, y = np.random.rand(2048, 64).astype("float32"), np.random.randint(0, 10, 2048)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(128, drop_remainder=True)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  steps_per_execution=4)
    history = model.fit(ds, epochs=2, verbose=0,
                        callbacks=[ktm.ThroughputMonitor("logs", dataset=ds)])
    print(history.history["samples_per_sec"])
    ```
    """

    _subdir = THROUGHPUT_SUBDIR

    def __init__(self, log_dir=None, *, warmup_steps=2, every_n_steps=1, batch_size=None,
                 dataset=None, input_batches=20):
        super().__init__(log_dir, every_n_steps)
        self.warmup_steps = _check_int(warmup_steps, "warmup_steps", 0)
        self.batch_size = _check_optional_positive_int(batch_size, "batch_size")
        self.dataset = _check_dataset(dataset)
        self._dataset_kind = _dataset_kind(dataset)
        if self._dataset_kind == "arrays" and self.batch_size is None:
            raise TypeError(
                "`dataset` holds in-memory arrays, which have no batches of their own: pass "
                "`batch_size=` too (the batch size given to fit), e.g. "
                "ThroughputMonitor(dataset=(x, y), batch_size=128).")
        self.input_batches = _check_int(input_batches, "input_batches", 1)
        self.summary: dict | None = None

    # ---------------------------------------------------------- batch size
    def _resolve_batch_size(self) -> None:
        self._batch = self.batch_size
        self._batch_source = "batch_size argument"
        if self._batch is None and self.dataset is not None:
            self._batch = _dataset_batch_size(self.dataset)
            self._batch_source = "dataset's static batch dimension"
        if self._batch is None:
            # The engine owns model.train_function; it calls back with the
            # global batch of the first step, before that step runs.
            from keras_tpu_mem.engine import observe_first_batch

            observe_first_batch(self.model, self._observed)
            self._batch_source = "the static batch dimension of the data fit iterates"

    def _observed(self, size):
        if self._batch is None and size:
            self._batch = int(size)

    # ---------------------------------------------------------------- hooks
    def on_train_begin(self, logs=None):
        self._disabled = False
        self._begin_train()

    @_never_raise
    def _begin_train(self):
        self._counter = _StepCounter(self.model, self.params)
        self._resolve_batch_size()
        self._open_files()
        self._first = True
        self._epoch = 0
        self._last_logged_step = None
        self._steps_in_fit = 0
        self.first_step_s = None
        self._exec_start = None
        self._fit = [0, 0.0]    # steps, seconds after warm-up
        self._epoch_acc = [0, 0.0]  # steps, seconds after warm-up, this epoch
        self._interval = [0, 0.0, False]  # steps, seconds, holds warm-up steps

    @_never_raise
    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = int(epoch)
        self._counter.epoch_begin()
        self._exec_start = time.perf_counter()
        self._epoch_acc = [0, 0.0]

    @_never_raise
    def on_train_batch_begin(self, batch, logs=None):
        if self._exec_start is None:  # a loop that skips on_epoch_begin
            self._exec_start = time.perf_counter()
        self._counter.batch_begin(batch)

    @_never_raise
    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        start = self._exec_start if self._exec_start is not None else now
        seconds = now - start
        self._exec_start = now
        prev = self._counter.current
        steps = self._counter.batch_end(batch)
        if not steps:  # a skipped call of a resumed fit: no step ran
            return
        warmup = self._steps_in_fit < self.warmup_steps
        self._steps_in_fit += steps
        if self._first:
            self.first_step_s = seconds
        if not warmup:
            self._fit[0] += steps
            self._fit[1] += seconds
            self._epoch_acc[0] += steps
            self._epoch_acc[1] += seconds
        interval = self._interval
        interval[0] += steps
        interval[1] += seconds
        interval[2] = interval[2] or warmup
        if self._should_log(self._first, prev, self._counter.current):
            self._log_interval(logs)

    def _log_interval(self, logs=None) -> None:
        """Writes the steps since the last record as one record; fills batch `logs`."""
        steps, seconds, has_warmup = self._interval
        self._interval = [0, 0.0, False]
        phase = "compile" if self._first else ("warmup" if has_warmup else "train")
        values = self._rates(steps, seconds)
        keys = ("samples_per_sec", "steps_per_sec", "step_time_ms")
        if self._files is not None:
            step = self._counter.current
            record = {"step": step, "time": time.time(), "phase": phase, "epoch": self._epoch,
                      "begin_step": self._counter.begin_step, "steps": steps,
                      "samples": values.get("samples"), "seconds": seconds}
            record.update({k: values.get(k) for k in keys})
            self._files.record(record)
            if self._first:
                self._files.scalars(step, {"throughput/first_step_s": seconds})
            else:
                self._files.scalars(step, {f"throughput/{k}": values.get(k) for k in keys})
            self._last_logged_step = step
        if logs is not None:
            logs.update({k: values[k] for k in keys if k in values})
        self._first = False

    def _rates(self, steps: int, seconds: float) -> dict:
        seconds = max(seconds, 1e-9)
        values = {"steps": steps, "seconds": seconds, "steps_per_sec": steps / seconds,
                  "step_time_ms": 1000.0 * seconds / steps if steps else float("nan")}
        if self._batch:
            values["samples"] = steps * self._batch
            values["samples_per_sec"] = steps * self._batch / seconds
        return values

    @_never_raise
    def on_epoch_end(self, epoch, logs=None):
        if self._interval[0]:
            self._log_interval()  # the epoch's last steps, short of every_n_steps
        if logs is None:
            return
        steps, seconds = self._epoch_acc
        nan = float("nan")
        if steps:
            values = self._rates(steps, seconds)
        else:
            values = {"steps_per_sec": nan, "step_time_ms": nan, "samples_per_sec": nan}
        keys = ["steps_per_sec", "step_time_ms"]
        if self._batch:
            keys.insert(0, "samples_per_sec")
        else:
            self._notice(
                "batch", "ThroughputMonitor: the global batch size is unknown: the data "
                "fit iterates has no static batch dimension (a last, smaller batch?). "
                "Logging steps/s and step time only; pass batch_size= to get samples/s.",
            )
        logs.update({k: values.get(k, nan) for k in keys})
        logs["first_step_s"] = self.first_step_s if self.first_step_s is not None else nan
        if self._files is not None:
            self._files.flush()

    @_never_raise
    def on_train_end(self, logs=None):
        from keras_tpu_mem.engine import Engine

        engine = Engine.of(self.model)
        if engine is not None:  # a fit that ran no step did not call it
            engine.unobserve(self._observed)
        steps, seconds = self._fit
        summary = {
            "batch_size": self._batch,
            "batch_size_source": self._batch_source if self._batch else None,
            "warmup_steps": self.warmup_steps,
            "first_step_s": self.first_step_s,
            "steps": steps,
            "seconds": seconds,
        }
        if steps:
            summary.update({k: v for k, v in self._rates(steps, seconds).items()
                            if k in ("samples", "samples_per_sec", "steps_per_sec",
                                     "step_time_ms")})
        lines = []
        if steps:
            rate = (f"{summary['samples_per_sec']:,.1f} samples/s, " if self._batch else "")
            lines.append(
                f"{rate}{summary['steps_per_sec']:,.2f} steps/s, "
                f"{summary['step_time_ms']:,.2f} ms/step over {steps} steps after "
                f"{self.warmup_steps} warm-up step(s)"
            )
        if self.first_step_s is not None:
            lines.append(f"first execution (trace + compile + steps): {self.first_step_s:.2f} s")
        if self.dataset is not None and steps:
            summary.update(self._measure_input(summary["steps_per_sec"]))
            if summary.get("input_verdict"):
                lines.append(summary["input_verdict"])
        elif steps:
            lines.append("input pipeline not measured (pass dataset= to compare its rate "
                         "with the step rate)")
        self.summary = summary
        if lines:
            logger.info("ThroughputMonitor: %s", "\n  ".join(lines))
        if self._files is not None:
            self._files.write_summary(summary)
        self._close_files()

    def _measure_input(self, steps_per_sec: float) -> dict:
        try:
            rate = measure_input_rate(
                self.dataset, batches=self.input_batches,
                batch_size=self.batch_size if self._dataset_kind == "arrays" else None)
        except Exception as err:
            self._notice("input", "ThroughputMonitor: could not time the input pipeline "
                         "(%s: %s).", type(err).__name__, err)
            return {}
        bottleneck, sentence = input_verdict(steps_per_sec, rate.batches_per_sec,
                                             kind=self._dataset_kind)
        result = {
            "input_batches_per_sec": rate.batches_per_sec,
            "input_samples_per_sec": rate.samples_per_sec,
            "input_batches_timed": rate.batches,
            "bottleneck": bottleneck,
            "input_verdict": sentence,
        }
        if self._files is not None:
            self._files.scalars(self._counter.current, {
                "throughput/input_batches_per_sec": rate.batches_per_sec,
                "throughput/input_samples_per_sec": rate.samples_per_sec,
            })
        return result
