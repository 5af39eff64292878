"""`Feature.micro_batches -> int | None` holds on TensorFlow too: a batch whose size
only the run knows (arrays fit with `batch_size`, no static batch dimension) gets a
Python int count or None, never a tensor; the trainer checks the split itself
(issue 29, defect 8)."""

import keras
import pytest
import tensorflow as tf
from helpers import max_abs_diff, mlp, sparse_ce, toy_data

from keras_tpu_mem import GradientAccumulation


def _fit_arrays(callbacks, n=136, jit=False):
    """136 examples: batches of 32 and a last one of 8, so the batch dimension is not
    static (it would be with 128)."""
    x, y = toy_data(n)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=sparse_ce(), jit_compile=jit)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model


def _reference():
    return _fit_arrays([])


@pytest.mark.parametrize("callback", [GradientAccumulation(4),
                                      GradientAccumulation(micro_batch_size=8)],
                         ids=["steps", "micro_batch_size"])
def test_count_is_a_python_int_or_none_for_a_batch_only_the_run_knows(callback,
                                                                      monkeypatch):
    seen = []
    own = GradientAccumulation.micro_batches

    def recording(self, per_replica_batch):
        count = own(self, per_replica_batch)
        seen.append((per_replica_batch, count))
        return count

    monkeypatch.setattr(GradientAccumulation, "micro_batches", recording)
    model = _fit_arrays([callback])
    if callback.micro_batch_size is None:
        # (A fixed micro-batch size splits such a batch by `micro_batch_examples`.)
        assert any(batch is None for batch, _ in seen), "the batch size was static"
    for batch, count in seen:
        assert batch is None or type(batch) is int, batch
        assert count is None or type(count) is int, count
    # Still the full batch's update: the count was right.
    assert max_abs_diff(model.get_weights(), _reference().get_weights()) <= 1e-6


def test_hook_returns_ints():
    assert GradientAccumulation(4).micro_batches(None) == 4
    assert GradientAccumulation(micro_batch_size=8).micro_batches(None) is None
    assert GradientAccumulation(micro_batch_size=8).micro_batch_examples() == 8
    assert GradientAccumulation(4).micro_batch_examples() is None
    with pytest.raises(TypeError, match="`per_replica_batch` must be a Python int or None"):
        GradientAccumulation(4).micro_batches(tf.constant(32))


@pytest.mark.parametrize("jit", [False, True], ids=["default", "xla"])
def test_micro_batch_size_on_an_indivisible_last_batch_is_caught_at_run_time(jit):
    # 102 examples: batches of 32, 32, 32 and 6; 6 is not a multiple of 8.
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="micro_batch_size=8.*does not split evenly"):
        _fit_arrays([GradientAccumulation(micro_batch_size=8)], n=102, jit=jit)
