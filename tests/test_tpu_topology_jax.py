"""`keras_tpu_mem.backends.jax.tpu_topology`: libtpu's compile-only devices of a TPU slice.

Tests that load real topologies need libtpu, which the `[tpu-plan]` extra installs; they
skip where it is missing (CI's JAX-only line). The failure paths (no libtpu, a loader
that fails, a device count that disagrees) run everywhere with the loader replaced.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import types

import pytest
from jax.experimental import topologies

from keras_tpu_mem.backends.jax import tpu_topology
from keras_tpu_mem.devices.tpu_slices import KNOWN_SLICES, tpu_slice
from keras_tpu_mem.planning.target import TPU_PLAN_INSTALL

NEEDS_TPU_PLAN = 'needs libtpu: the [tpu-plan] extra (pip install "keras-tpu-mem[tpu-plan]")'
LOCK_ENV = "ALLOW_MULTIPLE_LIBTPU_LOAD"


@pytest.fixture
def libtpu():
    """libtpu's module, or the test skips: only the [tpu-plan] extra installs it."""
    return pytest.importorskip("libtpu", reason=NEEDS_TPU_PLAN)


@pytest.fixture
def fresh_cache(monkeypatch):
    """An empty cache of loaded slices for one test (the module's own comes back after)."""
    monkeypatch.setattr(tpu_topology, "_DEVICES_BY_SLICE", {})


@pytest.fixture
def lock_env_unset(monkeypatch):
    """ALLOW_MULTIPLE_LIBTPU_LOAD unset for one test, and restored after it."""
    monkeypatch.setenv(LOCK_ENV, "placeholder")  # records the value to restore
    monkeypatch.delenv(LOCK_ENV)


# What a faithful libtpu answers: each known slice's topology -> its device count.
DEVICES_BY_TOPOLOGY = {tpu_slice(name).topology: tpu_slice(name).devices
                       for name in KNOWN_SLICES}


def _fake_topology(monkeypatch, count=None, error=None, initialized=False):
    """`get_topology_desc` replaced: `count` devices (default: the slice's) or `error`;
    libtpu counts as installed, and as loaded already if `initialized`."""
    calls = []

    def fake(topology_name, platform, **kwargs):
        calls.append((topology_name, platform, kwargs))
        if error is not None:
            raise error
        n = DEVICES_BY_TOPOLOGY[topology_name] if count is None else count
        return types.SimpleNamespace(devices=[object() for _ in range(n)])

    monkeypatch.setattr(topologies, "get_topology_desc", fake)
    monkeypatch.setattr(tpu_topology, "libtpu_version", lambda: "0.0.0")
    monkeypatch.setattr(tpu_topology, "_libtpu_initialized", lambda: initialized)
    return calls


# ------------------------------------------------------------------ real libtpu
# name -> (devices, device_kind, core_on_chip values) as libtpu 0.0.42.1 reports them.
REAL = {
    "v2-8": (8, "TPU v2", {0, 1}),
    "v3-8": (8, "TPU v3", {0, 1}),
    "v3-32": (32, "TPU v3", {0, 1}),
    "v4-8": (4, "TPU v4", {0}),
    "v4-32": (16, "TPU v4", {0}),
    "v5e-1": (1, "TPU v5 lite", {0}),
    "v5e-8": (8, "TPU v5 lite", {0}),
    "v5e-16": (16, "TPU v5 lite", {0}),
    "v5p-8": (4, "TPU v5", {0}),
    "v5p-128": (64, "TPU v5", {0}),
    "v6e-8": (8, "TPU v6 lite", {0}),
    "v6e-256": (256, "TPU v6 lite", {0}),
}


@pytest.mark.parametrize("name", list(REAL))
def test_devices_and_kinds_of_real_topologies(libtpu, name):
    devices, kind, cores_on_chip = REAL[name]
    tpu = tpu_slice(name)
    loaded = tpu_topology.slice_devices(tpu)
    assert len(loaded) == tpu.devices == devices
    assert {d.device_kind for d in loaded} == {kind} == {tpu.spec.device_kind}
    assert {d.platform for d in loaded} == {"tpu"}
    assert {d.core_on_chip for d in loaded} == cores_on_chip
    assert len({d.process_index for d in loaded}) == tpu.hosts


