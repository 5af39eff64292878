"""ProfileWindow (jax.profiler: the same XProf files) and batch_size_sweep on JAX (issue 16).

The summary (step time, XLA peak heap) needs xprof's converters, the
`[profile]` extra; the tests that read it are skipped where they are missing.
The capture itself needs only JAX.
"""

from __future__ import annotations

import glob
import os
import socket

import jax
import keras
import numpy as np
import pytest
from helpers_jax import make_distribution, scope

from keras_tpu_mem import backends, devices, profiling
from keras_tpu_mem.profiling import ProfileWindow, batch_size_sweep

HAS_CONVERTER = profiling._Converter().available
needs_converter = pytest.mark.skipif(not HAS_CONVERTER,
                                     reason="xprof's converters are not installed")


def _model(steps_per_execution=1, units=32, classes=10):
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(units, activation="relu"),
                              keras.layers.Dense(classes)])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution)
    return model


def _data(n=320):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 64)).astype("float32"), rng.integers(0, 10, n).astype("int32")


def _xplanes(log_dir):
    return sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))


def _messages(records):
    return [r.getMessage() for r in records]


# ---------------------------------------------------------- ProfileWindow
def test_window_leaves_exactly_one_xplane_in_tensorboards_layout(tmp_path, ktm_records):
    x, y = _data()
    log_dir = str(tmp_path / "logs")
    window = ProfileWindow(log_dir, steps=(3, 6))
    _model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    found = _xplanes(log_dir)
    assert len(found) == 1 and os.path.getsize(found[0]) > 1000
    run_dir = os.path.dirname(found[0])
    assert os.path.dirname(run_dir) == os.path.join(log_dir, "plugins", "profile")
    # JAX writes its trace.json.gz beside the xplane; the converters' caches
    # (*.hlo_proto.pb, *.op_stats*.pb) never land in the run directory.
    assert not [f for f in os.listdir(run_dir) if f.endswith((".hlo_proto.pb", "op_stats_v2.pb"))]
    (summary,) = window.summaries
    assert (summary.first_step, summary.last_step) == (3, 5)
    assert window.captured_runs == [run_dir]
    assert not [m for m in _messages(ktm_records) if "another profiler" in m]


@needs_converter
def test_summary_reads_step_time_and_the_peak_heap_of_the_step_that_ran(tmp_path, ktm_records):
    x, y = _data()
    log_dir = str(tmp_path / "logs")
    window = ProfileWindow(log_dir, steps=(3, 6))
    _model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    (summary,) = window.summaries
    assert summary.step_time_ms and summary.step_time_ms > 0
    assert summary.peak_heap_bytes and summary.peak_heap_bytes > 0  # every JAX step is XLA
    # Only the module that ran in the window: Keras' jitted train step, not the
    # small jit_* helpers compiled earlier in the process.
    assert "train_step" in summary.module_name
    ran = profiling.executed_xla_modules(summary.xplane_path)
    assert ran is not None and summary.module_name in ran
    text = "\n".join(_messages(ktm_records))
    assert "captured steps 3..5" in text and "XLA peak heap" in text


def test_the_modules_that_ran_are_read_without_tensorflow(tmp_path):
    """The XSpace schema of `_compat.jax_profiler` reads a JAX capture (no xprof needed)."""
    from keras_tpu_mem._compat import jax_profiler

    x, y = _data()
    window = ProfileWindow(str(tmp_path), steps=(2, 4), summary=False)
    _model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    (path,) = _xplanes(str(tmp_path))
    space = jax_profiler.xspace_class()()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    assert any(plane.name.startswith("/host:") for plane in space.planes)
    ran = profiling.executed_xla_modules(path)
    # Keras' jitted train step ran in the window; the step markers are there too.
    assert any("train_step" in name for name in ran), ran
    names = {m.name for plane in space.planes for m in plane.event_metadata.values()}
    assert "train" in names


