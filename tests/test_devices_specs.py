"""`keras_tpu_mem.devices.specs` and `units`: the HBM table, TPU names, GPU sizes, bytes."""

import json
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


def test_format_bytes():
    assert devices.format_bytes(None) == "unknown"
    assert devices.format_bytes(512) == "512 B"
    assert devices.format_bytes(3 * GIB // 2) == "1.50 GiB"


def test_the_table_imports_no_framework():
    """`ktm.HBM_TABLE` and `keras-tpu-mem devices`' table work where no framework is installed."""
    script = ("import json, sys; import keras_tpu_mem as ktm; "
              "from keras_tpu_mem import devices; "
              "spec = ktm.lookup_tpu('v5litepod-16'); "
              "print(json.dumps([spec.hbm_bytes_per_replica, sorted(ktm.HBM_TABLE), "
              "[m for m in ('keras', 'tensorflow', 'jax') if m in sys.modules]]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    per_replica, table, loaded = json.loads(done.stdout.splitlines()[-1])
    assert per_replica == 16 * GB and table == sorted(devices.HBM_TABLE)
    assert loaded == []
