"""device_notice on the JAX backend (precision.notice)."""

from __future__ import annotations

from helpers import make_distribution

from keras_tpu_mem.precision import device_notice


def test_device_notice_on_jax_cpu():
    notice = device_notice()
    assert notice is not None and notice.startswith("bfloat16 on CPU")
    assert device_notice(make_distribution("dp8")) == notice
