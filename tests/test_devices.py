import json
import os
import subprocess
import sys

import pytest

from keras_tpu_mem import devices
from keras_tpu_mem.devices import GB, GIB


@pytest.mark.parametrize(
    "name, per_replica",
    [("v2-8", 8 * GIB), ("v3", 16 * GIB), ("TPU v3", 16 * GIB), ("v4-8", 32 * GIB),
     ("v5litepod-16", 16 * GB), ("v5e", 16 * GB), ("v5p-8", 95 * GB), ("v6e-4", 32 * GB)],
)
def test_hbm_per_replica(name, per_replica):
    assert devices.lookup_tpu(name).hbm_bytes_per_replica == per_replica


def test_per_chip_and_per_core_differ_on_v3():
    spec = devices.lookup_tpu("v3")
    assert spec.hbm_bytes_per_chip == 32 * GIB
    assert spec.hbm_bytes_per_replica == 16 * GIB


@pytest.mark.parametrize("device, replicas", [("v3-8", 8), ("v3-64", 64), ("v4-8", 4),
                                              ("v5p-8", 4), ("v5e-4", 4), ("v6e-8", 8),
                                              ("v2-8", 8)])
def test_parse_accelerator_type(device, replicas):
    assert devices.parse_accelerator_type(device)[1] == replicas


def test_unknown_tpu_lists_known():
    with pytest.raises(ValueError, match="known generations are v2, v3, v4, v5e, v5p, v6e"):
        devices.lookup_tpu("v9")
    with pytest.raises(TypeError, match="`name` must be a str"):
        devices.lookup_tpu(3)
    with pytest.raises(ValueError, match="needs a size"):
        devices.parse_accelerator_type("v3")


def test_gpu_memory_from_name():
    assert devices.gpu_memory_bytes("NVIDIA A100-SXM4-40GB") == 40 * GB
    assert devices.gpu_memory_bytes("Tesla T4") == 16 * GB
    assert devices.gpu_memory_bytes("Mystery GPU") is None
    assert devices.gpu_memory_bytes(None) is None


def test_read_memory_cpu_and_unknown_device():
    import tensorflow as tf

    tf.ones((512, 512)) * 3.0
    current, peak = devices.read_memory("CPU:0")
    assert peak >= current >= 0 and peak > 0
    assert devices.read_memory("TPU:7") is None
    assert devices.reset_peak("CPU:0") is True


def test_format_bytes():
    assert devices.format_bytes(None) == "unknown"
    assert devices.format_bytes(512) == "512 B"
    assert devices.format_bytes(3 * GIB // 2) == "1.50 GiB"


# ------------------------------------------------------------ memory sources
def test_sources_are_named_and_checked():
    import tensorflow as tf

    tf.ones((512, 512)) * 3.0
    # conftest turns oneDNN on, so the CPU allocator keeps statistics.
    assert devices.memory_source("CPU:0") == devices.SOURCE_ALLOCATOR
    assert devices.memory_source("/job:localhost/replica:0/task:0/device:CPU:0") == "allocator"
    assert devices.memory_source("TPU:7") is None  # host RSS never stands in for HBM
    reading = devices.read_memory_reading("CPU:0", shared=True)
    assert reading.source == "allocator" and not reading.process_wide and reading.peak_bytes > 0
    unreadable = devices.read_memory_reading("TPU:7", capacity_bytes=16 * GIB)
    assert unreadable.source is None and not unreadable.readable
    with pytest.raises(ValueError, match="`source` must be one of"):
        devices.read_memory("CPU:0", source="rss")
    with pytest.raises(ValueError, match="`source`"):
        devices.reset_peak("CPU:0", source="HBM")


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

    monkeypatch.setattr(devices, "_CLEAR_REFS_PATH", str(tmp_path / "missing" / "clear_refs"))
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


_ONEDNN_OFF_DEVICES = """
import json, os
os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf
from keras_tpu_mem import devices
out = {"allocator": devices.read_memory("CPU:0"), "source": devices.memory_source("CPU:0"),
       "tpu": devices.memory_source("TPU:0")}
small = devices.read_memory_reading("CPU:0", shared=True)
devices.reset_peak("CPU:0", source=small.source)
big = tf.ones((64 * 2**20,), "float32") * 2.0   # 256 MiB kept alive
grown = devices.read_memory_reading("CPU:0", shared=True)
out.update(small=[small.current_bytes, small.peak_bytes, small.source, small.process_wide],
           grown=[grown.current_bytes, grown.peak_bytes, grown.source, grown.process_wide])
print("RESULT " + json.dumps(out))
"""


def test_onednn_off_falls_back_to_host_rss_in_a_subprocess():
    """TF_ENABLE_ONEDNN_OPTS=0 (the default on AMD/AVX2): no allocator statistics."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _ONEDNN_OFF_DEVICES], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line[len("RESULT "):])
    assert out["allocator"] is None and out["source"] == "host_rss" and out["tpu"] is None
    small, grown = out["small"], out["grown"]
    assert small[2:] == ["host_rss", True] and grown[2:] == ["host_rss", True]
    assert small[0] > 50 * 2**20  # a process that imported TensorFlow
    # The 256 MiB tensor shows in the figures (reference: its size).
    assert grown[0] - small[0] > 200 * 2**20
    assert grown[1] >= grown[0]
