"""Runs the test suite once per Keras backend: `python tests/run_backends.py [pytest args]`.

Keras reads `KERAS_BACKEND` once, when it is imported, so each backend gets its
own `python -m pytest -q tests` process with `KERAS_BACKEND` set
(`tests/conftest.py` then collects that backend's modules: `*_jax.py` on JAX,
the others on TensorFlow). A backend whose framework is not installed is
skipped with a one-line notice. Extra arguments go to every pytest run (`-x`,
`-k expr`, test paths); `--backends jax` (or `tensorflow,jax`) picks backends.

Each backend's tests run in `--workers` pytest-xdist processes (default 2, 1
where the machine has one core or pytest-xdist is not installed), a test file
whole in one worker (`--dist loadfile`: a module's fixtures are built once).
Measured on CI's 2 cores: the TensorFlow suite without `slow` in 370 s against
about 545 s in one process. `--workers 1` runs one process, as plain pytest.

The package is imported the way a user's script imports it: never from the
checkout's folder by accident (pytest runs with `PYTHONSAFEPATH=1`, so the
current directory is not put first on `sys.path`), and the first line names
where `keras_tpu_mem` comes from — the installed wheel after the README's
`pip install dist/...whl`, the checkout after `pip install -e .`.

The last line is the combined count, `N passed, N failed` (`, N skipped` when
some were skipped); failures include pytest's errors. The exit status is
non-zero when any run fails, a run collects no test, or no backend could run.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import time

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent

#: Backend -> (module that must be importable, how to install it).
BACKENDS = {
    "tensorflow": ("tensorflow", 'pip install -e ".[tensorflow,test]"'),
    "jax": ("jax", 'pip install -e ".[jax,test]"'),
}

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|"
                    r"warnings?)")


def parse_summary(output: str) -> dict[str, int]:
    """Counts from pytest's last summary line (`3 passed, 1 skipped in 2.0s`)."""
    for line in reversed(output.strip().splitlines()):
        line = line.strip().strip("=").strip()
        # `-qq` drops the duration: a line of counts alone counts too.
        timed = re.search(r"\bin [\d.]+s\b", line)
        if (timed or re.fullmatch(r"\d+ \w+(, \d+ \w+)*", line)) and _COUNT.search(line):
            counts: dict[str, int] = {}
            for number, kind in _COUNT.findall(line):
                kind = {"error": "errors", "warning": "warnings"}.get(kind, kind)
                counts[kind] = counts.get(kind, 0) + int(number)
            return counts
        if line.startswith("no tests ran"):
            return {}
    return {}


def combined_line(runs: list[dict[str, int]]) -> str:
    """`N passed, N failed[, N skipped]` over all runs (errors count as failed)."""
    passed = sum(r.get("passed", 0) for r in runs)
    failed = sum(r.get("failed", 0) + r.get("errors", 0) for r in runs)
    skipped = sum(r.get("skipped", 0) for r in runs)
    line = f"{passed} passed, {failed} failed"
    return f"{line}, {skipped} skipped" if skipped else line