def test_megacore_is_what_makes_v4_one_device_per_chip(libtpu):
    tpu_topology.slice_devices(tpu_slice("v4-8"))  # libtpu loaded, quietly
    per_core = topologies.get_topology_desc(topology_name="v4:2x2x1", platform="tpu").devices
    assert len(per_core) == 8
    assert len(tpu_topology.slice_devices(tpu_slice("v4-8"))) == 4 == tpu_slice("v4-8").chips


def test_devices_are_cached_per_slice_name(libtpu, monkeypatch):
    first = tpu_topology.slice_devices(tpu_slice("v5e-8"))

    def no_second_load(*args, **kwargs):
        raise AssertionError("a cached slice loaded again")

    monkeypatch.setattr(topologies, "get_topology_desc", no_second_load)
    again = tpu_topology.slice_devices(tpu_slice("v5litepod-8"))
    assert again == first and all(a is b for a, b in zip(again, first))
    again.clear()  # a new list each call: the cache is not the caller's
    assert len(tpu_topology.slice_devices(tpu_slice("v5e-8"))) == 8


def test_loading_prints_nothing(libtpu, fresh_cache, capfd):
    if tpu_topology._tpu_chips_attached():
        pytest.skip("a TPU is attached: libtpu's own messages are left as they are")
    assert len(tpu_topology.slice_devices(tpu_slice("v6e-4"))) == 4
    assert tpu_topology.available()
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")


def test_the_first_load_in_a_process_prints_nothing(libtpu, capfd):
    """libtpu's start-up messages (fd 2, from C++) go to the package's DEBUG log."""
    if tpu_topology._tpu_chips_attached():
        pytest.skip("a TPU is attached: libtpu's own messages are left as they are")
    script = ("import os, sys, logging; from keras_tpu_mem._utils import logger; "
              "from keras_tpu_mem.backends.jax import tpu_topology as t; "
              "from keras_tpu_mem.devices.tpu_slices import tpu_slice; "
              "logger.setLevel(logging.DEBUG if sys.argv[1] == 'debug' else logging.INFO); "
              "print(len(t.slice_devices(tpu_slice('v5e-8'))), t.available(), "
              f"os.environ.get({LOCK_ENV!r}))")
    env = {k: v for k, v in os.environ.items() if k != LOCK_ENV}
    env["JAX_PLATFORMS"] = "cpu"  # no jax.devices() TPU attempt: libtpu first loads in ours
    for level in ("info", "debug"):
        # stderr is not captured here: it is this process's fd 2, which capfd reads.
        done = subprocess.run([sys.executable, "-c", script, level], stdout=subprocess.PIPE,
                              text=True, env=env, timeout=300)
        assert done.returncode == 0
        assert done.stdout.split() == ["8", "True", "1"]
        err = capfd.readouterr().err
        if level == "info":
            assert err == ""
        else:  # what libtpu printed, if anything, comes as one DEBUG record
            assert err == "" or err.startswith("keras_tpu_mem: libtpu's start-up messages")


def test_jax_devices_stay_on_the_cpu_with_libtpu_installed(libtpu):
    """JAX_PLATFORMS unset: jax.devices() tries libtpu, finds no TPU and answers with CPUs;
    the topologies still load after that in the same process."""
    script = ("import jax; from keras_tpu_mem.backends.jax import tpu_topology as t; "
              "from keras_tpu_mem.devices.tpu_slices import tpu_slice; "
              "print({d.platform for d in jax.devices()} == {'cpu'}, "
              "len(t.slice_devices(tpu_slice('v5e-16'))))")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env[LOCK_ENV] = "1"  # jax.devices() takes libtpu's lock otherwise (module docstring)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "16"]


def test_libtpu_version_is_the_installed_distribution(libtpu):
    assert tpu_topology.libtpu_version() == importlib.metadata.version("libtpu")