def test_steps_per_execution_and_epochs_are_counted_like_keras(tmp_path):
    x, y = _data()
    log_dir = str(tmp_path / "logs")
    window = ProfileWindow(log_dir, steps=(5, 12), summary=False)
    # 10 steps per epoch in executions of 4: [0-3] [4-7] [8-9] | [10-13] ...
    _model(steps_per_execution=4).fit(x, y, batch_size=32, epochs=2, verbose=0,
                                      callbacks=[window])
    (summary,) = window.summaries
    assert (summary.first_step, summary.last_step) == (4, 13)
    assert summary.steps_per_execution == 4
    assert len(_xplanes(log_dir)) == 1


def test_window_past_the_end_saves_what_ran(tmp_path, ktm_records):
    x, y = _data()
    window = ProfileWindow(str(tmp_path), steps=(8, 50), summary=False)
    _model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    assert (window.summaries[0].first_step, window.summaries[0].last_step) == (8, 9)
    assert any("training ended" in m for m in _messages(ktm_records))
    assert len(_xplanes(str(tmp_path))) == 1


def test_two_windows_give_two_runs(tmp_path):
    x, y = _data()
    log_dir = str(tmp_path / "logs")
    first, second = (ProfileWindow(log_dir, steps=(2, 4), summary=False),
                     ProfileWindow(log_dir, steps=(6, 8), summary=False))
    _model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[first, second])
    found = _xplanes(log_dir)
    assert len(found) == 2 and len({os.path.dirname(p) for p in found}) == 2
    assert [(s.first_step, s.last_step) for s in first.summaries + second.summaries] == \
        [(2, 3), (6, 7)]


@pytest.mark.parametrize("case", ["dp8", "mp2x4"])
def test_window_under_a_distribution(case, tmp_path):
    x, y = _data(256)
    with scope(make_distribution(case)):  # (2, 4): widths that divide by the model axis
        window = ProfileWindow(str(tmp_path), steps=(1, 3), summary=False)
        _model(classes=8).fit(x, y % 8, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    assert len(_xplanes(str(tmp_path))) == 1
    assert (window.summaries[0].first_step, window.summaries[0].last_step) == (1, 2)


def test_a_running_jax_profile_is_a_message_not_a_crash(tmp_path, ktm_records):
    x, y = _data()
    other = str(tmp_path / "other")
    jax.profiler.start_trace(other)
    try:
        window = ProfileWindow(str(tmp_path / "logs"), steps=(3, 5))
        history = _model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    finally:
        jax.profiler.stop_trace()
    assert len(history.history["loss"]) == 1 and window.summaries == []
    assert any("another profiler is already running" in m for m in _messages(ktm_records))
    assert len(_xplanes(other)) == 1 and _xplanes(str(tmp_path / "logs")) == []


class _StopsTheProfiler(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            jax.profiler.stop_trace()


def test_a_profile_stopped_by_someone_else_is_a_message(tmp_path, ktm_records):
    x, y = _data()
    window = ProfileWindow(str(tmp_path), steps=(1, 5))
    history = _model().fit(x, y, batch_size=32, epochs=1, verbose=0,
                           callbacks=[window, _StopsTheProfiler()])
    assert len(history.history["loss"]) == 1 and window.summaries == []
    assert any("stopped by someone else" in m for m in _messages(ktm_records))


def test_server_mode_starts_jax_profiler_server(tmp_path, ktm_records):
    x, y = _data(160)
    window = ProfileWindow(str(tmp_path), steps=(1, 3), mode="server")
    _model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    with socket.create_connection(("localhost", window.port), timeout=5):
        pass
    text = "\n".join(_messages(ktm_records))
    assert f"JAX profiler server listening on port {window.port}" in text
    assert "jax.collect_profile" in text and "steps 1..2 run now" in text
    assert _xplanes(str(tmp_path)) == []
    # JAX runs one server per process: a second port is a warning, not a crash.
    other = ProfileWindow(str(tmp_path), steps=(1, 2), mode="server")
    _model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[other])
    assert any("could not start the profiler server" in m for m in _messages(ktm_records))


def test_without_a_converter_the_summary_is_a_note(tmp_path, monkeypatch, ktm_records):
    monkeypatch.setattr(profiling, "_find_converter",
                        lambda: (None, "no XSpace converter could be imported (test)"))
    monkeypatch.setattr(profiling, "_NOTICES", set())
    x, y = _data()
    window = ProfileWindow(str(tmp_path), steps=(1, 3))
    _model().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[window])
    (summary,) = window.summaries
    assert summary.step_time_ms is None and summary.peak_heap_bytes is None
    assert 'pip install "keras-tpu-mem[profile]"' in summary.note
    assert len([m for m in _messages(ktm_records) if "needs xprof's converters" in m]) == 1


