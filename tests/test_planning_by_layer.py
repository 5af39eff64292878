"""`CompiledMemory.by_layer()` on TensorFlow: not built yet, a clear error naming JAX
(the JAX twin, test_planning_by_layer_jax.py, tests the table)."""

from __future__ import annotations

import pytest
from planning_models import digits_mlp

from keras_tpu_mem.planning import compiled_memory


def test_by_layer_names_the_jax_backend():
    result = compiled_memory(digits_mlp(), 32, hlo_text=False)
    with pytest.raises(NotImplementedError, match="KERAS_BACKEND=jax"):
        result.by_layer()
