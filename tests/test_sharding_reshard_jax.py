"""reshard on 8 host devices: a model built under DataParallel moved in place to
ShardedDataParallel (and back), its compiled state, and training that goes on exactly."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import compile_adam, issue_mlp, max_weight_diff, small_model, state_bytes, toy_data

from keras_tpu_mem.planning.compiled import compiled_memory
from keras_tpu_mem.sharding import ShardedDataParallel, reshard, sharded_dim


def _built(distribution, model_fn=small_model, learning_rate=1e-2):
    with distribution.scope():
        model = compile_adam(model_fn(), learning_rate)
        model.optimizer.build(model.trainable_variables)
    return model


def _values(model):
    return [np.asarray(v) for v in [*model.variables, *model.optimizer.variables]]


def _fit(model, distribution, epochs=1):
    x, y = toy_data(classes=10)
    with distribution.scope():
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)


@pytest.mark.slow
def test_reshard_the_issue_mlp_cuts_its_compiled_state():
    data_parallel = keras.distribution.DataParallel()
    model = _built(data_parallel, issue_mlp, 1e-3)
    with data_parallel.scope():
        before = state_bytes(compiled_memory(model, 1024, hlo_text=False))
    values = _values(model)
    sharded = ShardedDataParallel()
    assert reshard(model, sharded) is model
    for a, b in zip(values, _values(model)):
        np.testing.assert_array_equal(a, b)          # values kept
    for variable in [*model.weights, *model.optimizer.variables]:
        if len(variable.shape):
            assert sharded_dim(variable) is not None, variable.path
            assert variable.value.sharding.mesh.shape == {"batch": 8}
    with sharded.scope():
        after = state_bytes(compiled_memory(model, 1024, hlo_text=False))
    assert after <= 0.15 * before, (after, before)


def test_resharded_after_an_epoch_trains_on_exactly():
    data_parallel = keras.distribution.DataParallel()
    plain, moved = _built(data_parallel), _built(data_parallel)
    moved.set_weights(plain.get_weights())
    _fit(plain, data_parallel)
    _fit(moved, data_parallel)
    sharded = ShardedDataParallel()
    reshard(moved, sharded)
    assert sharded_dim(moved.layers[0].kernel) == 1
    _fit(plain, data_parallel)
    _fit(moved, sharded)
    assert int(moved.optimizer.iterations) == 10
    assert max_weight_diff(plain, moved) <= 1e-5
    for a, b in zip(plain.optimizer.variables, moved.optimizer.variables):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    # The layouts stay through the fit's write-back.
    assert sharded_dim(moved.layers[0].kernel) == 1
    momentum = [v for v in moved.optimizer.variables if "dense_in_kernel" in v.name][0]
    assert sharded_dim(momentum) == 1


def test_reshard_to_optimizer_only_and_back_to_data_parallel():
    model = _built(keras.distribution.DataParallel())
    values = _values(model)
    reshard(model, ShardedDataParallel(shard="optimizer"))
    assert all(sharded_dim(v) is None for v in model.weights)
    slots = [v for v in model.optimizer.variables if len(v.shape)]
    assert [sharded_dim(v) for v in slots] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, None, None]
    back = keras.distribution.DataParallel()
    reshard(model, back)
    assert all(sharded_dim(v) is None for v in [*model.weights, *model.optimizer.variables])
    for a, b in zip(values, _values(model)):
        np.testing.assert_array_equal(a, b)
    _fit(model, back)
    assert int(model.optimizer.iterations) == 5


def test_reshard_before_the_optimizer_is_built():
    data_parallel = keras.distribution.DataParallel()
    with data_parallel.scope():
        model = compile_adam(small_model())
    sharded = ShardedDataParallel(shard="optimizer")
    reshard(model, sharded)
    _fit(model, sharded)
    assert all(sharded_dim(v) is None for v in model.weights)
    assert sharded_dim(
        [v for v in model.optimizer.variables if "dense_in_kernel" in v.name][0]) == 1


def test_reshard_checks_its_arguments():
    model = _built(keras.distribution.DataParallel())
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        reshard(object(), ShardedDataParallel())
    with pytest.raises(TypeError, match="`distribution` must be a keras.distribution"):
        reshard(model, "all")
