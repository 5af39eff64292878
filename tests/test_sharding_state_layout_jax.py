"""`model_state_layout` (`backends/jax/layout.py`): None only where the state
cannot be sharded (no distribution, no optimizer) or is not; state it cannot read
raises, so a sharded model never runs the unsharded step without a word (issue 29,
defect 3)."""

from __future__ import annotations

import keras
import pytest
from sharding_step_models import Sharded, small_mlp

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.backends.jax.layout import model_state_layout


def _sharded_model():
    model = small_mlp()
    model.optimizer.build(model.trainable_variables)
    return model


def test_none_without_a_distribution_or_an_optimizer():
    assert model_state_layout(_sharded_model()) is None  # no distribution
    with Sharded("all").scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
        assert getattr(model, "optimizer", None) is None  # never compiled
        assert model_state_layout(model) is None


def test_an_error_reading_the_shardings_is_raised_not_taken_for_unsharded(monkeypatch):
    with Sharded("all").scope():
        model = _sharded_model()
        assert model_state_layout(model) is not None

        def unreadable(model):
            raise RuntimeError("the shardings cannot be read")

        monkeypatch.setattr(jax_compat, "state_sharding_spec", unreadable)
        with pytest.raises(RuntimeError, match="the shardings cannot be read"):
            model_state_layout(model)


def test_values_purged_by_fit_raise_a_clear_error():
    with Sharded("all").scope():
        model = _sharded_model()
        variable = model.optimizer.variables[-1]
        # What Keras' JAX `fit` does to the variables while it holds their values.
        saved, variable._value = variable._value, None
        try:
            with pytest.raises(RuntimeError, match=variable.path):
                model_state_layout(model)
        finally:
            variable._value = saved
        assert model_state_layout(model) is not None
