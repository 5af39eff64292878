"""MixedBFloat16's plan line ("MixedBFloat16: N layers compute in bfloat16 ...") is
logged by a real `fit`, not by the planner's compiles of the engine's step
(engine/compile.py `compile_context`).

Backend-neutral: collected on TensorFlow here, on JAX through
`test_precision_planning_quiet_jax.py`.
"""

from __future__ import annotations

import logging

import keras
import numpy as np

import keras_tpu_mem as ktm

PLAN_LINE = "MixedBFloat16: "


def _plan_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "keras_tpu_mem" and r.getMessage().startswith(PLAN_LINE)]


def test_mixed_bfloat16_logs_its_plan_in_fit_not_while_planning(caplog):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(32, activation="relu", name="hidden"),
                              keras.layers.Dense(4, name="head")])
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    caplog.set_level(logging.INFO, logger="keras_tpu_mem")

    # Planning: the engine's step for the callback is compiled (installed and
    # uninstalled inside compile_context) without a fit.
    ktm.compiled_memory(model, 8, callbacks=[ktm.MixedBFloat16()])
    planned = ktm.plan(model, 16, device="16GiB", callbacks=[ktm.MixedBFloat16()])
    assert planned.features == ("MixedBFloat16",)
    assert _plan_lines(caplog) == []
    assert model.layers[0].compute_dtype == "float32"  # planning left the model as it was

    # A real fit still says which layers compute in bfloat16, once.
    caplog.clear()
    x = np.random.default_rng(0).random((32, 16), dtype="float32")
    y = np.random.default_rng(1).integers(0, 4, 32)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[ktm.MixedBFloat16()])
    lines = _plan_lines(caplog)
    assert len(lines) == 1, lines
    assert "bfloat16" in lines[0]
