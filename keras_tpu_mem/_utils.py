"""Small helpers shared by the package: the logger and argument checks."""

from __future__ import annotations

import logging
import numbers
import sys


class _UnconfiguredHandler(logging.StreamHandler):
    """Prints the package's lines on stderr only while the application has
    configured no logging of its own (the root logger has no handler).

    Users run this in notebooks where the root logger prints nothing below
    WARNING; our one-line notices (what the strategy picked, what a callback
    changed) are meant to be seen. Records still propagate: once the user
    configures logging (`logging.basicConfig`, a handler on the root logger),
    their handlers get every line and this one stays quiet, so that no line is
    printed twice. Silence the notices with
    logging.getLogger("keras_tpu_mem").setLevel(logging.WARNING).
    """

    def __init__(self):
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("keras_tpu_mem: %(message)s"))

    def emit(self, record):
        if logging.getLogger().handlers:
            return
        super().emit(record)


logger = logging.getLogger("keras_tpu_mem")
if not logger.handlers:
    logger.addHandler(_UnconfiguredHandler())
    # INFO, not the root's WARNING: the notices are the package's output.
    logger.setLevel(logging.INFO)


#: The keys of the notices `log_once` has logged in this process.
_LOGGED: set[str] = set()


def log_once(key: str, level: int, message: str, *args) -> None:
    """Logs `message % args` at `level` the first time `key` is seen in this process:
    a notice about the installation or the devices is said once, not once per fit."""
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    logger.log(level, message, *args)


def check_positive_int(value, name: str) -> int:
    """Returns `value` if it is an int >= 1 (bools refused), else raises naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int >= 1, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"`{name}` must be an int >= 1, got {value}.")
    return value


def check_non_negative_int(value, name: str) -> int:
    """Returns `value` as an int if it is an int >= 0 (numpy's too; bools refused), else
    raises a `TypeError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise TypeError(f"`{name}` must be a non-negative int, got {value!r}.")
    return int(value)


def unique(items) -> list:
    """`items` without repeats by identity (a shared layer's weights once), in order."""
    seen, out = set(), []
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out
