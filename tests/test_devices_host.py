"""`keras_tpu_mem.devices.host`: the process's resident memory and its peak."""

import os

import pytest

from keras_tpu_mem import devices
from keras_tpu_mem.devices import GIB, host


def _proc_rss_bytes() -> int:
    """An independent reading of this process's RSS: /proc/self/statm (pages)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/statm"),
                                reason="reads /proc (Linux)")


@linux_only
def test_host_rss_agrees_with_proc_and_sees_an_allocation():
    import numpy as np

    assert abs(devices.read_host_memory()[0] - _proc_rss_bytes()) < 16 * 2**20
    block = 256 * 2**20
    before = devices.read_host_memory()[0]
    data = np.ones(block // 8)  # written, so resident
    during = devices.read_memory("CPU:0", source="host_rss")
    assert during[0] - before > 0.9 * block and during[1] >= during[0]
    reading = devices.read_memory_reading("CPU:0", source="host_rss", capacity_bytes=GIB)
    assert reading.source == "host_rss" and reading.process_wide
    assert reading.capacity_bytes is None  # an HBM capacity does not apply to the host
    del data


@linux_only
def test_host_peak_uses_the_high_water_mark_between_readings():
    import numpy as np

    if not devices.reset_host_peak():
        pytest.skip("/proc/self/clear_refs cannot reset VmHWM in this sandbox")
    base = devices.read_host_memory()[0]
    transient = np.ones(256 * 2**20 // 8)  # allocated and freed between two readings
    del transient
    current, peak = devices.read_host_memory()
    assert current < base + 64 * 2**20  # freed again (numpy returns big blocks to the OS)
    assert peak > base + 200 * 2**20     # the kernel's high-water mark caught it
    assert "VmHWM" in devices.host_peak_method()
    # A reset starts the next interval at the current RSS.
    assert devices.reset_peak("CPU:0", source="host_rss") is True
    assert devices.read_host_memory()[1] < base + 64 * 2**20


@linux_only
def test_host_peak_without_a_resettable_high_water_mark_is_sampled(monkeypatch, tmp_path):
    import numpy as np

    monkeypatch.setattr(host, "_CLEAR_REFS_PATH", str(tmp_path / "missing" / "clear_refs"))
    assert devices.reset_host_peak() is False
    assert "between steps" in devices.host_peak_method()
    base = devices.read_host_memory()[0]
    kept = np.ones(128 * 2**20 // 8)
    seen = devices.read_host_memory()[1]  # read while the block is alive
    del kept
    transient = np.ones(256 * 2**20 // 8)
    del transient  # never read while alive: a sampled peak cannot see it
    peak = devices.read_host_memory()[1]
    assert seen > base + 100 * 2**20
    assert seen <= peak < base + 200 * 2**20
    monkeypatch.undo()
    devices.reset_host_peak()
