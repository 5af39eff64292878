"""keras_tpu_mem._compat.profiler: every private profiler API, called by name.

When an xprof or TensorFlow upgrade moves one of them, the test named after
the accessor fails here, before any ProfileWindow summary silently degrades.
"""

from __future__ import annotations

import configparser
import glob
import os
import sys

import pytest
import tensorflow as tf

from keras_tpu_mem._compat import profiler as profiler_compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_find_xspace_converter_finds_xprof():
    # The [test] extra installs tensorboard-plugin-profile, which brings xprof.
    name, fn = profiler_compat.find_xspace_converter()
    assert name == "xprof", f"xprof.convert._pywrap_profiler_plugin did not import: {fn}"
    assert callable(fn)


def test_find_xspace_converter_reports_why_nothing_was_found():
    name, reason = profiler_compat.find_xspace_converter(
        [("missing", "keras_tpu_mem_no_such_module.convert")])
    assert name is None
    assert "keras_tpu_mem_no_such_module.convert: ModuleNotFoundError" in reason


def test_xspace_class_parses_a_capture_and_step_trace_marks_steps(tmp_path):
    xspace = profiler_compat.xspace_class()
    assert xspace is not None, f"none of {profiler_compat.XSPACE_PROTOS} imports"
    tf.profiler.experimental.start(str(tmp_path))
    try:
        for step in range(2):
            with profiler_compat.step_trace("ktm_compat_step", step):
                tf.reduce_sum(tf.ones((64, 64)))
    finally:
        tf.profiler.experimental.stop()
    (path,) = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    space = xspace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    names = {m.name for plane in space.planes for m in plane.event_metadata.values()}
    assert "ktm_compat_step" in names  # the step marker XProf's overview page counts


def test_profile_plugin_installed(monkeypatch):
    assert profiler_compat.profile_plugin_installed() is True  # the [test] extra has it
    monkeypatch.setitem(sys.modules, "tensorboard_plugin_profile", None)
    assert profiler_compat.profile_plugin_installed() is False


def test_profile_extra_exists_in_setup_cfg():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    extras = config["options.extras_require"]
    assert "tensorboard-plugin-profile" in extras["profile"]
    assert profiler_compat.PROFILE_EXTRA == 'pip install "keras-tpu-mem[profile]"'


@pytest.mark.parametrize("name", sorted(
    n for n in dir(profiler_compat) if not n.startswith("_")
    and callable(getattr(profiler_compat, n))
    and getattr(getattr(profiler_compat, n), "__module__", "") == profiler_compat.__name__))
def test_every_profiler_accessor_is_tested_by_name(name):
    """Each accessor of `_compat.profiler` is called in a test above (none goes untested)."""
    with open(__file__, encoding="utf-8") as f:
        assert f.read().count(f"profiler_compat.{name}(") >= 1