# ------------------------------------------------------------------ anywhere
def test_libtpu_version_is_none_without_a_distribution(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert tpu_topology.libtpu_version() is None


def test_without_libtpu_slice_devices_names_the_install(monkeypatch, fresh_cache):
    monkeypatch.setattr(tpu_topology, "libtpu_version", lambda: None)
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    with pytest.raises(tpu_topology.TPUCompilerUnavailable) as err:
        tpu_topology.slice_devices(tpu_slice("v5e-8"))
    assert TPU_PLAN_INSTALL in str(err.value)
    assert "libtpu is not installed" in str(err.value) and "v5e-8" in str(err.value)
    assert isinstance(err.value, RuntimeError)
    assert not tpu_topology.available()


def test_a_loader_failure_says_why_in_one_line(monkeypatch, fresh_cache, lock_env_unset):
    _fake_topology(monkeypatch, error=RuntimeError(
        "ABORTED: Internal error when accessing libtpu multi-process lockfile.\nTrace: ..."))
    with pytest.raises(tpu_topology.TPUCompilerUnavailable) as err:
        tpu_topology.slice_devices(tpu_slice("v5e-8"))
    message = str(err.value)
    assert "failed to load for TPU slice v5e-8: ABORTED: Internal error" in message
    assert "Trace" not in message and "ALLOW_MULTIPLE_LIBTPU_LOAD=1" in message
    _fake_topology(monkeypatch, error=OSError("libtpu.so: undefined symbol: X"))
    with pytest.raises(tpu_topology.TPUCompilerUnavailable, match=r"undefined symbol.*"
                       + r'pip install "keras-tpu-mem\[tpu-plan\]"'):
        tpu_topology.slice_devices(tpu_slice("v5e-8"))
    assert not tpu_topology.available()


def test_an_error_once_libtpu_is_up_is_not_hidden(monkeypatch, fresh_cache):
    _fake_topology(monkeypatch, error=ValueError("INVALID_ARGUMENT: bad topology"),
                   initialized=True)
    with pytest.raises(ValueError, match="INVALID_ARGUMENT: bad topology"):
        tpu_topology.slice_devices(tpu_slice("v5e-8"))


def test_a_device_count_that_disagrees_is_an_error(monkeypatch, fresh_cache):
    _fake_topology(monkeypatch, count=3, initialized=True)
    with pytest.raises(RuntimeError, match="describes v4-32 .* with 3 devices; "
                                           "keras_tpu_mem expects 16"):
        tpu_topology.slice_devices(tpu_slice("v4-32"))


def test_the_slice_reaches_get_topology_desc_as_written(monkeypatch, fresh_cache):
    calls = _fake_topology(monkeypatch, initialized=True)
    tpu_topology.slice_devices(tpu_slice("v4-32"))
    assert calls == [("v4:2x2x4", "tpu", {"chip_config_name": "megacore",
                                          "chips_per_host_bounds": (2, 2, 1),
                                          "wrap": (False, False, False)})]


def test_the_lock_is_shared_only_without_a_tpu_and_a_user_choice(
        monkeypatch, fresh_cache, lock_env_unset):
    _fake_topology(monkeypatch, initialized=True)
    monkeypatch.setattr(tpu_topology, "_tpu_chips_attached", lambda: True)
    tpu_topology.slice_devices(tpu_slice("v5e-8"))
    assert LOCK_ENV not in os.environ  # a TPU VM: libtpu's lock guards its chips
    monkeypatch.setattr(tpu_topology, "_tpu_chips_attached", lambda: False)
    monkeypatch.setenv(LOCK_ENV, "0")
    tpu_topology.slice_devices(tpu_slice("v3-8"))
    assert os.environ[LOCK_ENV] == "0"  # the user's choice stays
    monkeypatch.delenv(LOCK_ENV)
    tpu_topology.slice_devices(tpu_slice("v4-32"))
    assert os.environ[LOCK_ENV] == "1"


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"`tpu` must be a TPUSlice \(ktm.tpu_slice"):
        tpu_topology.slice_devices(8)
    with pytest.raises(TypeError, match=r"`tpu` must be a TPUSlice \(ktm.tpu_slice"):
        tpu_topology.slice_devices("v5e-8")
