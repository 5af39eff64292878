"""The command line: parses before any framework loads, stays quiet, shows plan progress.

Also the package's lazy loading, which is what lets `python -m keras_tpu_mem.cli`
(it runs the package's `__init__` first) answer without TensorFlow.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import keras_tpu_mem as ktm
from keras_tpu_mem import cli

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("tensorflow", "jax", "keras")
# A native (absl / glog) log line, "I0000 00:00:1796117285.069683  14889 port.cc:153] ...",
# or the line absl prints before its logging is initialised.
NATIVE_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d|absl::InitializeLog", re.MULTILINE)


def _env(**extra):
    env = dict(os.environ)
    # Nothing the user might have set that would change what is checked here.
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _python(*args, env=None, cwd=None):
    # The timeout only guards against a hang; nothing asserts on time.
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=env or _env(), cwd=cwd, timeout=600)


def _imported_modules(importtime_stderr: str) -> set[str]:
    """Top-level names of the modules `python -X importtime` reports as imported."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            module = line.rsplit("|", 1)[1].strip()
            if module and module != "imported package":
                names.add(module.split(".")[0])
    return names


def _console_script() -> list[str]:
    """`keras-tpu-mem` as installed next to this interpreter, else the module."""
    script = shutil.which("keras-tpu-mem", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "keras_tpu_mem.cli"]


# ------------------------------------------------------------ framework-free
def test_help_prints_usage_and_imports_no_framework():
    result = _python("-X", "importtime", "-m", "keras_tpu_mem.cli", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: keras-tpu-mem" in result.stdout
    for command in ("devices", "report", "plan", "checkpoints"):
        assert command in result.stdout
    imported = _imported_modules(result.stderr)
    assert "keras_tpu_mem" in imported  # the check itself sees imports
    assert not imported & set(FRAMEWORKS), sorted(imported & set(FRAMEWORKS))


def test_checkpoints_lists_a_directory_without_a_framework(tmp_path):
    """`keras-tpu-mem checkpoints DIR`: one row per complete checkpoint, the one a
    restart resumes from marked, and the folder a restart would skip named."""
    import numpy as np

    from keras_tpu_mem.resume import store

    for update, epoch, batch in ((5, 0, 5), (10, 1, 0)):
        store.write_checkpoint(str(tmp_path), update, {"model": [("w", np.zeros(4096, "f4"))]},
                               {"epoch": epoch, "batch": batch})
    (tmp_path / ".partial-update-000000015").mkdir()
    result = _python("-X", "importtime", "-m", "keras_tpu_mem.cli", "checkpoints", str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0][-3:] == ["2", "complete", "checkpoint(s)"]
    assert rows[1] == ["update", "epoch", "batch", "size", "age"]
    assert rows[2][:3] == ["5", "1", "5"] and rows[3][:3] == ["10", "2", "0"]
    assert rows[2][3:5] == ["16.00", "KiB"]  # 4,096 float32s: a small state in its unit
    assert "resumes here" in result.stdout.splitlines()[3]
    assert "skipped:" in result.stdout and ".partial-update-000000015" in result.stdout
    imported = _imported_modules(result.stderr)
    assert not imported & set(FRAMEWORKS), sorted(imported & set(FRAMEWORKS))
    missing = _python("-m", "keras_tpu_mem.cli", "checkpoints", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "no_colon_here", "--global-batch", "8"], "argument --model"),
    (["plan", "--model", "m.py:build", "--global-batch", "8", "--compile-batches", "1,x"],
     "argument --compile-batches"),
    (["plan", "--model", "m.py:build", "--global-batch", "eight"], "argument --global-batch"),
    (["nonsense"], "invalid choice"),
])
def test_usage_errors_answer_without_a_framework(argv, message):
    result = _python("-X", "importtime", "-m", "keras_tpu_mem.cli", *argv)
    assert result.returncode == 2
    assert message in result.stderr
    assert "usage: keras-tpu-mem" in result.stderr
    assert not _imported_modules(result.stderr) & set(FRAMEWORKS)


def test_main_returns_argparse_status_instead_of_exiting(capsys):
    assert cli.main(["--help"]) == 0
    assert "usage: keras-tpu-mem" in capsys.readouterr().out
    assert cli.main(["plan", "--model", "no_colon", "--global-batch", "8"]) == 2
    assert "must be MODULE:FUNCTION" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], []], ids=["help", "bare"])
