"""Reading a JAX capture back (keras_tpu_mem/profiling/summary.py).

The summary (step time, XLA peak heap) needs xprof's converters, the
`[profile]` extra; the tests that read it are skipped where they are missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from profiling_models import messages, random_data, small_model, xplanes

from keras_tpu_mem import _utils
from keras_tpu_mem.profiling import ProfileWindow, executed_xla_modules
from keras_tpu_mem.profiling import summary as summary_module

HAS_CONVERTER = summary_module._Converter().available
needs_converter = pytest.mark.skipif(not HAS_CONVERTER,
                                     reason="xprof's converters are not installed")


@needs_converter
def test_summary_reads_step_time_and_the_peak_heap_of_the_step_that_ran(tmp_path, ktm_records):
    x, y = random_data()
    log_dir = str(tmp_path / "logs")
    window = ProfileWindow(log_dir, steps=(3, 6))
    small_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    (summary,) = window.summaries
    assert summary.step_time_ms and summary.step_time_ms > 0
    assert summary.peak_heap_bytes and summary.peak_heap_bytes > 0  # every JAX step is XLA
    # Only the module that ran in the window: Keras' jitted train step, not the
    # small jit_* helpers compiled earlier in the process.
    assert "train_step" in summary.module_name
    ran = executed_xla_modules(summary.xplane_path)
    assert ran is not None and summary.module_name in ran
    text = "\n".join(messages(ktm_records))
    assert "captured steps 3..5" in text and "XLA peak heap" in text


def test_the_modules_that_ran_are_read_without_tensorflow(tmp_path):
    """The XSpace schema of `_compat.jax_profiler` reads a JAX capture (no xprof needed)."""
    from keras_tpu_mem._compat import jax_profiler

    x, y = random_data()
    window = ProfileWindow(str(tmp_path), steps=(2, 4), summary=False)
    small_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    (path,) = xplanes(str(tmp_path))
    space = jax_profiler.xspace_class()()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    assert any(plane.name.startswith("/host:") for plane in space.planes)
    ran = executed_xla_modules(path)
    # Keras' jitted train step ran in the window; the step markers are there too.
    assert any("train_step" in name for name in ran), ran
    names = {m.name for plane in space.planes for m in plane.event_metadata.values()}
    assert "train" in names


def test_without_a_converter_the_summary_is_a_note(tmp_path, monkeypatch, ktm_records):
    monkeypatch.setattr(summary_module, "_find_converter",
                        lambda: (None, "no XSpace converter could be imported (test)"))
    monkeypatch.setattr(_utils, "_LOGGED", set())
    x, y = random_data()
    window = ProfileWindow(str(tmp_path), steps=(1, 3))
    small_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    (summary,) = window.summaries
    assert summary.step_time_ms is None and summary.peak_heap_bytes is None
    assert 'pip install "keras-tpu-mem[profile]"' in summary.note
    assert len([m for m in messages(ktm_records) if "needs xprof's converters" in m]) == 1


_SUMMARY_WITHOUT_TF = textwrap.dedent("""
    import json, os, sys
    os.environ["KERAS_BACKEND"] = "jax"
    import keras
    import numpy as np
    from keras_tpu_mem.profiling import ProfileWindow
    x = np.random.default_rng(0).normal(size=(128, 16)).astype("float32")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    window = ProfileWindow(sys.argv[1], steps=(2, 4))
    model.fit(x, np.arange(128) % 4, batch_size=16, epochs=1, verbose=0, callbacks=[window])
    (summary,) = window.summaries
    print("RESULT " + json.dumps({"tensorflow": "tensorflow" in sys.modules,
                                  "module": summary.module_name}))
""")


@pytest.mark.slow  # a fresh process; it proves most with TensorFlow installed
@needs_converter
def test_the_summary_never_imports_tensorflow(tmp_path):
    """The summary tells the modules that ran with the TF-free XSpace class
    (TensorFlow's own, where installed, would load all of TensorFlow)."""
    done = subprocess.run([sys.executable, "-c", _SUMMARY_WITHOUT_TF, str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, KERAS_BACKEND="jax"),
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["tensorflow"] is False
    assert "train_step" in result["module"]  # only the module that ran in the window
