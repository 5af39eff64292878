"""`plan(search=True)` compiles a candidate only where no compile already decides it
(planning/search.py): on 8 host devices under `DataParallel`, the recommendation is the
exhaustive search's (the candidates compiled here, in the search's order), with fewer
compiles, and a budget below the replicated state is ruled out by the lower bound."""

from __future__ import annotations

import jax
import keras
import pytest

from keras_tpu_mem.planning import SearchNote, compiled_memory, plan
from keras_tpu_mem.planning.budget import DeviceBudget, divisors
from keras_tpu_mem.planning.memory_plan import lever_callbacks
from keras_tpu_mem.planning.remat_lever import targeted
from keras_tpu_mem.planning.sharding_lever import state_bytes_under
from keras_tpu_mem.remat import Rematerialize
from keras_tpu_mem.sharding import ShardedDataParallel
from keras_tpu_mem.sharding.layouts import proposed_layouts

GLOBAL_BATCH = 64  # 8 per device: micro-batches 1, 2, 4, 8


def _sequence_mlp():
    """Activations (8 x 32 x 256 per device) as large as the state: every lever matters."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 64))
    hidden = keras.layers.Dense(256, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling1D()(hidden))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _search_note(planned) -> SearchNote:
    note = planned.search
    assert isinstance(note, SearchNote) and note in planned.notes
    return note


def _all_candidates(model, active):
    """`[(key, callbacks, distribution)]` in the search's order, as its docstring states
    it: micro-batches ascending; the state as it is, split optimizer, split all; no
    remat, the targeted options, every layer; float32 then bfloat16."""
    devices = list(jax.devices()[:8])
    modes = [(None, active)] + [(mode, ShardedDataParallel(devices, shard=mode))
                                for mode in ("optimizer", "all")]
    table = compiled_memory(model, GLOBAL_BATCH, hlo_text=False).by_layer()
    everything = [layer.name for layer in Rematerialize().chosen_layers(model)]
    remats = [(False, None)] + [(True, t.layers) for t in targeted(table, model, everything)]
    remats.append((True, None))
    out = []
    for k in divisors(GLOBAL_BATCH // 8):
        for mode, distribution in modes:
            for remat, layers in remats:
                for bf16 in (False, True):
                    key = (k, mode, remat, layers, bf16)
                    out.append((key, lever_callbacks(k, bf16, remat, layers), distribution))
    return out


def _compiled_under(model, callbacks, distribution, active):
    if distribution is active:
        return compiled_memory(model, GLOBAL_BATCH, callbacks=callbacks, hlo_text=False)
    with proposed_layouts(model, distribution):
        return compiled_memory(model, GLOBAL_BATCH, callbacks=callbacks, hlo_text=False)


def _key(rec):
    return (rec.accumulation_steps, rec.sharding, rec.rematerialize, rec.remat_layers,
            rec.bf16)


@pytest.mark.slow
def test_pruned_search_recommends_what_the_exhaustive_search_does():
    active = keras.distribution.DataParallel(devices=jax.devices()[:8])
    with active.scope():
        model = _sequence_mlp()
        candidates = _all_candidates(model, active)
        order = [key for key, _, _ in candidates]
        # Every candidate up to 4 micro-batches compiled (8 only where the search probes).
        totals = {}
        for key, callbacks, distribution in candidates:
            if key[0] > 4:
                continue
            compiled = _compiled_under(model, callbacks, distribution, active)
            totals[key] = compiled.total_bytes
            # The lower bound the search rules out with is below every compile.
            state, trainable = state_bytes_under(model, distribution, active)
            bound = state + compiled.data_bytes + (trainable if key[0] > 1 else 0)
            assert bound <= compiled.total_bytes, (key, bound, compiled)
        # A budget that something at 4 micro-batches meets (the cheapest there): the
        # exhaustive search's answer lies at 4 or fewer.
        budget = min(t for key, t in totals.items() if key[0] == 4)
        exhaustive = next(key for key in order if totals[key] <= budget)
        planned = plan(model, GLOBAL_BATCH, device=DeviceBudget("tight", budget, 8, "test"),
                       headroom=0.0, search=True, by_layer=False)
    rec = planned.recommendation
    assert rec is not None and _key(rec) == exhaustive, (rec, exhaustive, str(planned))
    assert rec.total_bytes == totals[exhaustive]
    # The compiled candidates, listed in the search's order, are the compiles above.
    keys = [_key(c) for c in planned.candidates]
    assert keys == sorted(keys, key=order.index)
    assert all(c.total_bytes == totals[k] for k, c in zip(keys, planned.candidates)
               if k in totals)
    position = order.index(exhaustive) + 1
    assert all(c.total_bytes > budget for k, c in zip(keys, planned.candidates)
               if order.index(k) < position - 1)
    note = _search_note(planned)
    assert note.exhaustive == position and note.compiled == len(planned.candidates)
    assert note.compiled < note.exhaustive, str(planned)
    # Every candidate before the answer was compiled or ruled out unseen.
    before = sum(order.index(k) < position - 1 for k in keys)
    assert before + note.ruled_out == position - 1, (before, note)
    # What the loop above compiled came from the Compiler's cache; the probes at 8
    # micro-batches did not.
    assert note.reused == sum(k in totals for k in keys), (keys, note)
    assert f"search: compiled {note.compiled} candidates" in str(planned)


@pytest.mark.slow
def test_a_budget_below_the_replicated_state_is_ruled_out_by_the_lower_bound():
    active = keras.distribution.DataParallel(devices=jax.devices()[:8])
    with active.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, name="wide"),
                                  keras.layers.Dense(4, name="head")])
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        plain = compiled_memory(model, 16, hlo_text=False)
        # The replicated weights and slots alone: no replicated candidate fits.
        budget = plain.weight_bytes + plain.optimizer_bytes
        planned = plan(model, 16, device=DeviceBudget("tight", budget, 8, "test"),
                       headroom=0.0, search=True, by_layer=False)
    note = _search_note(planned)
    # At one micro-batch the four replicated candidates (remat none, all; float32,
    # bfloat16) come before any split one: the first is the plan's own step, which the
    # remat lever reads (from the cache), the other three are ruled out by the bound.
    assert note.by_bound >= 3, str(planned)
    assert "by the lower bound" in str(planned)
    replicated = [c for c in planned.candidates if c.sharding is None]
    assert all(c.total_bytes == plain.total_bytes for c in replicated), replicated
    assert note.reused >= len(replicated)
    rec = planned.recommendation
    assert rec is not None and rec.sharding is not None, str(planned)
    assert rec.total_bytes <= budget
