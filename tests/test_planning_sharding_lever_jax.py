"""The search's sharding lever (planning/sharding_lever.py) on 8 host devices: a budget
between the fully sharded and the replicated step's total is met by splitting the state,
and the recommendation, applied with `reshard`, compiles within the budget."""

from __future__ import annotations

import keras
import pytest
from helpers import compile_adam, issue_mlp

from keras_tpu_mem.planning import compiled_memory, plan
from keras_tpu_mem.planning.sharding_lever import sharding_options
from keras_tpu_mem.sharding import ShardedDataParallel, reshard, sharded_dim

MIB = 1024**2


def test_options_go_from_the_active_level_up():
    data_parallel = keras.distribution.DataParallel()
    modes = [mode for mode, _ in sharding_options(data_parallel)]
    assert modes == [None, "optimizer", "all"]
    options = sharding_options(data_parallel)
    assert options[0][1] is data_parallel
    assert all(isinstance(d, ShardedDataParallel) and d.axis_size == 8 for _, d in options[1:])
    optimizer_sharded = ShardedDataParallel(shard="optimizer")
    assert [m for m, _ in sharding_options(optimizer_sharded)] == ["optimizer", "all"]
    assert sharding_options(None) == [(None, None)]


@pytest.mark.slow
def test_a_budget_only_sharding_meets_is_met_and_the_recommendation_fits():
    data_parallel = keras.distribution.DataParallel()
    with data_parallel.scope():
        model = compile_adam(issue_mlp())
        replicated = compiled_memory(model, 1024, hlo_text=False)
        # Between the fully sharded step's total (about 0.31x) and the replicated
        # state alone (0.6x): no accumulation, bf16 or recomputation can fit it.
        budget = int(0.5 * replicated.total_bytes / 0.9)
        planned = plan(model, 1024, device=f"{budget}B-8", search=True)
    rec = planned.recommendation
    assert rec is not None and rec.sharding in ("optimizer", "all"), str(planned)
    assert rec.total_bytes <= planned.usable_bytes
    assert any(c.sharding is None for c in planned.candidates)  # tried first, did not fit
    assert "ShardedDataParallel" in str(planned) and "reshard" in str(planned)
    assert all(sharded_dim(v) is None for v in model.trainable_variables)  # not moved
    distribution = rec.distribution()
    assert isinstance(distribution, ShardedDataParallel) and distribution.shard == rec.sharding
    reshard(model, distribution)
    with distribution.scope():
        applied = compiled_memory(model, 1024, callbacks=rec.callbacks(), hlo_text=False)
    assert applied.total_bytes <= planned.usable_bytes
    assert abs(applied.total_bytes - rec.total_bytes) <= 0.02 * rec.total_bytes