def test_console_script_prints_no_framework_log_lines(argv):
    result = subprocess.run(_console_script() + argv, capture_output=True, text=True,
                            env=_env(), timeout=600)
    assert result.returncode == (0 if argv else 2)
    assert "usage: keras-tpu-mem" in result.stdout + result.stderr
    assert not NATIVE_LOG_LINE.search(result.stdout + result.stderr)
    assert "tensorflow" not in (result.stdout + result.stderr).lower()


def test_devices_keeps_tensorflow_start_up_lines_out_of_its_output():
    # This one does load TensorFlow, with no TF_CPP_MIN_LOG_LEVEL of the user's.
    result = _python("-m", "keras_tpu_mem.cli", "devices")
    assert result.returncode == 0, result.stderr
    assert "strategy:" in result.stdout
    assert not NATIVE_LOG_LINE.search(result.stdout + result.stderr), result.stderr


# ------------------------------------------------------------ quiet defaults
def test_quiet_env_sets_only_what_the_user_left_unset():
    environ = {}
    assert cli.quiet_framework_env(environ) is True
    assert environ == {"TF_CPP_MIN_LOG_LEVEL": "3"}

    environ = {"TF_CPP_MIN_LOG_LEVEL": "0"}  # the user wants every log line
    assert cli.quiet_framework_env(environ) is False
    assert environ == {"TF_CPP_MIN_LOG_LEVEL": "0"}


def test_quiet_env_leaves_a_process_with_a_framework_loaded_alone(monkeypatch):
    # The test process has TensorFlow loaded: setting variables now would change
    # nothing but the environment of this process.
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    assert cli.quiet_framework_env() is False
    assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ


def test_held_native_output_is_dropped_when_loading_succeeds(capfd):
    with cli._native_stderr_held():
        os.write(2, b"noise from a shared library\n")
    os.write(2, b"after the load\n")
    err = capfd.readouterr().err
    assert "noise from a shared library" not in err
    assert "after the load" in err


def test_held_native_output_is_replayed_when_loading_fails(capfd):
    with pytest.raises(RuntimeError, match="load failed"), cli._native_stderr_held():
        os.write(2, b"the library says why\n")
        raise RuntimeError("load failed")
    assert "the library says why" in capfd.readouterr().err


# ------------------------------------------------------------------ commands
def test_devices_command_prints_strategy(capsys):
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "strategy:" in out and "replicas:  1" in out and "CPU:0" in out


def test_devices_command_bad_input_is_an_error_not_a_traceback(capsys):
    assert cli.main(["devices", "--logical-cpus", "0"]) == 2
    assert "logical_cpus" in capsys.readouterr().err


def test_console_script_installed():
    out = subprocess.run([sys.executable, "-m", "keras_tpu_mem.cli", "--help"],
                         capture_output=True, text=True, check=True)
    assert "devices" in out.stdout


_TINY_MODEL = textwrap.dedent("""
    import keras

    def build():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32),
                                  keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss="mse")
        return model
""")


