"""The pruning mask of a sharded kernel is derived on the device array, laid out as
the kernel, never gathered to the host (a multi-process resume under sharded state
holds only its own shards, and gathering there fails)."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

from keras_tpu_mem import ShardedDataParallel
from keras_tpu_mem.engine import StepContext
from keras_tpu_mem.pruning import callback


def _derive(kernel, from_zeros):
    """What `Pruning` does to its masks at a resume: the mask of `kernel`."""
    fn = callback._nonzero if from_zeros else callback._ones
    return StepContext.outside().computed_like(kernel, fn, "bool")


@pytest.fixture
def sharded_kernel():
    distribution = ShardedDataParallel(devices=jax.devices()[:8])
    with distribution.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64)])
        kernel = model.layers[0].kernel
        values = np.random.default_rng(0).normal(size=(16, 64)).astype("float32")
        values[values < 0.3] = 0.0  # about 60% zeros, as a pruned kernel resumed
        kernel.assign(values)
        yield kernel, values


def test_mask_from_zeros_never_reads_the_sharded_kernel_on_the_host(sharded_kernel,
                                                                    monkeypatch):
    kernel, values = sharded_kernel
    assert len(kernel.value.sharding.device_set) == 8
    assert not kernel.value.sharding.is_fully_replicated

    def not_on_host(self, *args, **kwargs):
        # What a process that does not hold every shard meets: the array has
        # no whole value to give.
        raise RuntimeError("gathered a sharded array to the host")

    monkeypatch.setattr(type(kernel.value), "__array__", not_on_host)
    mask = _derive(kernel, from_zeros=True)
    monkeypatch.undo()

    np.testing.assert_array_equal(np.asarray(mask), values != 0)
    assert mask.dtype == np.bool_
    assert mask.sharding.is_equivalent_to(kernel.value.sharding, 2)


def test_mask_not_from_zeros_is_all_ones_laid_out_as_the_kernel(sharded_kernel):
    kernel, _ = sharded_kernel
    mask = _derive(kernel, from_zeros=False)
    assert np.asarray(mask).all()
    assert mask.sharding.is_equivalent_to(kernel.value.sharding, 2)
    ones = StepContext.outside().ones_like(kernel, "bool")  # a fit's first masks
    assert np.asarray(ones).all() and ones.sharding.is_equivalent_to(kernel.value.sharding, 2)


def test_mask_from_zeros_without_a_distribution():
    kernel = keras.Variable(np.array([[0.0, 1.5], [-2.0, 0.0]], "float32"))
    mask = _derive(kernel, from_zeros=True)
    np.testing.assert_array_equal(np.asarray(mask), [[False, True], [True, False]])