# ------------------------------------------------------- batch_size_sweep
def _sweep_model():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_sweep_on_jax_arrays_and_pydatasets_reads_the_host_rss(tmp_path):
    x, y = _data(1024)

    class Batches(keras.utils.PyDataset):
        def __init__(self, batch):
            super().__init__()
            self.batch = batch

        def __len__(self):
            return len(x) // self.batch

        def __getitem__(self, i):
            rows = slice(i * self.batch, (i + 1) * self.batch)
            return x[rows], y[rows]

    for dataset_fn in (lambda b: (x, y), Batches):
        result = batch_size_sweep(_sweep_model, dataset_fn, [256, 32], steps=5, verbose=0,
                                  png_path=str(tmp_path / "sweep.png"))
        assert [r.batch_size for r in result.rows] == [32, 256]
        assert all(r.status == "ok" and r.samples_per_sec > 0 for r in result.rows)
        # JAX's CPU devices keep no statistics: the process's RSS, named so.
        assert {r.memory_source for r in result.rows} == {"host_rss"}
        assert all(r.peak_bytes > 50 * 2**20 for r in result.rows)
        assert all(r.peak_exact is None for r in result.rows)
        assert "not HBM" in result.table() and result.largest_fitting == 256
        assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_stops_at_a_jax_resource_exhausted_error(ktm_records):
    x, y = _data(256)
    built = []

    def build_fn():
        if len(built) == 2:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.")
        built.append(1)
        return _sweep_model()

    result = batch_size_sweep(build_fn, lambda b: (x, y), [8, 16, 32, 64], steps=3, verbose=0)
    assert [(r.batch_size, r.status) for r in result.rows] == [(8, "ok"), (16, "ok"),
                                                                (32, "oom")]
    assert result.skipped == (64,) and "RESOURCE_EXHAUSTED" in result.rows[-1].error
    assert any("out of memory at batch 32" in m for m in _messages(ktm_records))

    def other_error():
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        batch_size_sweep(other_error, lambda b: (x, y), [8], steps=2, verbose=0)


def test_sweep_on_an_accelerator_marks_peaks_that_did_not_rise(monkeypatch):
    """A stand-in TPU/GPU reader: its high-water mark cannot be reset between rows."""
    marks = {"peak": 0}
    sizes = {8: 300, 16: 500, 32: 400}  # MiB the device peaks at for each batch

    def stats(device):
        return {"bytes_in_use": 10 * 2**20, "peak_bytes_in_use": marks["peak"],
                "bytes_limit": 16 * devices.GIB}

    def build_fn():
        model = _sweep_model()
        real_fit = model.fit

        def fit(data, **kwargs):
            batch = keras.tree.flatten(data[0])[0].shape[0]
            marks["peak"] = max(marks["peak"], sizes[batch] * 2**20)
            return real_fit(data, **kwargs)

        model.fit = fit
        return model

    monkeypatch.setattr(backends.get("jax").devices, "memory_stats", stats)
    x, y = _data(256)
    result = batch_size_sweep(build_fn, lambda b: (x, y), [8, 16, 32], steps=2, verbose=0)
    assert [r.memory_source for r in result.rows] == ["allocator"] * 3
    assert [r.peak_bytes // 2**20 for r in result.rows] == [300, 500, 500]
    assert [r.peak_exact for r in result.rows] == [True, True, False]
    assert "<= 500.00 MiB" in result.table()


def test_sweep_refuses_other_inputs_on_jax():
    with pytest.raises(TypeError, match="PyDataset"):
        batch_size_sweep(_sweep_model, lambda b: "not data", [8], steps=2, verbose=0)
    with pytest.raises(ValueError, match="fewer than 64"):
        batch_size_sweep(_sweep_model, lambda b: _data(32), [64], steps=2, verbose=0)
