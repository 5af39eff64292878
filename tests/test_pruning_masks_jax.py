"""Pruning masks on JAX only: the mask module imports no TensorFlow (a JAX
install has none). The masks themselves are checked against the numpy reference
on both backends by `test_pruning_masks.py` (conftest's BOTH_BACKENDS)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_backend_is_jax():
    import keras

    assert keras.backend.backend() == "jax"


@pytest.mark.slow  # a fresh process; it proves most with TensorFlow installed
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
