"""`HBMMonitor` on TensorFlow (keras_tpu_mem/monitoring/hbm.py, _allocators.py, _hbm_summary.py).

Memory on CPU is the host allocator's current/peak bytes, which TensorFlow
reports while oneDNN is on (conftest forces it on); it counts only allocations
of 256 KiB and more, so the models here have layers of >= 1024 units at batch
>= 128. The host-RSS fallback (oneDNN off, as on AMD/AVX2 CPUs) is tested, on both
backends, in test_monitoring_host_rss.py.
"""

from __future__ import annotations

import monitoring_cases as cases
import numpy as np
import pytest
import tensorflow as tf

from keras_tpu_mem import devices
from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.monitoring import _allocators as allocators


@pytest.mark.parametrize("kwargs, error, text", [
    ({"every_n_steps": 0}, ValueError, "every_n_steps"),
    ({"every_n_steps": 1.5}, TypeError, "every_n_steps"),
    ({"every_n_steps": True}, TypeError, "every_n_steps"),
    ({"warn_headroom": 1.0}, ValueError, "[0, 1)"),
    ({"warn_headroom": -0.1}, ValueError, "warn_headroom"),
    ({"warn_headroom": "10%"}, TypeError, "warn_headroom"),
    ({"capacity_bytes": 0}, ValueError, "capacity_bytes"),
    ({"capacity_bytes": -5}, ValueError, "capacity_bytes"),
    ({"capacity_bytes": "16GB"}, TypeError, "capacity_bytes"),
    ({"capacity_bytes": 1.5e9}, TypeError, "capacity_bytes"),
    ({"log_dir": 3}, TypeError, "log_dir"),
])
def test_hbm_monitor_rejects_bad_arguments(kwargs, error, text):
    with pytest.raises(error, match=text.replace("[", r"\[").replace(")", r"\)")):
        mon.HBMMonitor(**kwargs)


def test_peak_grows_with_the_global_batch(tmp_path):
    """An activation-heavy model: the peak at global batch 1024 exceeds the one at 64."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 64)).astype("float32")
    y = rng.integers(0, 10, 2048).astype("int32")
    peaks = {}
    for batch in (64, 1024):
        model = cases.compile_model(cases.dense_mlp(units=2048, depth=2))
        history = model.fit(cases.tf_batches(x, y, batch).repeat(), steps_per_epoch=2, epochs=1,
                            verbose=0, callbacks=[mon.HBMMonitor()])
        peaks[batch] = history.history["hbm_peak_gib"][0]
    assert peaks[64] > 0
    # 1024 x 2048 float32 activations are 8 MiB each; at 64 rows they are 0.5 MiB.
    assert peaks[1024] > peaks[64] + 8 / 1024


def test_small_capacity_warns_exactly_once(digits, ktm_records):
    (x, y), _ = digits
    model = cases.compile_model(cases.dense_mlp())
    history = model.fit(cases.tf_batches(x, y), epochs=2, verbose=0,
                        callbacks=[mon.HBMMonitor(capacity_bytes=512 * 1024)])
    warnings = cases.log_messages(ktm_records, "headroom on")
    assert len(warnings) == 1
    (message,) = warnings
    assert "CPU (shared)" in message and "512.00 KiB" in message and "MiB" in message
    assert "GradientAccumulation(steps=" in message and "MixedBFloat16" in message
    assert "step 1" in message
    assert min(history.history["hbm_utilization"]) > 1.0  # peak above the given capacity

    ktm_records.clear()
    roomy = model.fit(cases.tf_batches(x, y), epochs=1, verbose=0,
                      callbacks=[mon.HBMMonitor(capacity_bytes=64 * 1024**3)])
    assert not cases.log_messages(ktm_records, "headroom on")
    assert 0 < roomy.history["hbm_utilization"][0] < 0.01


def test_an_unexpected_error_switches_the_monitor_off_and_training_goes_on(
        digits, monkeypatch, ktm_records):
    (x, y), _ = digits
    calls = {"n": 0}
    real = devices.read_memory

    def flaky(device):
        calls["n"] += 1
        if calls["n"] > 4:
            raise OSError("driver went away")
        return real(device)

    monkeypatch.setattr(devices, "read_memory", flaky)
    model = cases.compile_model(cases.dense_mlp())
    history = model.fit(cases.tf_batches(x, y), epochs=2, verbose=0, callbacks=[mon.HBMMonitor()])
    assert len(history.history["loss"]) == 2
    notices = cases.log_messages(ktm_records, "switched off")
    assert len(notices) == 1 and "driver went away" in notices[0]


def test_standalone_evaluate_logs_an_eval_record(digits, tmp_path, ktm_records):
    (x, y), (xv, yv) = digits
    model = cases.compile_model(cases.dense_mlp())
    model.fit(cases.tf_batches(x, y).take(2), epochs=1, verbose=0)
    model.evaluate(cases.tf_batches(xv, yv), verbose=0, callbacks=[mon.HBMMonitor(tmp_path)])
    (record,) = cases.read_timeline(tmp_path, "ktm_memory")
    assert record["phase"] == "eval" and record["step"] == 2
    assert record["devices"]["CPU (shared)"]["peak_bytes"] > 0
    assert cases.log_messages(ktm_records, "HBMMonitor (evaluate)")
    cases.assert_no_crash(ktm_records)


def test_devices_and_capacity(mirrored, monkeypatch):
    (shared,) = allocators.resolve_devices(devices.replica_devices(mirrored.strategy))
    assert shared.label == "CPU (shared)" and shared.shared
    assert shared.replicas == ("CPU:0", "CPU:1")
    (default,) = allocators.resolve_devices(devices.replica_devices(tf.distribute.get_strategy()))
    assert default.replicas == ("CPU:0",)
    assert allocators.assign_capacity([shared], None).startswith("unknown")
    assert shared.capacity is None

    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v3-8")
    assert devices.capacity("TPU:0")[0] == 16 * devices.GIB
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    assert devices.capacity("TPU:0")[0] == 16 * devices.GB
    tpu = allocators._Device("TPU:0", ("TPU:0",), ("TPU:0",), shared=False)
    assert "HBM_TABLE" in allocators.assign_capacity([tpu], None)
    assert tpu.capacity == 16 * devices.GB
