"""`ThroughputMonitor` and `measure_input_rate` on the JAX backend (issue 16, item 4).

The global batch under a distribution, PyDatasets and in-memory arrays.
"""

from __future__ import annotations

import time

import keras
import monitoring_cases as cases
import pytest
from helpers import make_distribution, scope

from keras_tpu_mem import monitoring as mon


class _Batches(keras.utils.PyDataset):
    """A PyDataset of fixed batches; counts the batches read; may sleep per batch."""

    def __init__(self, x, y, batch, delay_s=0.0):
        super().__init__()
        self.x, self.y, self.batch, self.delay_s = x, y, batch, delay_s
        self.reads = 0

    def __len__(self):
        return len(self.x) // self.batch

    def __getitem__(self, i):
        self.reads += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        rows = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[rows], self.y[rows]


@pytest.mark.parametrize("case", ["none", "dp8"])
def test_throughput_counts_the_global_batch_from_the_engine(case, tmp_path, ktm_records):
    """steps_per_execution=4 over 9 batches: executions of 4, 4, 1 steps of the global batch."""
    x, y = cases.random_data(64 * 9)
    with scope(make_distribution(case)):
        model = cases.compile_model(cases.small_mlp(), steps_per_execution=4)
        speed = mon.ThroughputMonitor(tmp_path, warmup_steps=0)
        history = model.fit(x, y, batch_size=64, epochs=2, verbose=0,
                            callbacks=[mon.HBMMonitor(tmp_path), speed])
    cases.assert_no_crash(ktm_records)
    assert [r["step"] for r in cases.read_timeline(tmp_path, "ktm_memory")] == [4, 8, 9, 13, 17, 18]
    assert speed.summary["batch_size"] == 64  # the whole global batch, over 8 devices too
    assert "fit iterates" in speed.summary["batch_size_source"]
    throughput = cases.read_timeline(tmp_path, "ktm_throughput")
    assert [r["step"] for r in throughput] == [4, 8, 9, 13, 17, 18]
    assert [r["steps"] for r in throughput] == [4, 4, 1, 4, 4, 1]
    assert sum(r["samples"] for r in throughput) == 2 * 9 * 64
    assert history.history["first_step_s"][0] > 0
    assert all(v > 0 for v in history.history["samples_per_sec"])
    if cases.HAS_TENSORBOARD:
        tags = set(cases.event_accumulator(tmp_path / "ktm_throughput").Tags()["scalars"])
        assert {"throughput/samples_per_sec", "throughput/first_step_s"} <= tags


def test_throughput_with_a_pydataset_names_the_bottleneck(tmp_path, ktm_records):
    x, y = cases.random_data(8 * 12)
    slow = _Batches(x, y, 8, delay_s=0.03)  # 30 ms per batch feeding a tiny model
    model = cases.compile_model(cases.small_mlp(units=8))
    speed = mon.ThroughputMonitor(tmp_path, dataset=slow, warmup_steps=1, input_batches=6)
    model.fit(slow, epochs=1, verbose=0, callbacks=[speed])
    cases.assert_no_crash(ktm_records)
    assert speed.summary["batch_size"] == 8  # from the engine: a PyDataset has no static one
    assert speed.summary["bottleneck"] == "input", speed.summary
    assert "PyDataset(workers=" in speed.summary["input_verdict"]
    assert speed.summary["input_batches_timed"] == 6


def test_measure_input_rate_reads_pydatasets_and_arrays():
    x, y = cases.random_data(4 * 10)
    batches = _Batches(x, y, 4, delay_s=0.01)
    rate = mon.measure_input_rate(batches, batches=5, warmup_batches=1)
    assert rate.batches == 5 and rate.batch_size == 4 and batches.reads == 6
    assert rate.batches_per_sec < 100  # each batch sleeps 10 ms: it cannot be faster
    assert rate.samples_per_sec == pytest.approx(4 * rate.batches_per_sec)

    # Arrays: consecutive slices of batch_size rows, the last one shorter (40 = 3 x 12 + 4).
    rate = mon.measure_input_rate((x, {"y": y}), batch_size=12, batches=10, warmup_batches=0)
    assert rate.batches == 4 and rate.batch_size == pytest.approx(40 / 4)
    with pytest.raises(TypeError, match="batch_size"):
        mon.measure_input_rate(x)
    with pytest.raises(ValueError, match="arrays only"):
        mon.measure_input_rate(batches, batch_size=4)
    with pytest.raises(TypeError, match="dataset"):
        mon.measure_input_rate([1, 2, 3], batch_size=1)


def test_throughput_monitor_arguments_on_jax():
    x, y = cases.random_data(64)
    with pytest.raises(TypeError, match="batch_size="):
        mon.ThroughputMonitor(dataset=(x, y))
    with pytest.raises(TypeError, match="PyDataset"):
        mon.ThroughputMonitor(dataset=iter([x]))
    assert mon.ThroughputMonitor(dataset=(x, y), batch_size=16).dataset is not None
