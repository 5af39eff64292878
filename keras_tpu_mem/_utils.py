"""Small helpers shared by the package: the logger and argument checks."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("keras_tpu_mem")
if not logger.handlers:
    # Users run this in notebooks where the root logger prints nothing below
    # WARNING; our one-line notices (what the strategy picked, what a callback
    # changed) are meant to be seen. Silence them with
    # logging.getLogger("keras_tpu_mem").setLevel(logging.WARNING).
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("keras_tpu_mem: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def check_positive_int(value, name: str) -> int:
    """Returns `value` if it is an int >= 1 (bools refused), else raises naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int >= 1, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value}.")
    return value


def unique(items) -> list:
    """`items` without repeats by identity (a shared layer's weights once), in order."""
    seen, out = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out
