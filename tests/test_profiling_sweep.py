"""batch_size_sweep (keras_tpu_mem/profiling/sweep.py) and its SweepResult."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import host_rss_workload
import pytest
import tensorflow as tf
from profiling_models import digits_model, messages

from keras_tpu_mem.profiling import batch_size_sweep


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


def test_sweep_stops_cleanly_at_first_oom(digits, ktm_records):
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
    assert any("out of memory at batch 32" in m for m in messages(ktm_records))


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


def test_sweep_refuses_a_headroom_without_a_device():
    """A headroom is left free in a compile for `device=`; a sweep that trains here
    measures what the run holds, so it is refused there rather than ignored."""
    with pytest.raises(ValueError, match=r"headroom=0\.1.*device="):
        batch_size_sweep(lambda: None, lambda b: None, [8], headroom=0.1)
    with pytest.raises(TypeError, match="headroom"):
        batch_size_sweep(lambda: None, lambda b: None, [8], headroom="10%")


def test_sweep_rejects_a_non_dataset(digits):
    (x, y), _ = digits
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        batch_size_sweep(lambda: digits_model(jit_compile=False), lambda b: (x, y), [8],
                         steps=2)


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


@pytest.mark.slow
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
