"""ProfileWindow on JAX (keras_tpu_mem/profiling/window.py): jax.profiler, the same XProf files.

The capture itself needs only JAX.
"""

from __future__ import annotations

import os
import socket

import jax
import keras
import pytest
from helpers import make_distribution, scope
from profiling_models import messages, random_data, small_model, xplanes

from keras_tpu_mem.profiling import ProfileWindow


# ---------------------------------------------------------- ProfileWindow
def test_window_leaves_exactly_one_xplane_in_tensorboards_layout(tmp_path, ktm_records):
    x, y = random_data()
    log_dir = str(tmp_path / "logs")
    window = ProfileWindow(log_dir, steps=(3, 6))
    small_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    found = xplanes(log_dir)
    assert len(found) == 1 and os.path.getsize(found[0]) > 1000
    run_dir = os.path.dirname(found[0])
    assert os.path.dirname(run_dir) == os.path.join(log_dir, "plugins", "profile")
    # JAX writes its trace.json.gz beside the xplane; the converters' caches
    # (*.hlo_proto.pb, *.op_stats*.pb) never land in the run directory.
    assert not [f for f in os.listdir(run_dir) if f.endswith((".hlo_proto.pb", "op_stats_v2.pb"))]
    (summary,) = window.summaries
    assert (summary.first_step, summary.last_step) == (3, 5)
    assert window.captured_runs == [run_dir]
    assert not [m for m in messages(ktm_records) if "another profiler" in m]


def test_steps_per_execution_and_epochs_are_counted_like_keras(tmp_path):
    x, y = random_data()
    log_dir = str(tmp_path / "logs")
    window = ProfileWindow(log_dir, steps=(5, 12), summary=False)
    # 10 steps per epoch in executions of 4: [0-3] [4-7] [8-9] | [10-13] ...
    small_model(steps_per_execution=4).fit(x, y, batch_size=32, epochs=2, verbose=0,
                                      callbacks=[window])
    (summary,) = window.summaries
    assert (summary.first_step, summary.last_step) == (4, 13)
    assert summary.steps_per_execution == 4
    assert len(xplanes(log_dir)) == 1


def test_window_past_the_end_saves_what_ran(tmp_path, ktm_records):
    x, y = random_data()
    window = ProfileWindow(str(tmp_path), steps=(8, 50), summary=False)
    small_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    assert (window.summaries[0].first_step, window.summaries[0].last_step) == (8, 9)
    assert any("training ended" in m for m in messages(ktm_records))
    assert len(xplanes(str(tmp_path))) == 1


def test_two_windows_give_two_runs(tmp_path):
    x, y = random_data()
    log_dir = str(tmp_path / "logs")
    first, second = (ProfileWindow(log_dir, steps=(2, 4), summary=False),
                     ProfileWindow(log_dir, steps=(6, 8), summary=False))
    small_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[first, second])
    found = xplanes(log_dir)
    assert len(found) == 2 and len({os.path.dirname(p) for p in found}) == 2
    assert [(s.first_step, s.last_step) for s in first.summaries + second.summaries] == \
        [(2, 3), (6, 7)]


@pytest.mark.parametrize("case", ["dp8", "mp2x4", "fsdp8"])
def test_window_under_a_distribution(case, tmp_path):
    x, y = random_data(256)
    with scope(make_distribution(case)):  # (2, 4): widths that divide by the model axis
        window = ProfileWindow(str(tmp_path), steps=(1, 3), summary=False)
        small_model(classes=8).fit(x, y % 8, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    assert len(xplanes(str(tmp_path))) == 1
    assert (window.summaries[0].first_step, window.summaries[0].last_step) == (1, 2)


def test_a_running_jax_profile_is_a_message_not_a_crash(tmp_path, ktm_records):
    x, y = random_data()
    other = str(tmp_path / "other")
    jax.profiler.start_trace(other)
    try:
        window = ProfileWindow(str(tmp_path / "logs"), steps=(3, 5))
        history = small_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    finally:
        jax.profiler.stop_trace()
    assert len(history.history["loss"]) == 1 and window.summaries == []
    assert any("another profiler is already running" in m for m in messages(ktm_records))
    assert len(xplanes(other)) == 1 and xplanes(str(tmp_path / "logs")) == []


class _StopsTheProfiler(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            jax.profiler.stop_trace()


def test_a_profile_stopped_by_someone_else_is_a_message(tmp_path, ktm_records):
    x, y = random_data()
    window = ProfileWindow(str(tmp_path), steps=(1, 5))
    history = small_model().fit(x, y, batch_size=32, epochs=1, verbose=0,
                           callbacks=[window, _StopsTheProfiler()])
    assert len(history.history["loss"]) == 1 and window.summaries == []
    assert any("stopped by someone else" in m for m in messages(ktm_records))


def test_server_mode_starts_jax_profiler_server(tmp_path, ktm_records):
    x, y = random_data(160)
    window = ProfileWindow(str(tmp_path), steps=(1, 3), mode="server")
    small_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    with socket.create_connection(("localhost", window.port), timeout=5):
        pass
    text = "\n".join(messages(ktm_records))
    assert f"JAX profiler server listening on port {window.port}" in text
    assert "jax.collect_profile" in text and "steps 1..2 run now" in text
    assert xplanes(str(tmp_path)) == []
    # JAX runs one server per process: a second port is a warning, not a crash.
    other = ProfileWindow(str(tmp_path), steps=(1, 2), mode="server")
    small_model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[other])
    assert any("could not start the profiler server" in m for m in messages(ktm_records))