def _shared_files() -> frozenset[str]:
    """`BOTH_BACKENDS` of tests/conftest.py, read from its source (importing conftest
    would set a backend up)."""
    tree = ast.parse((TESTS / "conftest.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == "BOTH_BACKENDS"):
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


def backend_of(path: str) -> str | None:
    """The backend a test file of this suite belongs to (None for a folder, a file
    outside tests/ or a file conftest shares with both backends: both)."""
    file = pathlib.Path(path.split("::")[0]).resolve()
    if file.is_dir() or TESTS not in file.parents or file.name in _shared_files():
        return None
    return "jax" if file.stem.endswith("_jax") else "tensorflow"


def installed(backend: str) -> bool:
    return importlib.util.find_spec(BACKENDS[backend][0]) is not None


def xdist_args(workers: int, pytest_args: list[str]) -> list[str]:
    """pytest-xdist's arguments for `workers` processes: none for one worker, where
    pytest-xdist is not installed, or where the caller chose its own (`-n`, `-p no:xdist`)."""
    chosen = any(a.startswith(("-n", "--numprocesses", "--dist"))
                 or a == "no:xdist" for a in pytest_args)
    if workers <= 1 or chosen or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(workers), "--dist", "loadfile"]


def default_workers() -> int:
    """2 pytest workers, 1 on a one-core machine: no more, so a big machine's run
    holds as much memory as CI's (each worker imports the framework and Keras)."""
    return min(2, os.cpu_count() or 1)


def run_backend(backend: str, pytest_args: list[str], workers: int = 1) -> tuple[int, str]:
    """Runs pytest for one backend, echoing its output; returns (exit code, output).

    Test files named in `pytest_args` go to their own backend only (`*_jax.py` to
    JAX, the files conftest shares to both, other modules to TensorFlow; pytest
    would collect a named file whatever conftest ignores); a backend left with none
    of the named files is not run
    (exit code 5, "no tests ran")."""
    paths = [a for a in pytest_args
             if not a.startswith("-") and pathlib.Path(a.split("::")[0]).exists()]
    mine = [a for a in paths if backend_of(a) in (None, backend)]
    if paths and not mine:
        return 5, "no tests ran in 0.00s\n"
    rest = [a for a in pytest_args if a not in paths]
    command = [sys.executable, "-m", "pytest", "-q", *xdist_args(workers, pytest_args),
               *(mine or [str(TESTS)]), *rest]
    env = _environment(backend)
    chunks = []
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as process:
        # Character by character: pytest -q's progress dots have no newline.
        for chunk in iter(lambda: process.stdout.read(1), ""):
            sys.stdout.write(chunk)
            sys.stdout.flush()
            chunks.append(chunk)
    return process.returncode, "".join(chunks)


def _environment(backend: str) -> dict[str, str]:
    # PYTHONSAFEPATH (Python >= 3.11): `python -m pytest` does not put the current
    # directory (the checkout) first on sys.path, so an installed wheel is what runs.
    # Without an outer pytest-xdist run's worker variables: a run started from a test
    # (tests/test_run_backends_jax.py) is not that worker.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    return dict(env, KERAS_BACKEND=backend, PYTHONSAFEPATH="1")


def package_location() -> str:
    """Where the tests will import keras_tpu_mem from (a folder), as pytest will see it."""
    done = subprocess.run(
        [sys.executable, "-c", "import keras_tpu_mem, os; "
         "print(os.path.dirname(keras_tpu_mem.__file__))"],
        cwd=ROOT, env=_environment("jax"), capture_output=True, text=True)
    return done.stdout.strip() or f"nowhere: {done.stderr.strip().splitlines()[-1:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], allow_abbrev=False,
        epilog="Every other argument is passed to pytest.")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated backends to run (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=default_workers(),
                        help="pytest-xdist processes per backend (default: %(default)s; "
                             "1: one pytest process)")
    args, pytest_args = parser.parse_known_args(argv)
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in wanted if b not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; known: {', '.join(BACKENDS)}")
    if args.workers < 1:
        parser.error(f"--workers must be a positive integer, got {args.workers}")

    print(f"run_backends: testing keras_tpu_mem from {package_location()}", flush=True)
    runs, summaries, failed = [], [], False
    for backend in wanted:
        if not installed(backend):
            module, how = BACKENDS[backend]
            print(f"run_backends: skipping the {backend} backend: {module} is not "
                  f"installed ({how})", flush=True)
            summaries.append(f"{backend}: skipped ({module} not installed)")
            continue
        print(f"run_backends: KERAS_BACKEND={backend} python -m pytest -q ...", flush=True)
        start = time.monotonic()
        code, output = run_backend(backend, pytest_args, args.workers)
        if code == 5 and output.startswith("no tests ran in 0.00s"):
            summaries.append(f"{backend}: none of the named test files is its")
            continue
        counts = parse_summary(output)
        ran = sum(counts.get(k, 0) for k in ("passed", "failed", "errors", "skipped",
                                              "xfailed", "xpassed"))
        status = "ok"
        if code == 5 or not ran:
            status, failed = "collected no test", True
        elif code != 0:
            status, failed = f"pytest exit status {code}", True
        runs.append(counts)
        summaries.append(f"{backend}: {combined_line([counts])} in "
                         f"{time.monotonic() - start:.0f}s ({status})")
    if not runs:
        print("run_backends: no backend could run: install TensorFlow or JAX", flush=True)
        failed = True
    print()
    for summary in summaries:
        print(f"run_backends: {summary}")
    print(combined_line(runs))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
