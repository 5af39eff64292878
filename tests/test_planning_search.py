"""`plan(..., callbacks=...)` and `plan(..., search=True)` (planning/search.py) on
TensorFlow: plans on compiles of the engine's step, and the lever search."""

from __future__ import annotations

import pytest
from planning_models import encoder, nbytes, wide_mlp

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import compiled_memory, plan
from keras_tpu_mem.planning.budget import DeviceBudget

MIB = 1024**2


@pytest.fixture(scope="module")
def big_mlp():
    return wide_mlp()


@pytest.fixture(scope="module")
def small_encoder():
    return encoder()


@pytest.mark.slow
def test_plan_with_callbacks_is_the_compiled_step(big_mlp):
    callbacks = [ktm.GradientAccumulation(8)]
    planned = plan(big_mlp, 8192, device="16GiB", callbacks=callbacks)
    compiled = compiled_memory(big_mlp, 8192, callbacks=callbacks, hlo_text=False)
    assert abs(planned.total_bytes - compiled.total_bytes) <= 0.05 * compiled.total_bytes
    assert planned.accumulation_steps == 8 and planned.micro_batch == 1024
    assert planned.accumulator_bytes == nbytes(big_mlp.trainable_weights)
    assert planned.features == ("GradientAccumulation",)
    plain = plan(big_mlp, 8192, device="16GiB", callbacks=[])
    assert planned.total_bytes < plain.total_bytes
    assert "engine's step for GradientAccumulation" in str(planned)


@pytest.mark.slow
def test_plan_extrapolates_beyond_the_compile_cap(big_mlp):
    # Independent reference: the direct compile at 8192.
    callbacks = [ktm.GradientAccumulation(8)]
    direct = compiled_memory(big_mlp, 8192, callbacks=callbacks, hlo_text=False)
    capped = plan(big_mlp, 8192, device="16GiB", callbacks=callbacks, max_compile_batch=4096)
    assert capped.extrapolated and max(capped.compiled_batches) <= 4096
    assert abs(capped.total_bytes - direct.total_bytes) <= 0.05 * direct.total_bytes


@pytest.mark.parametrize("callbacks, batch", [
    (lambda: [ktm.MixedBFloat16()], 256),
    (lambda: [ktm.GradientAccumulation(4), ktm.MixedBFloat16()], 256),
], ids=["bf16", "accumulation+bf16"])
@pytest.mark.slow
def test_plan_with_callbacks_matches_compile_for_the_encoder(small_encoder, callbacks, batch):
    planned = plan(small_encoder, batch, device="16GiB", callbacks=callbacks())
    compiled = compiled_memory(small_encoder, batch, callbacks=callbacks(), hlo_text=False)
    assert abs(planned.total_bytes - compiled.total_bytes) <= 0.05 * compiled.total_bytes


def test_plan_with_callbacks_refuses_the_paper_arguments(big_mlp):
    with pytest.raises(ValueError, match="accumulation_steps"):
        plan(big_mlp, 64, device="16GiB", callbacks=[], accumulation_steps=2)
    with pytest.raises(TypeError, match="search"):
        plan(big_mlp, 64, device="16GiB", search="yes")


@pytest.mark.slow
def test_search_recommends_callbacks_that_fit_the_budget(small_encoder):
    plain = compiled_memory(small_encoder, 512, hlo_text=False)
    budget = int(0.45 * plain.total_bytes)
    found = plan(small_encoder, 512, device=DeviceBudget("tight", budget, 1, "test"),
                 headroom=0.0, search=True)
    rec = found.recommendation
    assert rec is not None and rec.compiled, found
    check = compiled_memory(small_encoder, 512, callbacks=rec.callbacks(), hlo_text=False)
    assert check.total_bytes <= budget, (check, found)
    assert check.total_bytes == rec.total_bytes
    text = str(found)
    assert "search (compiled, cheapest first)" in text and "fits" in text
    # Cheapest first: every candidate before the recommendation does not fit (those
    # after it are the pruning's probes: more micro-batches, more state split).
    before = found.candidates[:found.candidates.index(rec)]
    assert all(c.total_bytes > budget for c in before)
