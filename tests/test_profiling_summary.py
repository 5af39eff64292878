"""Reading a capture back (keras_tpu_mem/profiling/summary.py), with and without xprof."""

from __future__ import annotations

import os
import sys

from profiling_models import digits_model, messages, xplanes

from keras_tpu_mem import _utils
from keras_tpu_mem.profiling import ProfileWindow
from keras_tpu_mem.profiling import summary as summary_module


def test_summary_without_converter_is_a_note(digits, tmp_path, monkeypatch):
    (x, y), _ = digits
    window = ProfileWindow(str(tmp_path), steps=(1, 3))
    digits_model(jit_compile=False).fit(x[:160], y[:160], batch_size=32, epochs=1, verbose=0,
                                        callbacks=[window])

    class NoConverter:
        available = False
        reason = "no XSpace converter could be imported (test)"

    monkeypatch.setattr(summary_module, "_Converter", NoConverter)
    summary = summary_module.summarize_profile(window.summaries[0].xplane_path)
    assert summary.step_time_ms is None and "TensorBoard" in summary.note


# ------------------------------------------------------- without xprof
def test_window_without_xprof_writes_the_capture_and_names_the_extra_once(
        digits, tmp_path, monkeypatch, ktm_records):
    """A base install (no [profile] extra): TensorFlow alone writes the *.xplane.pb."""
    from keras_tpu_mem._compat import profiler as profiler_compat

    for name in ("xprof", "tensorboard_plugin_profile"):
        monkeypatch.setitem(sys.modules, name, None)  # `import xprof` fails, as uninstalled
    monkeypatch.setattr(summary_module, "_find_converter",
                        lambda: (None, "no XSpace converter could be imported (test)"))
    monkeypatch.setattr(_utils, "_LOGGED", set())
    assert profiler_compat.profile_plugin_installed() is False
    (x, y), _ = digits
    log_dir = str(tmp_path / "logs")
    windows = [ProfileWindow(log_dir, steps=(1, 3)), ProfileWindow(log_dir, steps=(5, 7))]
    digits_model(jit_compile=False).fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=0,
                                        callbacks=windows)
    found = xplanes(log_dir)
    assert len(found) == 2 and all(os.path.getsize(p) > 1000 for p in found)
    for window in windows:
        (summary,) = window.summaries
        assert summary.step_time_ms is None and summary.peak_heap_bytes is None
        assert 'pip install "keras-tpu-mem[profile]"' in summary.note
        assert "tensorboard-plugin-profile" in summary.text()  # the Profile tab needs it too
    notices = [m for m in messages(ktm_records) if "needs xprof's converters" in m]
    assert len(notices) == 1 and 'keras-tpu-mem[profile]' in notices[0]
