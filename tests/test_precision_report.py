"""precision_report: every layer's dtypes, the risky spots flagged (precision.report)."""

from __future__ import annotations

import keras
import numpy as np
from precision_models import BATCH, Subclassed, compiled, digits_mlp

from keras_tpu_mem.precision import (
    MixedBFloat16,
    enable_mixed_bfloat16,
    precision_report,
    to_mixed_bfloat16,
)


def test_report_flags_bf16_logits_softmax_and_global_policy():
    enable_mixed_bfloat16()
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="h"),
                              keras.layers.Dense(4, activation="softmax", name="probs")])
    keras.config.set_dtype_policy("float32")
    report = precision_report(model)
    rows = {row.path.split("/")[-1]: row for row in report.rows}
    assert rows["h"].compute_dtype == "bfloat16" and rows["h"].variable_dtype == "float32"
    assert rows["probs"].role == "output"
    flags = " | ".join(rows["probs"].flags)
    assert "bfloat16 logits feed the loss" in flags
    assert "softmax in bfloat16" in flags
    assert "differs from the global 'float32'" in flags
    assert [row.path.split("/")[-1] for row in report.flagged] == ["h", "probs"]
    text = str(report)
    assert "global policy: float32" in text and "! softmax in bfloat16" in text
    # Converted, the logits are float32: no logits flag left.
    fixed = precision_report(to_mixed_bfloat16(model))
    assert not any("logits" in flag for row in fixed.rows for flag in row.flags)


def test_report_float16_without_loss_scaling_and_subclassed_note():
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(8, dtype="mixed_float16", name="h"),
                              keras.layers.Dense(4, dtype="float32", name="out")])
    model.compile(optimizer="adam", loss="mse")
    row = next(r for r in precision_report(model).rows if r.path.endswith("/h"))
    assert any("without a LossScaleOptimizer" in flag for flag in row.flags)
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
                  loss="mse")
    row = next(r for r in precision_report(model).rows if r.path.endswith("/h"))
    assert not any("LossScaleOptimizer" in flag for flag in row.flags)
    sub = Subclassed()
    sub(np.ones((1, 64), "float32"))
    report = precision_report(sub)
    assert report.notes and "subclassed" in report.notes[0]


def test_report_during_fit_shows_the_bfloat16_backward_output(digits):
    (x, y), _ = digits

    class Report(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.report = precision_report(self.model)

    seen = Report()
    model = compiled(digits_mlp())
    model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0, callbacks=[MixedBFloat16(), seen])
    rows = {row.path.split("/")[-1]: row for row in seen.report.rows}
    assert rows["logits"].role == "output (bfloat16 backward)"
    assert rows["hidden_1"].compute_dtype == "bfloat16"
    assert precision_report(model).rows[-1].role == "output"
