"""`keras_tpu_mem.devices.memory`: allocator readers and their sources, on TensorFlow."""

import json
import os
import subprocess
import sys

import pytest

from keras_tpu_mem import devices
from keras_tpu_mem.devices import GIB


def test_read_memory_cpu_and_unknown_device():
    import tensorflow as tf

    tf.ones((512, 512)) * 3.0
    current, peak = devices.read_memory("CPU:0")
    assert peak >= current >= 0 and peak > 0
    assert devices.read_memory("TPU:7") is None
    assert devices.reset_peak("CPU:0") is True


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


@pytest.mark.slow
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
