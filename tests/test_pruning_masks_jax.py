"""Pruning masks on JAX against the same numpy reference as on TensorFlow.

`test_pruning_masks.py` holds the test logic and the numpy reference; importing
its tests here runs them on the JAX backend (eagerly and under `jax.jit`), so
the JAX and TensorFlow masks for the same kernels and targets are identical
through that reference. Plus: the mask module imports no TensorFlow.
"""

from __future__ import annotations

import os
import subprocess
import sys

from test_pruning_masks import (  # noqa: F401  (collected here, on JAX)
    test_apply_mask_writes_exact_zeros_over_non_finite_values,
    test_bfloat16_weights_give_the_float32_mask_of_their_values,
    test_block_mask_equals_numpy,
    test_keep_count_rounds_half_to_even_like_tfmot,
    test_kth_largest_is_exact_with_ties_zeros_and_denormals,
    test_m_by_n_mask_equals_numpy,
    test_magnitude_mask_equals_numpy,
    test_smallest_kept_is_the_threshold,
    test_two_by_four_leaves_two_zeros_in_every_group_of_four,
)


def test_backend_is_jax():
    import keras

    assert keras.backend.backend() == "jax"


def test_importing_masks_and_schedules_imports_no_tensorflow():
    code = (
        "import sys, keras_tpu_mem.pruning.masks, keras_tpu_mem.pruning.schedules\n"
        "import keras_tpu_mem.distillation\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow')\n"
        "assert not bad, bad\n"
        "print('OK')\n"
    )
    env = dict(os.environ, KERAS_BACKEND="jax")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
