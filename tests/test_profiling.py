"""ProfileWindow (XProf capture, profiler server) and batch_size_sweep."""

from __future__ import annotations

import glob
import json
import logging
import os
import socket
import subprocess
import sys

import host_rss_workload
import keras
import pytest
import tensorflow as tf

from keras_tpu_mem import profiling
from keras_tpu_mem._utils import logger
from keras_tpu_mem.profiling import ProfileWindow, batch_size_sweep


@pytest.fixture
def ktm_log():
    """Messages of the package logger (it does not propagate to the root)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(level=logging.DEBUG)
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def digits_model(jit_compile=True, steps_per_execution=1):
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile, steps_per_execution=steps_per_execution)
    return model


def xplanes(log_dir):
    return sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))


# ---------------------------------------------------------- ProfileWindow
def test_window_leaves_one_profile_and_prints_summary(digits, tmp_path, ktm_log):
    (x, y), _ = digits
    log_dir = str(tmp_path / "logs")
    window = ProfileWindow(log_dir, steps=(3, 6))
    digits_model().fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=0,
                       callbacks=[window])
    found = xplanes(log_dir)
    assert len(found) == 1
    run_dir = os.path.dirname(found[0])
    assert os.path.dirname(run_dir) == os.path.join(log_dir, "plugins", "profile")
    # The converters' caches went to a temporary copy: the run holds only the trace.
    assert os.listdir(run_dir) == [os.path.basename(found[0])]
    (summary,) = window.summaries
    assert (summary.first_step, summary.last_step) == (3, 5)
    assert summary.step_time_ms and summary.step_time_ms > 0
    assert summary.peak_heap_bytes and summary.peak_heap_bytes > 0  # jit_compile=True
    text = "\n".join(ktm_log)
    assert "captured steps 3..5" in text and "XLA peak heap" in text


def test_two_windows_in_one_run(digits, tmp_path, ktm_log):
    (x, y), _ = digits
    log_dir = str(tmp_path / "logs")
    first, second = ProfileWindow(log_dir, steps=(2, 4)), ProfileWindow(log_dir, steps=(6, 8))
    digits_model(jit_compile=False).fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=0,
                                        callbacks=[first, second])
    found = xplanes(log_dir)
    assert len(found) == 2 and len({os.path.dirname(p) for p in found}) == 2
    assert [(s.first_step, s.last_step) for s in first.summaries + second.summaries] == \
        [(2, 3), (6, 7)]
    # No XLA program ran in these windows: the summary must not borrow one
    # compiled earlier in the process.
    assert all(s.peak_heap_bytes is None for s in first.summaries + second.summaries)


def test_steps_per_execution_and_epochs_are_counted_like_keras(digits, tmp_path):
    (x, y), _ = digits
    log_dir = str(tmp_path / "logs")
    window = ProfileWindow(log_dir, steps=(5, 12), summary=False)
    # 10 steps per epoch in executions of 4: [0-3] [4-7] [8-9] | [10-13] ...
    digits_model(steps_per_execution=4).fit(x[:320], y[:320], batch_size=32, epochs=2,
                                            verbose=0, callbacks=[window])
    (summary,) = window.summaries
    assert (summary.first_step, summary.last_step) == (4, 13)
    assert summary.steps_per_execution == 4
    assert len(xplanes(log_dir)) == 1


def test_window_past_the_end_saves_what_ran(digits, tmp_path, ktm_log):
    (x, y), _ = digits
    window = ProfileWindow(str(tmp_path), steps=(8, 50), summary=False)
    digits_model(jit_compile=False).fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=0,
                                        callbacks=[window])
    assert (window.summaries[0].first_step, window.summaries[0].last_step) == (8, 9)
    assert any("training ended" in m for m in ktm_log)


def test_overlapping_keras_profiler_is_a_message_not_a_crash(digits, tmp_path, ktm_log):
    (x, y), _ = digits
    log_dir = str(tmp_path / "logs")
    board = keras.callbacks.TensorBoard(log_dir, profile_batch=(2, 6))
    window = ProfileWindow(log_dir, steps=(3, 5))
    history = digits_model(jit_compile=False).fit(x[:320], y[:320], batch_size=32, epochs=1,
                                                  verbose=0, callbacks=[board, window])
    assert len(history.history["loss"]) == 1
    assert window.summaries == []
    assert any("another profiler is already running" in m for m in ktm_log)
    assert len(xplanes(log_dir)) == 1  # Keras' own profile, under train/


def test_server_mode_listens(digits, tmp_path, ktm_log):
    (x, y), _ = digits
    window = ProfileWindow(str(tmp_path), steps=(1, 3), mode="server")
    digits_model(jit_compile=False).fit(x[:160], y[:160], batch_size=32, epochs=1, verbose=0,
                                        callbacks=[window])
    with socket.create_connection(("localhost", window.port), timeout=5):
        pass
    text = "\n".join(ktm_log)
    assert f"listening on port {window.port}" in text and "Capture Profile" in text
    assert "steps 1..2 run now" in text
    assert xplanes(str(tmp_path)) == []


def test_summary_without_converter_is_a_note(digits, tmp_path, monkeypatch):
    (x, y), _ = digits
    window = ProfileWindow(str(tmp_path), steps=(1, 3))
    digits_model(jit_compile=False).fit(x[:160], y[:160], batch_size=32, epochs=1, verbose=0,
                                        callbacks=[window])

    class NoConverter:
        available = False
        reason = "no XSpace converter could be imported (test)"

    monkeypatch.setattr(profiling, "_Converter", NoConverter)
    summary = profiling.summarize_profile(window.summaries[0].xplane_path)
    assert summary.step_time_ms is None and "TensorBoard" in summary.note


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(steps=(6, 3)), ValueError, "start < stop"),
    (dict(steps=(3, 3)), ValueError, "start < stop"),
    (dict(steps=(-1, 2)), ValueError, "start < stop"),
    (dict(steps="3,6"), TypeError, "steps"),
    (dict(steps=(1.0, 2)), TypeError, "steps"),
    (dict(mode="remote"), ValueError, "local"),
    (dict(port=6009), ValueError, "server"),
    (dict(mode="server", port=0), ValueError, "port"),
])
def test_profile_window_rejects_bad_arguments(tmp_path, kwargs, error, words):
    with pytest.raises(error, match=words):
        ProfileWindow(str(tmp_path), **{"steps": (1, 2), **kwargs})


# ------------------------------------------------------- batch_size_sweep
def _digits_dataset(digits):
    (x, y), _ = digits

    def dataset_fn(batch):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)

    return dataset_fn


def test_sweep_on_digits_gives_a_row_per_batch_and_a_png(digits, tmp_path):
    png = tmp_path / "sweep.png"
    result = batch_size_sweep(lambda: digits_model(jit_compile=False), _digits_dataset(digits),
                              [64, 16, 256], steps=4, png_path=str(png))
    assert [r.batch_size for r in result.rows] == [16, 64, 256]
    assert all(r.status == "ok" and r.samples_per_sec > 0 for r in result.rows)
    # oneDNN's CPU allocator keeps statistics (TensorFlow's default).
    assert all(r.peak_bytes is not None and r.peak_bytes > 0 for r in result.rows)
    assert result.largest_fitting == 256 and result.oom_batch is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert width > height > 100
    assert "largest: 256" in str(result)


def test_sweep_stops_cleanly_at_first_oom(digits, ktm_log):
    built = []

    def build_fn():
        if len(built) == 2:  # the third batch size runs out of memory
            raise tf.errors.ResourceExhaustedError(
                None, None, "OOM when allocating tensor with shape[4096,4096]")
        built.append(1)
        return digits_model(jit_compile=False)

    result = batch_size_sweep(build_fn, _digits_dataset(digits), [8, 16, 32, 64], steps=3)
    assert [(r.batch_size, r.status) for r in result.rows] == \
        [(8, "ok"), (16, "ok"), (32, "oom")]
    assert result.largest_fitting == 16 and result.oom_batch == 32
    assert result.skipped == (64,)
    assert "OOM when allocating" in result.rows[-1].error
    assert any("out of memory at batch 32" in m for m in ktm_log)


@pytest.mark.parametrize("args, error, words", [
    (("not callable", lambda b: None, [8]), TypeError, "build_fn"),
    ((lambda: None, None, [8]), TypeError, "dataset_fn"),
    ((lambda: None, lambda b: None, []), TypeError, "batch_sizes"),
    ((lambda: None, lambda b: None, [0]), ValueError, "batch_sizes"),
])
def test_sweep_rejects_bad_arguments(args, error, words):
    with pytest.raises(error, match=words):
        batch_size_sweep(*args)
    with pytest.raises(ValueError, match="steps"):
        batch_size_sweep(lambda: None, lambda b: None, [8], steps=1)


def test_sweep_rejects_a_non_dataset(digits):
    (x, y), _ = digits
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        batch_size_sweep(lambda: digits_model(jit_compile=False), lambda b: (x, y), [8],
                         steps=2)


# ------------------------------------------------------- without xprof
def test_window_without_xprof_writes_the_capture_and_names_the_extra_once(
        digits, tmp_path, monkeypatch, ktm_log):
    """A base install (no [profile] extra): TensorFlow alone writes the *.xplane.pb."""
    from keras_tpu_mem._compat import profiler as profiler_compat

    for name in ("xprof", "tensorboard_plugin_profile"):
        monkeypatch.setitem(sys.modules, name, None)  # `import xprof` fails, as uninstalled
    monkeypatch.setattr(profiling, "_find_converter",
                        lambda: (None, "no XSpace converter could be imported (test)"))
    monkeypatch.setattr(profiling, "_NOTICES", set())
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
    notices = [m for m in ktm_log if "needs xprof's converters" in m]
    assert len(notices) == 1 and 'keras-tpu-mem[profile]' in notices[0]


# ------------------------------------------------- sweep: progress, sources
def test_sweep_shows_progress_per_batch_size_and_keeps_framework_noise_out(digits, capfd):
    tf_logger = logging.getLogger("tensorflow")
    level = tf_logger.level

    def noisy_build():
        tf.get_logger().warning("framework noise from the build")
        return digits_model(jit_compile=False)

    result = batch_size_sweep(noisy_build, _digits_dataset(digits), [16, 32, 64], steps=3)
    out, err = capfd.readouterr()
    assert "3/3" in out and "samples/s" in out and "peak MiB" in out
    assert "framework noise" not in out + err
    assert tf_logger.level == level  # restored after the sweep
    assert {r.memory_source for r in result.rows} == {"allocator"}  # oneDNN on (conftest)
    assert "allocator" in result.table()

    batch_size_sweep(lambda: digits_model(jit_compile=False), _digits_dataset(digits), [16],
                     steps=2, verbose=0)
    assert "1/1" not in capfd.readouterr().out
    with pytest.raises(ValueError, match="verbose"):
        batch_size_sweep(lambda: None, lambda b: None, [8], verbose=2)


_ONEDNN_OFF_SWEEP = """
import json, os, sys
os.environ["KERAS_BACKEND"] = "tensorflow"
sys.path.insert(0, sys.argv[1])
import keras, tensorflow as tf
from host_rss_workload import wide_data, wide_model
from keras_tpu_mem import batch_size_sweep
x, y = wide_data()
result = batch_size_sweep(lambda: wide_model(keras), lambda b: tf.data.Dataset.from_tensor_slices(
    (x, y)).batch(b, drop_remainder=True), [32, 4096], steps=3, verbose=0)
