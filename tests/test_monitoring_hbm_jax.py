"""`HBMMonitor` on the JAX backend (issue 16, item 4).

The harness gives 8 host CPU devices. JAX's CPU devices keep no memory
statistics (`jax.Device.memory_stats()` is None), so on this machine the
monitor reads the host RSS, named as such; the TPU/GPU path (each device's own
`memory_stats()`, a peak that cannot be reset) is exercised with a stand-in
reader that reports per-device statistics on a known schedule. Nothing here
had a real accelerator.
"""

from __future__ import annotations

import keras
import monitoring_cases as cases
import pytest
from helpers import make_distribution, scope

from keras_tpu_mem import backends, devices
from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.monitoring import _allocators as allocators


@pytest.mark.parametrize("case", ["dp8", "mp2x4", "fsdp8"])
def test_host_devices_of_a_distribution_share_one_process_entry(case, tmp_path, ktm_records):
    distribution = make_distribution(case)
    x, y = cases.random_data(512)
    with scope(distribution):
        model = cases.compile_model(cases.small_mlp())
        hbm = mon.HBMMonitor(tmp_path)
        history = model.fit(x, y, batch_size=64, epochs=2, verbose=0,
                            validation_data=(x[:128], y[:128]), callbacks=[hbm])
    cases.assert_no_crash(ktm_records)
    assert len(history.history["hbm_peak_gib"]) == 2 and min(history.history["hbm_peak_gib"]) > 0
    memory = cases.read_timeline(tmp_path, "ktm_memory")
    assert [r["step"] for r in memory if r["phase"] != "eval"] == list(range(1, 17))
    for record in memory:
        (label,) = record["devices"]
        assert label == "CPU (process RSS)"
        # All 8 host devices of the mesh are listed; they share the host's memory.
        assert record["devices"][label]["replicas"] == cases.mesh_names(distribution)
    assert hbm.memory_sources == {"CPU (process RSS)": "host_rss"}


class _FakeAllocator:
    """Per-device `memory_stats()` on a known schedule, as a TPU/GPU runtime reports them.

    Device `i` holds `base + i MiB` between steps. Its high-water mark (since
    the "process" started, never reset, like JAX's) rises to `first + i MiB`
    during the first step and to `leak + i MiB` at global step `leak_step`; it
    never rises in validation. `bytes_limit` is the capacity.
    """

    MIB = 2**20

    def __init__(self, leak_step):
        self.base, self.first, self.leak = 100 * self.MIB, 300 * self.MIB, 500 * self.MIB
        self.limit = 16 * devices.GIB
        self.leak_step = leak_step
        self.step = 0
        self.peaks: dict[int, int] = {}

    def stats(self, device):
        i = int(device.id)
        self.peaks.setdefault(i, self.base + i * self.MIB)
        return {"bytes_in_use": self.base + i * self.MIB, "peak_bytes_in_use": self.peaks[i],
                "bytes_limit": self.limit}

    def advance(self):  # a training step ran
        self.step += 1
        target = (self.first if self.step < self.leak_step else self.leak)
        for i in range(8):
            self.peaks[i] = max(self.peaks.get(i, 0), target + i * self.MIB)


class _Steps(keras.callbacks.Callback):
    """Placed before the monitor: the fake device "runs" each step first."""

    def __init__(self, fake):
        super().__init__()
        self.fake = fake

    def on_train_batch_end(self, batch, logs=None):
        self.fake.advance()


