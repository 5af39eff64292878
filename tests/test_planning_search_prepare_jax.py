"""While XLA compiles one candidate of `plan(search=True)` on another thread, the search
traces and lowers the one it would compile next (planning/search.py `_prepare_after`,
`Compiler.prepare`, the JAX backend's `prepare_step` / `compile_step(meanwhile=)`). The
guess must change nothing the search decides: the same candidates, figures and
recommendation as a search that prepares nothing."""

from __future__ import annotations

import threading

import jax
import keras
import pytest

import keras_tpu_mem.backends.jax.compiled as jax_compiled
from keras_tpu_mem.engine.compile import compile_context
from keras_tpu_mem.planning import compiled_memory, plan
from keras_tpu_mem.planning.budget import DeviceBudget
from keras_tpu_mem.planning.compiled import Compiler

GLOBAL_BATCH = 64  # 8 per device: micro-batches 1, 2, 4, 8


def _sequence_mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 64))
    hidden = keras.layers.Dense(256, activation="relu", name="hidden")(inputs)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(hidden)  # names: two builds
    outputs = keras.layers.Dense(4, name="head")(pooled)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _search(monkeypatch, prepare: bool):
    """A fresh model's search (no compile cached) and how many of its compiles started
    from a prepared lowering."""
    from_prepared = []
    compile_step = jax_compiled.compile_step

    def counting(*args, prepared=None, **kwargs):
        from_prepared.append(prepared is not None)
        return compile_step(*args, prepared=prepared, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(jax_compiled, "compile_step", counting)
        if not prepare:
            patch.setattr(Compiler, "prepare", lambda self, per_replica, features=(): None)
        active = keras.distribution.DataParallel(devices=jax.devices()[:8])
        with active.scope():
            model = _sequence_mlp()
            plain = compiled_memory(model, GLOBAL_BATCH, hlo_text=False)
            budget = DeviceBudget("tight", int(0.5 * plain.total_bytes), 8, "test")
            planned = plan(model, GLOBAL_BATCH, device=budget, headroom=0.0, search=True,
                           by_layer=False)
    return planned, sum(from_prepared)


def _decided(planned):
    rec = planned.recommendation
    return ([(c.accumulation_steps, c.sharding, c.rematerialize, c.remat_layers, c.bf16,
              c.total_bytes) for c in planned.candidates],
            None if rec is None else (rec.accumulation_steps, rec.sharding, rec.bf16,
                                      rec.remat_layers, rec.total_bytes),
            str(planned.search))


@pytest.mark.slow
def test_the_search_decides_the_same_with_and_without_prepared_candidates(monkeypatch):
    prepared, used = _search(monkeypatch, prepare=True)
    unprepared, unused = _search(monkeypatch, prepare=False)
    assert unused == 0
    # The guesses were taken: several compiles started from their lowering...
    assert used >= prepared.search.compiled // 2, (used, str(prepared))
    # ... and decided nothing: the same compiles, figures and answer.
    assert prepared.recommendation is not None, str(prepared)
    assert _decided(prepared) == _decided(unprepared)


def _step_args():
    model = _sequence_mlp()
    compiler = Compiler(model, what="test")
    xs, ys = compiler.specs(GLOBAL_BATCH)
    compiled_memory(model, GLOBAL_BATCH, hlo_text=False)  # builds the optimizer's state
    return model, xs, ys


def test_compile_step_runs_meanwhile_here_while_xla_compiles_on_its_thread(monkeypatch):
    model, xs, ys = _step_args()
    threads = []
    compile_for_memory = jax_compiled.jax_compat.compile_for_memory

    def recording(lowered, platform, options=None):
        threads.append(threading.current_thread().name)
        return compile_for_memory(lowered, platform, options)

    monkeypatch.setattr(jax_compiled.jax_compat, "compile_for_memory", recording)
    alone = jax_compiled.compile_step(model, xs, ys, (), compile_context, False, "the step")
    seen = []
    overlapped = jax_compiled.compile_step(
        model, xs, ys, (), compile_context, False, "the step",
        prepared=jax_compiled.prepare_step(model, xs, ys, (), compile_context),
        meanwhile=lambda: seen.append(threading.current_thread().name))
    assert seen == [threading.current_thread().name]
    assert threads[0] == threading.current_thread().name
    assert threads[1].startswith("ktm-xla-compile"), threads
    assert {k: v for k, v in overlapped.items() if k != "module_name"} == \
        {k: v for k, v in alone.items() if k != "module_name"}


def test_an_error_of_meanwhile_is_its_own_and_a_lowering_error_is_the_compiles():
    model, xs, ys = _step_args()

    def failing():
        raise ValueError("meanwhile failed")

    with pytest.raises(ValueError, match="meanwhile failed"):
        jax_compiled.compile_step(model, xs, ys, (), compile_context, False, "the step",
                                  meanwhile=failing)
    # A step whose lowering failed raises when it is compiled, as compile_step would.
    broken = jax_compiled._PreparedStep(None, "cpu", 1, error=TypeError("no lowering"))
    with pytest.raises(RuntimeError, match="XLA could not compile the step on JAX "
                                           r"\(TypeError: no lowering\)"):
        jax_compiled.compile_step(model, xs, ys, (), compile_context, False, "the step",
                                  prepared=broken)
