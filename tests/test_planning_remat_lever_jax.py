"""`plan(search=True)`'s targeted rematerialisation lever on JAX (planning/remat_lever.py):
the transformer encoder at sequence 256, batch 64, whose feed-forward Dense(512, gelu)
recomputed alone frees more than every layer recomputed. Budgets come from compiles here
(`compiled_memory` with the callbacks a candidate would be), not from figures."""

from __future__ import annotations

import keras
import pytest
from planning_models import encoder

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory, plan
from keras_tpu_mem.planning.budget import DeviceBudget
from keras_tpu_mem.remat import Rematerialize


def feed_forward(model) -> str:
    """The encoder's Dense(512, gelu)."""
    (layer,) = [layer for layer in model.layers
                if isinstance(layer, keras.layers.Dense) and layer.units == 512]
    return layer.name


@pytest.fixture(scope="module")
def model():
    return encoder(seq=256)


@pytest.fixture(scope="module")
def totals(model):
    def total(callbacks):
        return compiled_memory(model, 64, callbacks=callbacks, hlo_text=False).total_bytes

    return {"plain": total([]), "everything": total([Rematerialize()]),
            "feed_forward": total([Rematerialize(layers=[feed_forward(model)])]),
            "bf16": total([ktm.MixedBFloat16()]),
            "two": total([ktm.GradientAccumulation(2)])}


@pytest.mark.slow
def test_search_prefers_the_feed_forward_layer_alone(model, totals):
    ff = feed_forward(model)
    # The measurement this lever rests on: recomputing the one layer frees more than
    # recomputing every layer, and neither bf16 nor the plain step fits between them.
    assert totals["feed_forward"] < totals["everything"] < totals["plain"]
    budget = (totals["feed_forward"] + totals["everything"]) // 2
    assert totals["bf16"] > budget
    found = plan(model, 64, device=DeviceBudget("between", budget, 1, "test"), headroom=0.0,
                 search=True)
    rec = found.recommendation
    assert rec is not None and rec.accumulation_steps == 1, str(found)
    assert rec.rematerialize and rec.remat_layers == (ff,), str(found)
    assert rec.total_bytes == totals["feed_forward"] <= budget
    (callback,) = rec.callbacks()
    assert isinstance(callback, Rematerialize) and callback.layers == [ff]
    text = str(found)
    assert f"Rematerialize(layers=['{ff}'])" in text
    # Nothing rematerialised everything: the targeted candidate came first and fitted.
    assert all(c.remat_layers is not None for c in found.candidates if c.rematerialize)


@pytest.mark.slow
def test_search_falls_back_when_nothing_targeted_fits(model, totals):
    # Below every one-micro-batch candidate: accumulation, as without the targeted lever.
    budget = totals["two"]
    assert budget < totals["feed_forward"]
    found = plan(model, 64, device=DeviceBudget("tight", budget, 1, "test"), headroom=0.0,
                 search=True)
    rec = found.recommendation
    assert rec is not None and rec.accumulation_steps == 2 and not rec.rematerialize, \
        str(found)
    assert rec.total_bytes == budget
    one = [c for c in found.candidates if c.accumulation_steps == 1]
    assert all(c.total_bytes > budget for c in one)
    remat = [c.remat_layers for c in one if c.rematerialize]
    # Targeted first (the feed-forward layer among them), every layer last.
    assert (feed_forward(model),) in remat and remat[-1] is None
    assert all(layers is not None for layers in remat[:-2])
