"""`HBMMonitor`'s host-RSS fallback where the device keeps no memory statistics, one body
on both backends (conftest's BOTH_BACKENDS): TensorFlow's CPU allocator with oneDNN off
(`TF_ENABLE_ONEDNN_OPTS=0`, AMD/AVX2's default), JAX's CPU devices (`memory_stats()` is
None). Each batch size runs in a fresh process (tests/host_rss_workload.py says why).
"""

from __future__ import annotations

import host_rss_workload
import monitoring_cases as cases
import pytest
from conftest import BACKEND

from keras_tpu_mem import devices

if BACKEND == "tensorflow":
    # The process's environment, and what the one notice says of it.
    ENV, CAUSE = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}, \
        "TF_ENABLE_ONEDNN_OPTS=0"
else:
    ENV, CAUSE = {}, "memory_stats() is None"


@pytest.mark.slow  # two fresh processes (docs/testing.md: slow)
def test_host_rss_every_epoch_named_so_and_growing_with_the_batch(tmp_path):
    small, stderr, log_dir = cases.run_host_rss_workload(tmp_path, 64, **ENV)
    big, _, _ = cases.run_host_rss_workload(tmp_path, 4096, **ENV)
    # A JAX run imports no TensorFlow.
    assert small["tensorflow"] is big["tensorflow"] is (BACKEND == "tensorflow")

    history = small["history"]
    # The History keys stay as they are, with host-RSS figures in them, every epoch.
    assert len(history["hbm_peak_gib"]) == 2 and min(history["hbm_peak_gib"]) > 0
    assert len(big["history"]["hbm_peak_gib"]) == 2 and min(big["history"]["hbm_peak_gib"]) > 0
    assert min(history["val_hbm_peak_gib"]) > 0 and "samples_per_sec" in history
    # Reference: the process's own RSS (psutil) before fit; training only adds to it.
    assert min(history["hbm_peak_gib"]) * devices.GIB >= 0.9 * small["rss_before"]
    peak_small = max(history["hbm_peak_gib"]) * devices.GIB
    peak_big = max(big["history"]["hbm_peak_gib"]) * devices.GIB
    assert peak_big - peak_small > host_rss_workload.activation_bytes(4096), (peak_small, peak_big)

    # Said once, and named in the data: summary, timeline, TensorBoard, table.
    notices = [ln for ln in stderr.splitlines() if "memory source: host RSS" in ln]
    assert len(notices) == 1, stderr[-3000:]
    assert CAUSE in notices[0] and "not HBM" in notices[0]
    assert BACKEND == "tensorflow" or "oneDNN" not in notices[0]
    assert "cannot read memory" not in stderr and "switched off" not in stderr
    table = stderr[stderr.index("peak memory per device"):]
    assert "CPU (process RSS)" in table and "host RSS (process)" in table
    summary = small["summary"]
    assert summary["memory_sources"] == {"CPU (process RSS)": "host_rss"}
    info = summary["devices"]["CPU (process RSS)"]
    assert info["process_wide"] is True and info["source"] == "host_rss"
    assert "peak_exact" not in info  # VmHWM is reset per phase
    assert "VmHWM" in summary["host_rss_peak"] or "between steps" in summary["host_rss_peak"]
    memory = cases.read_timeline(log_dir, "ktm_memory")
    assert [r["phase"] for r in memory[:2]] == ["compile", "train"]
    assert {r["memory_source"] for r in memory} == {"host_rss"}
    for record in memory:
        (reading,) = record["devices"].values()
        assert reading["source"] == "host_rss" and reading["process_wide"] is True
        assert reading["peak_bytes"] >= reading["current_bytes"] > 0
        assert "peak_exact" not in reading
    if cases.HAS_TENSORBOARD:
        events = cases.event_accumulator(log_dir / "ktm_memory")
        tags = set(events.Tags()["scalars"])
        assert {"host_rss/process/current_gib", "host_rss/process/peak_gib",
                "host_rss_eval/process/peak_gib"} <= tags
        assert not [t for t in tags if t.startswith("hbm")]  # host RSS is never called HBM
        assert "host_rss" in cases.text_summary(events, "memory_source")
