import subprocess
import sys

from keras_tpu_mem import cli


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