@pytest.mark.parametrize("case", ["dp8", "mp2x4"])
def test_each_accelerator_device_is_read_on_its_own(case, tmp_path, monkeypatch, ktm_records):
    """Per-device entries, capacity from bytes_limit, phases told apart by the mark."""
    steps_per_epoch = 8
    fake = _FakeAllocator(leak_step=steps_per_epoch + 3)  # rises again in epoch 2
    monkeypatch.setattr(backends.get("jax").devices, "memory_stats", fake.stats)
    distribution = make_distribution(case)
    x, y = cases.random_data(64 * steps_per_epoch)
    with scope(distribution):
        model = cases.compile_model(cases.small_mlp())
        hbm = mon.HBMMonitor(tmp_path, warn_headroom=0.0)
        history = model.fit(x, y, batch_size=64, epochs=2, verbose=0,
                            validation_data=(x[:128], y[:128]), callbacks=[_Steps(fake), hbm])
    cases.assert_no_crash(ktm_records)
    names = cases.mesh_names(distribution)
    assert list(hbm.memory_sources) == names
    assert set(hbm.memory_sources.values()) == {"allocator"}

    # Worst device (CPU:7) in the logs; capacity from bytes_limit.
    mib = _FakeAllocator.MIB
    worst_first, worst_leak = fake.first + 7 * mib, fake.leak + 7 * mib
    assert history.history["hbm_peak_gib"] == pytest.approx(
        [worst_first / devices.GIB, worst_leak / devices.GIB])
    assert history.history["hbm_utilization"][1] == pytest.approx(worst_leak / fake.limit)

    memory = cases.read_timeline(tmp_path, "ktm_memory")
    train = [r for r in memory if r["phase"] != "eval"]
    assert [r["step"] for r in train] == list(range(1, 2 * steps_per_epoch + 1))
    for record in memory:
        assert sorted(record["devices"], key=lambda n: int(n.split(":")[1])) == names
        for label, reading in record["devices"].items():
            i = int(label.split(":")[1])
            assert reading["current_bytes"] == fake.base + i * mib
            assert reading["capacity_bytes"] == fake.limit
            assert reading["source"] == "allocator" and reading["replicas"] == [label]
            assert reading["shared"] is False and reading["process_wide"] is False
    # The mark: a record's peak (the peak so far in its epoch's phase) is exact from
    # the step that raised the device's high-water mark to the phase's end.
    exact_steps = {r["step"] for r in train if r["devices"]["CPU:0"]["peak_exact"]}
    assert exact_steps == {1, *range(steps_per_epoch + 3, 2 * steps_per_epoch + 1)}
    assert not any(r["devices"]["CPU:0"]["peak_exact"] for r in memory if r["phase"] == "eval")

    info = hbm.summary["devices"]["CPU:3"]
    assert info["compile_peak_bytes"] == fake.first + 3 * mib
    assert info["train_peak_bytes"] == fake.leak + 3 * mib
    assert info["peak_exact"] == {"compile": True, "train": True, "eval": False}
    assert info["capacity_bytes"] == fake.limit and info["peak_step"] == steps_per_epoch + 3
    assert "bytes_limit" in hbm.summary["capacity_source"]
    assert "cannot be reset" in hbm.summary["allocator_peak"]
    (table,) = cases.log_messages(ktm_records, "peak memory per device")
    assert "CPU:7" in table and "<= " in table  # evaluation stayed below the mark
    notices = cases.log_messages(ktm_records, "HBMMonitor: the peak counter of")
    assert len(notices) == 1 and "jax.Device.memory_stats()" in notices[0]
    assert ", ".join(names) in notices[0]
    assert len(cases.log_messages(ktm_records, "<- allocator (jax.Device.memory_stats())")) == 1
    if cases.HAS_TENSORBOARD:
        tags = set(cases.event_accumulator(tmp_path / "ktm_memory").Tags()["scalars"])
        assert {f"hbm/{n.replace(':', '_')}/peak_gib" for n in names} <= tags
        assert "hbm/CPU_7/utilization" in tags and "hbm_eval/CPU_0/peak_gib" in tags


def test_a_tpu_without_statistics_is_unreadable_not_host_rss(monkeypatch, ktm_records):
    """Host RSS never stands in for accelerator memory."""

    class Tpu:
        platform, id, device_kind, process_index = "tpu", 0, "TPU v4", 0

        def memory_stats(self):
            return None

    (device,) = allocators.resolve_devices([Tpu()])
    assert device.label == "TPU:0" and not device.shared
    assert devices.memory_source(Tpu()) is None
    assert devices.capacity(Tpu()) == (32 * devices.GIB, "TPU v4 per replica (ktm.HBM_TABLE)")
    reading = devices.read_memory_reading(Tpu())
    assert reading.device == "TPU:0" and reading.source is None and not reading.readable


def test_standalone_evaluate_logs_one_eval_record(tmp_path, ktm_records):
    x, y = cases.random_data(256)
    model = cases.compile_model(cases.small_mlp())
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=64, verbose=0, callbacks=[mon.HBMMonitor(tmp_path)])
    (record,) = cases.read_timeline(tmp_path, "ktm_memory")
    assert record["phase"] == "eval" and record["step"] == 4
    assert record["devices"]["CPU (process RSS)"]["peak_bytes"] > 0
    assert cases.log_messages(ktm_records, "HBMMonitor (evaluate)")
    cases.assert_no_crash(ktm_records)