def test_plan_command_reports_each_compile_and_prints_the_same_plan(tmp_path, capsys):
    path = tmp_path / "tiny_model.py"
    path.write_text(_TINY_MODEL)
    argv = ["plan", "--model", f"{path}:build", "--global-batch", "8", "--device", "1GiB",
            "--compile-batches", "1,2"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    progress = [line.removeprefix("keras-tpu-mem plan: ") for line in captured.err.splitlines()
                if line.startswith("keras-tpu-mem plan: ")]
    assert progress[0] == f"building the model from {path}:build ..."
    expected = [
        r"\[1/2\] compiling the train step with XLA at batch 1 \.\.\.",
        r"\[1/2\] compiled in \d+\.\d s",  # the time itself varies
        r"\[2/2\] compiling the train step with XLA at batch 2 \.\.\.",
        r"\[2/2\] compiled in \d+\.\d s",
    ]
    assert len(progress) == 1 + len(expected), progress
    for line, pattern in zip(progress[1:], expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    # Progress goes to stderr; stdout is exactly the plan, as the API gives it.
    namespace = {}
    exec(_TINY_MODEL, namespace)
    plan = ktm.plan(namespace["build"](), 8, device="1GiB", compile_batches=[1, 2])
    assert captured.out == str(plan) + "\n"


def test_plan_progress_callback_is_called_around_every_compile():
    namespace = {}
    exec(_TINY_MODEL, namespace)
    calls = []
    ktm.plan(namespace["build"](), 8, device="1GiB", compile_batches=[2, 1],
             progress=lambda *args: calls.append(args))
    assert calls == [(0, 2, 1), (1, 2, 2), (2, 2, None)]
    with pytest.raises(TypeError, match="progress"):
        ktm.plan(namespace["build"](), 8, device="1GiB", progress="yes")


# ------------------------------------------------------------- lazy package
def test_import_loads_no_framework_and_dir_lists_every_public_name():
    code = textwrap.dedent("""
        import sys
        import keras_tpu_mem as ktm
        loaded = [m for m in ("tensorflow", "jax", "keras") if m in sys.modules]
        missing = sorted(set(ktm.__all__) - set(dir(ktm)))
        print(loaded, missing, ktm.__version__)
    """)
    result = _python("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "[]", ktm.__version__]


def test_every_public_name_resolves_to_its_module():
    import importlib

    for name in ktm.__all__:
        module = importlib.import_module(f"keras_tpu_mem.{ktm._EXPORTS[name]}")
        assert getattr(ktm, name) is getattr(module, name), name
    assert ktm.planning.plan is ktm.plan  # submodules stay attributes of the package
    with pytest.raises(AttributeError, match="no_such_name"):
        ktm.no_such_name  # noqa: B018


_NO_TENSORFLOW = textwrap.dedent("""
    import importlib.abc, sys

    class NoTensorFlow(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "tensorflow":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTensorFlow())
""")


def test_package_imports_with_jax_backend_and_no_tensorflow():
    code = _NO_TENSORFLOW + textwrap.dedent("""
        import keras_tpu_mem as ktm
        print(ktm.lookup_tpu("v3").hbm_bytes_per_replica, sorted(ktm.HBM_TABLE)[0])
        print([m for m in ("tensorflow", "keras") if m in sys.modules])
    """)
    result = _python("-c", code, env=_env(KERAS_BACKEND="jax"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(16 * 2**30), "v2", "[]"]


def test_a_name_that_needs_tensorflow_says_how_to_install_it():
    code = _NO_TENSORFLOW + textwrap.dedent("""
        import keras_tpu_mem as ktm
        try:
            ktm.GradientAccumulation
        except ImportError as err:
            print("ImportError:", err)
    """)
    result = _python("-c", code, env=_env(KERAS_BACKEND="tensorflow"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "ImportError: keras_tpu_mem.GradientAccumulation needs TensorFlow, which is not "
        "installed."), result.stdout
    assert "pip install keras-tpu-mem[tensorflow]" in result.stdout


def test_plan_by_layer_prints_the_whole_table_after_the_plan(tmp_path, capsys):
    """An estimate (no --search on TensorFlow) has no table of its own: --by-layer
    compiles the largest batch it compiled once more; with --search it is the plan's."""
    path = tmp_path / "tiny_model.py"
    path.write_text(_TINY_MODEL)
    namespace = {}
    exec(_TINY_MODEL, namespace)
    argv = ["plan", "--model", f"{path}:build", "--global-batch", "8", "--device", "1GiB",
            "--compile-batches", "1,2", "--by-layer"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    plan_text, _, table_text = out.partition("\n\nMemory by layer of ")
    assert plan_text.startswith("Memory plan on 1 GiB")
    assert table_text.startswith("the model's train step at per-replica batch 2")
    # The same numbers as the API's table for a model from the same factory (layer
    # names differ between the two models: Keras numbers them per process).
    table = ktm.compiled_memory(namespace["build"](), 2, hlo_text=False).by_layer()
    lines = table_text.rstrip("\n").splitlines()
    assert lines[1] == str(table).splitlines()[0]
    assert len(lines) == 1 + 2 + len(table)  # what, head, columns, every row

    argv = ["plan", "--model", f"{path}:build", "--global-batch", "8", "--device", "1GiB",
            "--search", "--by-layer"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    planned = ktm.plan(namespace["build"](), 8, device="1GiB", search=True)
    plan_text, _, table_text = out.partition("\n\nMemory by layer of ")
    assert "memory by layer of " in plan_text  # the plan's own five rows
    assert table_text.startswith(planned.by_layer_of + ":\n")
    lines = table_text.rstrip("\n").splitlines()
    assert lines[1] == str(planned.by_layer).splitlines()[0]
    assert len(lines) == 1 + 2 + len(planned.by_layer)