print("RESULT " + json.dumps([[r.batch_size, r.peak_bytes, r.memory_source, r.status]
                              for r in result.rows]))
print("TABLE " + json.dumps(result.table()))
"""


def test_sweep_falls_back_to_host_rss_with_onednn_off():
    """TF_ENABLE_ONEDNN_OPTS=0 (AMD/AVX2's default): the peaks are the process's RSS."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", _ONEDNN_OFF_SWEEP,
                           os.path.dirname(host_rss_workload.__file__)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {ln.split(" ", 1)[0]: json.loads(ln.split(" ", 1)[1])
             for ln in done.stdout.splitlines() if ln.startswith(("RESULT ", "TABLE "))}
    (small, peak_small, source_small, ok_small), (big, peak_big, source_big, ok_big) = \
        lines["RESULT"]
    assert (small, big, ok_small, ok_big) == (32, 4096, "ok", "ok")
    assert source_small == source_big == "host_rss"
    assert peak_small > 50 * 2**20
    # One Dense(8192) activation at 4096 rows at least (host_rss_workload.py says why).
    assert peak_big - peak_small > host_rss_workload.activation_bytes(4096), (peak_small, peak_big)
    assert "host_rss" in lines["TABLE"] and "not HBM" in lines["TABLE"]
    notices = [ln for ln in done.stderr.splitlines() if "host RSS of the whole process" in ln]
    assert len(notices) == 1, done.stderr[-2000:]
