"""`keras_tpu_mem.devices.tpu_slices`: Cloud TPU slice names -> topologies (no framework).

The expected topologies, chip configs and device counts are the ones libtpu was checked
against (`tests/test_tpu_topology_jax.py` loads them for real where libtpu is installed).
"""

import json
import subprocess
import sys

import pytest

from keras_tpu_mem.devices import GB, GIB, HBM_TABLE
from keras_tpu_mem.devices.tpu_slices import (
    KNOWN_SLICES,
    TPUSlice,
    is_tpu_slice_name,
    tpu_slice,
)

# name -> (topology, chip_config, chips, devices, hosts, chips_per_host_bounds)
EXPECTED = {
    "v2-8": ("v2:2x2", "default", 4, 8, 1, (2, 2, 1)),
    "v2-512": ("v2:16x16", "default", 256, 512, 64, (2, 2, 1)),
    "v3-8": ("v3:2x2", "default", 4, 8, 1, (2, 2, 1)),
    "v3-32": ("v3:4x4", "default", 16, 32, 4, (2, 2, 1)),
    "v3-64": ("v3:4x8", "default", 32, 64, 8, (2, 2, 1)),
    "v3-2048": ("v3:32x32", "default", 1024, 2048, 256, (2, 2, 1)),
    "v4-8": ("v4:2x2x1", "megacore", 4, 4, 1, (2, 2, 1)),
    "v4-16": ("v4:2x2x2", "megacore", 8, 8, 2, (2, 2, 1)),
    "v4-32": ("v4:2x2x4", "megacore", 16, 16, 4, (2, 2, 1)),
    "v4-64": ("v4:2x4x4", "megacore", 32, 32, 8, (2, 2, 1)),
    "v4-128": ("v4:4x4x4", "megacore", 64, 64, 16, (2, 2, 1)),
    "v4-384": ("v4:4x4x12", "megacore", 192, 192, 48, (2, 2, 1)),
    "v4-4096": ("v4:8x16x16", "megacore", 2048, 2048, 512, (2, 2, 1)),
    "v5e-1": ("v5e:1x1", "default", 1, 1, 1, (1, 1, 1)),
    "v5e-4": ("v5e:2x2", "default", 4, 4, 1, (2, 2, 1)),
    "v5e-8": ("v5e:2x4", "default", 8, 8, 1, (2, 4, 1)),
    "v5e-16": ("v5e:4x4", "default", 16, 16, 2, (2, 4, 1)),
    "v5e-256": ("v5e:16x16", "default", 256, 256, 32, (2, 4, 1)),
    # libtpu names v5p's topologies "v5" (its device kind is "TPU v5").
    "v5p-8": ("v5:2x2x1", "megacore", 4, 4, 1, (2, 2, 1)),
    "v5p-640": ("v5:4x4x20", "megacore", 320, 320, 80, (2, 2, 1)),
    "v5p-1536": ("v5:8x8x12", "megacore", 768, 768, 192, (2, 2, 1)),
    "v5p-12288": ("v5:16x16x24", "megacore", 6144, 6144, 1536, (2, 2, 1)),
    "v6e-1": ("v6e:1x1", "default", 1, 1, 1, (1, 1, 1)),
    "v6e-8": ("v6e:2x4", "default", 8, 8, 1, (2, 4, 1)),
    "v6e-128": ("v6e:8x16", "default", 128, 128, 16, (2, 4, 1)),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_generation_maps_to_its_topology(name):
    tpu = tpu_slice(name)
    topology, chip_config, chips, devices, hosts, host_bounds = EXPECTED[name]
    assert isinstance(tpu, TPUSlice)
    assert (tpu.name, tpu.topology, tpu.chip_config) == (name, topology, chip_config)
    assert (tpu.chips, tpu.devices, tpu.hosts) == (chips, devices, hosts)
    assert tpu.chips_per_host_bounds == host_bounds
    assert tpu.generation == name.split("-")[0]
    assert tpu.spec is HBM_TABLE[tpu.generation]


def test_the_number_counts_cores_on_v2_to_v5p_and_chips_on_v5e_v6e():
    for name in ("v2-8", "v3-8", "v4-8", "v5p-8"):
        assert tpu_slice(name).chips == 4, name
    for name in ("v5e-8", "v6e-8"):
        assert tpu_slice(name).chips == 8, name


def test_hbm_per_device_is_per_core_on_v2_v3_and_per_chip_after():
    assert tpu_slice("v2-8").hbm_bytes_per_device == 8 * GIB
    assert tpu_slice("v3-8").hbm_bytes_per_device == 16 * GIB
    assert tpu_slice("v4-8").hbm_bytes_per_device == 32 * GIB
    assert tpu_slice("v5e-16").hbm_bytes_per_device == 16 * GB
    assert tpu_slice("v5p-8").hbm_bytes_per_device == 95 * GB
    assert tpu_slice("v6e-256").hbm_bytes_per_device == 32 * GB
    for name in KNOWN_SLICES:  # the same per-device HBM the replica table gives
        tpu = tpu_slice(name)
        assert tpu.hbm_bytes_per_device == tpu.spec.hbm_bytes_per_replica, name


def test_wraparound_from_one_cube_and_on_full_pod_edges():
    assert tpu_slice("v4-64").wrap == (False, False, False)
    assert tpu_slice("v4-128").wrap == (True, True, True)
    assert tpu_slice("v5p-256").wrap == (True, True, True)
    assert tpu_slice("v5e-64").wrap == (False, False, False)
    assert tpu_slice("v5e-128").wrap == (False, True, False)
    assert tpu_slice("v6e-256").wrap == (True, True, False)


def test_whole_cubes_take_the_shape_closest_to_a_cube():
    assert tpu_slice("v5p-1024").topology == "v5:8x8x8"
    assert tpu_slice("v5p-2048").topology == "v5:8x8x16"  # not 4x16x16
    assert tpu_slice("v5p-768").topology == "v5:4x8x12"
    assert tpu_slice("v4-8192").topology == "v4:16x16x16"


@pytest.mark.parametrize("alias, name", [
    ("v5litepod-16", "v5e-16"), ("V5LITEPOD-256", "v5e-256"), ("v5lite-4", "v5e-4"),
    ("TPU v5e-16", "v5e-16"), ("tpu-v4-8", "v4-8"), ("  v3-8 ", "v3-8"),
    ("trillium-8", "v6e-8"), ("Trillium-256", "v6e-256"), ("TPU v5p-8", "v5p-8"),
])
def test_aliases_give_the_canonical_name(alias, name):
    assert tpu_slice(alias).name == name
    assert tpu_slice(alias) == tpu_slice(name)
    assert is_tpu_slice_name(alias)


def test_unknown_names_list_the_accepted_forms():
    for bad in ("12GiB", "v9-8", "v5-8", "v5e", "v3_8", "gpu-8", ""):
        with pytest.raises(ValueError, match=r"Unknown TPU slice .*'<generation>-<size>'") as err:
            tpu_slice(bad)
        message = str(err.value)
        assert "v5e (or v5litepod)" in message and "v6e (or trillium)" in message
        assert "'v3-8'" in message and "'v5litepod-16'" in message
        assert "TensorCores on v2, v3, v4 and v5p" in message
        assert not is_tpu_slice_name(bad)


@pytest.mark.parametrize("bad, says", [
    ("v5e-3", r"counts chips and is one of 1, 4, 8, 16, 32, 64, 128, 256"),
    ("v6e-2", r"counts chips and is one of 1, 4, 8"),
    ("v5litepod-512", r"not a TPU v5e slice"),
    ("v2-64", r"counts TensorCores \(2 per chip\) and is one of 8, 32, 128, 256, 512"),
    ("v3-4096", r"one of 8, 32, 64, 128, 256, 512, 1024, 2048"),
    ("v4-12", r"8, 16, 32, 64, or a multiple of 128 \(whole 4x4x4-chip cubes\) up to 8192"),
    ("v4-9", r"not a TPU v4 slice"),
    ("v4-0", r"not a TPU v4 slice"),
    ("v5p-12416", r"up to 12288"),
    ("v5p-17920", r"up to 12288"),
])
def test_sizes_cloud_does_not_sell_are_refused(bad, says):
    with pytest.raises(ValueError, match=says):
        tpu_slice(bad)
    assert not is_tpu_slice_name(bad)


def test_non_str_is_a_type_error():
    for bad in (8, None, b"v5e-8", ["v5e-8"]):
        with pytest.raises(TypeError, match="must be a str such as 'v5e-16'"):
            tpu_slice(bad)
        assert not is_tpu_slice_name(bad)


def test_known_slices_are_all_accepted_and_canonical():
    assert len(KNOWN_SLICES) == len(set(KNOWN_SLICES))
    for name in KNOWN_SLICES:
        assert tpu_slice(name).name == name
    assert {tpu_slice(name).generation for name in KNOWN_SLICES} == set(HBM_TABLE)
    for name in ("v2-8", "v3-8", "v4-8", "v5e-1", "v5e-256", "v5p-8", "v6e-8", "v6e-256"):
        assert name in KNOWN_SLICES


def test_slices_are_frozen_and_hashable():
    tpu = tpu_slice("v5e-16")
    with pytest.raises(AttributeError):
        tpu.chips = 4
    assert {tpu: 1}[tpu_slice("v5litepod-16")] == 1


def test_the_module_imports_no_framework():
    script = ("import json, sys; from keras_tpu_mem.devices.tpu_slices import tpu_slice; "
              "tpu = tpu_slice('v5litepod-16'); "
              "print(json.dumps([tpu.topology, "
              "[m for m in ('keras', 'tensorflow', 'jax') if m in sys.modules]]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["v5e:4x4", []]
