"""batch_size_sweep on JAX (keras_tpu_mem/profiling/sweep.py): arrays, PyDatasets, JAX's
out-of-memory error, device allocators whose peak cannot be reset."""

from __future__ import annotations

import jax
import keras
import pytest
from profiling_models import messages, random_data

from keras_tpu_mem import backends, devices
from keras_tpu_mem.profiling import batch_size_sweep


# ------------------------------------------------------- batch_size_sweep
def sweep_model():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_sweep_on_jax_arrays_and_pydatasets_reads_the_host_rss(tmp_path):
    x, y = random_data(1024)

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
        result = batch_size_sweep(sweep_model, dataset_fn, [256, 32], steps=5, verbose=0,
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
    x, y = random_data(256)
    built = []

    def build_fn():
        if len(built) == 2:
            raise jax.errors.JaxRuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.")
        built.append(1)
        return sweep_model()

    result = batch_size_sweep(build_fn, lambda b: (x, y), [8, 16, 32, 64], steps=3, verbose=0)
    assert [(r.batch_size, r.status) for r in result.rows] == [(8, "ok"), (16, "ok"),
                                                                (32, "oom")]
    assert result.skipped == (64,) and "RESOURCE_EXHAUSTED" in result.rows[-1].error
    assert any("out of memory at batch 32" in m for m in messages(ktm_records))

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
        model = sweep_model()
        real_fit = model.fit

        def fit(data, **kwargs):
            batch = keras.tree.flatten(data[0])[0].shape[0]
            marks["peak"] = max(marks["peak"], sizes[batch] * 2**20)
            return real_fit(data, **kwargs)

        model.fit = fit
        return model

    monkeypatch.setattr(backends.get("jax").devices, "memory_stats", stats)
    x, y = random_data(256)
    result = batch_size_sweep(build_fn, lambda b: (x, y), [8, 16, 32], steps=2, verbose=0)
    assert [r.memory_source for r in result.rows] == ["allocator"] * 3
    assert [r.peak_bytes // 2**20 for r in result.rows] == [300, 500, 500]
    assert [r.peak_exact for r in result.rows] == [True, True, False]
    assert "<= 500.00 MiB" in result.table()


def test_sweep_refuses_other_inputs_on_jax():
    with pytest.raises(TypeError, match="PyDataset"):
        batch_size_sweep(sweep_model, lambda b: "not data", [8], steps=2, verbose=0)
    with pytest.raises(ValueError, match="fewer than 64"):
        batch_size_sweep(sweep_model, lambda b: random_data(32), [64], steps=2, verbose=0)
