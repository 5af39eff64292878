"""device_notice: what bfloat16 means on the devices that run (notice.notice)."""

from __future__ import annotations

import logging

from precision_models import BATCH, compiled, digits_mlp

from keras_tpu_mem import _utils
from keras_tpu_mem.precision import MixedBFloat16, notice


def test_device_notice_once_on_cpu(digits, monkeypatch):
    (x, y), _ = digits
    monkeypatch.setattr(_utils, "_LOGGED", set())
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    _utils.logger.addHandler(handler)
    try:
        for _ in range(2):
            model = compiled(digits_mlp())
            model.fit(x[:BATCH], y[:BATCH], epochs=1, verbose=0, callbacks=[MixedBFloat16()])
    finally:
        _utils.logger.removeHandler(handler)
    notices = [r.getMessage() for r in records if "bfloat16 on CPU" in r.getMessage()]
    assert len(notices) == 1
    summaries = [r.getMessage() for r in records if r.getMessage().startswith("MixedBFloat16:")]
    assert len(summaries) == 2 and "logits (output, bfloat16 backward)" in summaries[0]


def test_device_notice_texts(monkeypatch):
    monkeypatch.setattr(notice, "_cpu_bf16_flags", lambda: [])
    assert "no bfloat16 instructions" in notice.device_notice()
    monkeypatch.setattr(notice, "_cpu_bf16_flags", lambda: ["amx_bf16"])
    assert "amx_bf16" in notice.device_notice()
    monkeypatch.setattr(notice.devices, "device_platform", lambda device: "TPU")
    assert notice.device_notice() is None
