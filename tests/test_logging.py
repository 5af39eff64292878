"""The package logger: its lines reach the user's logging configuration, and are
printed on their own only while the application configured none."""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys

import keras_tpu_mem._utils as utils

_UTILS = pathlib.Path(utils.__file__)


def _run(body: str) -> str:
    """stderr of a fresh interpreter that loads `_utils` alone (no framework) and runs
    `body` with the package logger as `logger`."""
    script = (
        "import importlib.util, logging\n"
        f"spec = importlib.util.spec_from_file_location('ktm_utils', {str(_UTILS)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "logger = module.logger\n" + body)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, check=True)
    return result.stderr


def test_records_propagate_to_the_users_handlers():
    records = []

    class _Users(logging.Handler):
        def emit(self, record):
            records.append(record)

    root = logging.getLogger()
    handler = _Users(level=logging.INFO)
    root.addHandler(handler)
    try:
        utils.logger.info("the strategy picked one CPU")
    finally:
        root.removeHandler(handler)
    assert [(r.name, r.getMessage()) for r in records] == [
        ("keras_tpu_mem", "the strategy picked one CPU")]


def test_unconfigured_application_still_sees_the_notices():
    assert _run("logger.info('hello')\n").splitlines() == ["keras_tpu_mem: hello"]


def test_configured_application_gets_each_line_once_in_its_own_format():
    err = _run("logging.basicConfig(format='USER %(name)s %(message)s')\n"
               "logger.info('hello')\n")
    assert err.splitlines() == ["USER keras_tpu_mem hello"]


def test_level_can_still_silence_the_notices():
    err = _run("logger.setLevel(logging.WARNING)\nlogger.info('hello')\n")
    assert err == ""
