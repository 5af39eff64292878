"""ProfileWindow (keras_tpu_mem/profiling/window.py): XProf capture, profiler server."""

from __future__ import annotations

import os
import socket

import keras
import pytest
from profiling_models import digits_model, messages, xplanes

from keras_tpu_mem.profiling import ProfileWindow


# ---------------------------------------------------------- ProfileWindow
def test_window_leaves_one_profile_and_prints_summary(digits, tmp_path, ktm_records):
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
    text = "\n".join(messages(ktm_records))
    assert "captured steps 3..5" in text and "XLA peak heap" in text


def test_two_windows_in_one_run(digits, tmp_path, ktm_records):
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


def test_window_past_the_end_saves_what_ran(digits, tmp_path, ktm_records):
    (x, y), _ = digits
    window = ProfileWindow(str(tmp_path), steps=(8, 50), summary=False)
    digits_model(jit_compile=False).fit(x[:320], y[:320], batch_size=32, epochs=1, verbose=0,
                                        callbacks=[window])
    assert (window.summaries[0].first_step, window.summaries[0].last_step) == (8, 9)
    assert any("training ended" in m for m in messages(ktm_records))


def test_overlapping_keras_profiler_is_a_message_not_a_crash(digits, tmp_path, ktm_records):
    (x, y), _ = digits
    log_dir = str(tmp_path / "logs")
    board = keras.callbacks.TensorBoard(log_dir, profile_batch=(2, 6))
    window = ProfileWindow(log_dir, steps=(3, 5))
    history = digits_model(jit_compile=False).fit(x[:320], y[:320], batch_size=32, epochs=1,
                                                  verbose=0, callbacks=[board, window])
    assert len(history.history["loss"]) == 1
    assert window.summaries == []
    assert any("another profiler is already running" in m for m in messages(ktm_records))
    assert len(xplanes(log_dir)) == 1  # Keras' own profile, under train/


def test_server_mode_listens(digits, tmp_path, ktm_records):
    (x, y), _ = digits
    window = ProfileWindow(str(tmp_path), steps=(1, 3), mode="server")
    digits_model(jit_compile=False).fit(x[:160], y[:160], batch_size=32, epochs=1, verbose=0,
                                        callbacks=[window])
    with socket.create_connection(("localhost", window.port), timeout=5):
        pass
    text = "\n".join(messages(ktm_records))
    assert f"listening on port {window.port}" in text and "Capture Profile" in text
    assert "steps 1..2 run now" in text
    assert xplanes(str(tmp_path)) == []


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
