"""`tests/run_backends.py`, the one test command for both backends (run from the JAX
pass; it imports no framework itself)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import run_backends  # noqa: E402


@pytest.mark.parametrize("line,expected", [
    ("15 passed in 103.95s (0:01:43)", {"passed": 15}),
    ("==== 1 failed, 12 passed, 2 skipped, 3 warnings in 53.83s ====",
     {"failed": 1, "passed": 12, "skipped": 2, "warnings": 3}),
    ("1 error in 0.50s", {"errors": 1}),
    ("no tests ran in 0.01s", {}),
    ("3 failed, 17 passed, 2 deselected", {"failed": 3, "passed": 17, "deselected": 2}),
])
def test_parse_summary(line, expected):
    assert run_backends.parse_summary(f"some output\n{line}\n") == expected


def test_combined_line():
    runs = [{"passed": 3, "skipped": 1}, {"passed": 2, "failed": 1, "errors": 1}]
    assert run_backends.combined_line(runs) == "5 passed, 2 failed, 1 skipped"
    assert run_backends.combined_line([{"passed": 4}]) == "4 passed, 0 failed"


def _write(tmp_path, body):
    path = tmp_path / "test_sample.py"
    path.write_text(body)
    return str(path)


def test_runs_forwards_arguments_and_prints_the_combined_line(tmp_path, capsys):
    path = _write(tmp_path, "def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    assert run_backends.main(["--backends", "jax", path, "-k", "test_a"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "1 passed, 0 failed"
    assert any(line.startswith("run_backends: jax: 1 passed, 0 failed") for line in lines)


def test_a_failure_or_an_empty_collection_fails_the_run(tmp_path, capsys):
    failing = _write(tmp_path, "def test_a():\n    assert False\n")
    assert run_backends.main(["--backends", "jax", failing]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == "0 passed, 1 failed"
    empty = _write(tmp_path, "x = 1\n")
    assert run_backends.main(["--backends", "jax", empty]) == 1
    assert "collected no test" in capsys.readouterr().out


def test_a_backend_without_its_framework_is_skipped_with_a_notice(tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setattr(run_backends, "installed", lambda backend: backend != "tensorflow")
    path = _write(tmp_path, "def test_a():\n    pass\n")
    assert run_backends.main([path]) == 0
    out = capsys.readouterr().out
    assert "run_backends: skipping the tensorflow backend: tensorflow is not installed" in out
    assert out.strip().splitlines()[-1] == "1 passed, 0 failed"
    # Nothing at all could run: that is a failure, not a pass.
    assert run_backends.main(["--backends", "tensorflow", path]) == 1
    assert "no backend could run" in capsys.readouterr().out


_IN_A_WORKER = ("import os\n\ndef test_a():\n"
                "    assert os.environ.get('PYTEST_XDIST_WORKER', '').startswith('gw') is {}\n")


@pytest.mark.parametrize("workers,in_a_worker", [("2", True), ("1", False)])
def test_workers_run_each_backend_in_pytest_xdist_processes(tmp_path, capsys, workers,
                                                            in_a_worker):
    path = _write(tmp_path, _IN_A_WORKER.format(in_a_worker))
    assert run_backends.main(["--backends", "jax", "--workers", workers, path]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "1 passed, 0 failed"


def test_the_callers_own_xdist_arguments_win():
    assert run_backends.xdist_args(2, ["-x"]) == ["-n", "2", "--dist", "loadfile"]
    for own in (["-n", "4"], ["-n4"], ["--numprocesses=3"], ["-p", "no:xdist"],
                ["--dist", "load"]):
        assert run_backends.xdist_args(2, own) == []
    assert run_backends.xdist_args(1, []) == []


def test_workers_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        run_backends.main(["--workers", "0"])
    assert "--workers must be a positive integer, got 0" in capsys.readouterr().err
