"""The examples run as a newcomer runs them: as scripts, in a fresh process each.

Small `--epochs` / `--seeds` keep them quick; the claims checked are the ones
the README and docs make about their output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Each test runs an example as a script for tens of seconds: the keras-nightly CI
# line deselects them (`-m "not slow"`); the full lines run them.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ACCURACY_LINE = re.compile(r"^(?P<who>.*?(distilled|alone).*?):\s+(?P<mean>[01]\.\d{4}) ± "
                           r"(?P<spread>[01]\.\d{4})", re.MULTILINE)
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) - (.*)$", re.MULTILINE)


def run_example(name, *args, cwd, backend="tensorflow"):
    env = dict(os.environ)
    env["KERAS_BACKEND"] = backend
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # The timeout only guards against a hang; nothing asserts on time.
    return subprocess.run([sys.executable, str(EXAMPLES / name), *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=900)


def accuracies(stdout: str) -> dict[str, tuple[float, float]]:
    """{"distilled": (mean, spread), "alone": (mean, spread)} from the example's lines."""
    found = {}
    for match in ACCURACY_LINE.finditer(stdout):
        key = "distilled" if "distilled" in match.group("who") else "alone"
        assert key not in found, f"two {key} lines in:\n{stdout}"
        found[key] = (float(match.group("mean")), float(match.group("spread")))
    assert set(found) == {"distilled", "alone"}, stdout
    return found


def significant_digits(text: str) -> int:
    digits = text.replace(",", "").lstrip("-").replace(".", "").lstrip("0")
    return len(digits)


@pytest.fixture(scope="module")
def distilled_run(tmp_path_factory):
    """One short run of distill_digits.py that also saves its teacher."""
    folder = tmp_path_factory.mktemp("distill")
    teacher = folder / "teacher.keras"
    # 100 labels and 12 epochs: a shorter run than the default (200 labels, 30
    # epochs, 5 seeds) with the same conclusion and a wide margin.
    result = run_example("distill_digits.py", "--seeds", 3, "--epochs", 12, "--labels", 100,
                         "--save-teacher", teacher, cwd=folder)
    assert result.returncode == 0, result.stderr[-4000:]
    return result, teacher


def test_distilled_student_beats_the_student_alone_by_more_than_the_spread(distilled_run):
    result, _ = distilled_run
    found = accuracies(result.stdout)
    (d_mean, d_spread), (a_mean, a_spread) = found["distilled"], found["alone"]
    assert d_mean - a_mean > max(d_spread, a_spread), found
    teacher = re.search(r"^teacher .*validation accuracy (0\.\d{4})$", result.stdout, re.M)
    assert teacher and float(teacher.group(1)) > 0.9, result.stdout
    assert "over 3 seeds" in result.stdout


def test_saved_teacher_drives_the_quickstart_distillation(distilled_run, tmp_path):
    result, teacher = distilled_run
    assert teacher.is_file() and f"teacher saved to {teacher}" in result.stdout
    quick = run_example("quickstart.py", "--distill-from", teacher, "--epochs", 5,
                        "--accumulation-steps", 1, "--log-dir", tmp_path / "logs",
                        cwd=tmp_path)
    assert quick.returncode == 0, quick.stderr[-4000:]
    features = quick.stdout.split("features on:\n", 1)[1].split("epoch 1/", 1)[0]
    assert re.search(rf"^  Distillation +live teacher {re.escape(str(teacher))} \(301,066 "
                     r"parameters\), temperature 2\.0, alpha 0\.5", features, re.M), features
    assert "GradientAccumulation" not in features  # --accumulation-steps 1 turns it off
    final = re.search(r"final validation accuracy: (0\.\d+)", quick.stdout)
    assert final and float(final.group(1)) > 0.8, quick.stdout[-2000:]


def test_quickstart_default_run_trains_to_098_with_rounded_quiet_epoch_lines(tmp_path):
    result = run_example("quickstart.py", "--log-dir", tmp_path / "logs", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    final = re.search(r"final validation accuracy: (0\.\d+)", out)
    assert final and float(final.group(1)) >= 0.97, out[-2000:]
    # Its dataset shuffles, so fit gets shuffle=False: no Keras warning about it.
    assert "`shuffle=True` was passed" not in result.stderr
    # It names the model, the data and each feature before training.
    assert re.search(r"^model: digits_mlp, an MLP 64-256-256-10 with 85,002 parameters", out,
                     re.M)
    assert re.search(r"^data:  scikit-learn digits .*1437 training and 360 validation", out,
                     re.M)
    features = out.split("features on:\n", 1)[1].split("epoch 1/", 1)[0]
    names = [line.split()[0] for line in features.splitlines() if line.startswith("  ")]
    assert names == ["HBMMonitor", "ThroughputMonitor", "GradientAccumulation"], features
    assert "4 micro-batches of 32 per replica" in features
    epochs = EPOCH_LINE.findall(out)
    assert [int(n) for n, _, _ in epochs] == list(range(1, 31))
    assert "first_step_s" not in out
    assert [n for n, _, line in epochs if "first step" in line] == ["1"]
    for n, _, line in epochs:
        for item in line.split(" - "):
            key, _, value = item.partition(": ")
            if key.startswith("first step"):
                continue
            number = float(value.replace(",", ""))
            if abs(number) < 100:  # larger figures print as whole numbers
                assert significant_digits(value) <= 3, (n, key, value)


def test_quickstart_bf16_pruning_and_two_replicas(tmp_path):
    result = run_example("quickstart.py", "--bf16", "--prune", 0.8, "--logical-cpus", 2,
                         "--epochs", 3, "--log-dir", tmp_path / "logs", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "replicas:  2" in out
    features = out.split("features on:\n", 1)[1].split("epoch 1/", 1)[0]
    assert "4 micro-batches of 16 per replica" in features  # 128 = 2 x 64 = 2 x 4 x 16
    assert re.search(r"^  MixedBFloat16 +bfloat16 compute", features, re.M)
    assert re.search(r"^  Pruning +kernels pruned by magnitude to 80% sparsity", features, re.M)
    # Three epochs of 11 updates: the schedule ends at update 20, so the kernels
    # are at the final sparsity by the end.
    assert re.search(r"^total +84,480 +80\.00%", out, re.M), out[-2000:]


@pytest.mark.parametrize("script, args, message", [
    ("quickstart.py", ["--distill-from", "missing.keras"],
     "examples/distill_digits.py --save-teacher missing.keras"),
    ("quickstart.py", ["--prune", "1.5"], "--prune must be a sparsity in [0, 1)"),
    ("quickstart.py", ["--epochs", "0"], "--epochs must be >= 1"),
    ("distill_digits.py", ["--seeds", "1"], "--seeds must be >= 2"),
    ("distill_digits.py", ["--labels", "5000"], "--labels must be between 10 and 937"),
    ("distill_digits.py", ["--save-teacher", "teacher.h5"], "must name a .keras file"),
])
def test_examples_name_the_bad_argument(script, args, message, tmp_path):
    result = run_example(script, *args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr


def test_fit_sharded_state_plans_shards_and_trains(tmp_path):
    """The state (49.8 MiB a device) exceeds the 40 MiB budget: the search splits it,
    the model is resharded in place and trains to the digits' usual accuracy."""
    result = run_example("fit_sharded_state.py", "--epochs", 4, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    assert "-> fits with ShardedDataParallel(shard=" in out, out
    state = re.search(r"state per device: ([\d.]+) MiB -> ([\d.]+) MiB; total ([\d.]+) MiB "
                      r"-> ([\d.]+) MiB of ([\d.]+) MiB usable", out)
    before, after, _, total, usable = map(float, state.groups())
    assert after <= 0.5 * before and total <= usable
    accuracy = float(re.search(r"validation accuracy: ([\d.]+)", out).group(1))
    assert accuracy >= 0.9


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_a_run_killed_mid_epoch_resumes_to_the_weights_never_stopped(tmp_path, backend):
    """resume_after_preemption.py as its docstring runs it: killed (SIGKILL) in epoch 2,
    run again, it resumes from its last checkpoint and ends on the weights and optimizer
    state of a run never stopped, bit for bit."""
    import signal

    import numpy as np

    def run(name, *args):
        return run_example("resume_after_preemption.py", "--directory", tmp_path / name,
                           *args, cwd=tmp_path, backend=backend)

    plain = run("plain", "--fresh", "--save-weights", tmp_path / "plain.npz")
    assert plain.returncode == 0, plain.stderr[-4000:]
    assert "trained from the start" in plain.stdout and "138 updates" in plain.stdout
    killed = run("killed", "--fresh", "--kill-at", 60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    assert "preempted after 60 batches" in killed.stdout
    resumed = run("killed", "--save-weights", tmp_path / "resumed.npz")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    # 46 updates an epoch (GradientAccumulation splits each batch), saves every 5 and at
    # the epoch's end (46): killed after update 60, the last save began at 56 (its
    # asynchronous write may not have finished: then the one at 51).
    found = re.search(r"update (\d+), epoch 2, batch (\d+)", resumed.stdout)
    assert found and int(found[1]) in (51, 56), resumed.stdout
    assert int(found[2]) == int(found[1]) - 46
    assert "138 updates" in resumed.stdout
    with np.load(tmp_path / "plain.npz") as want, np.load(tmp_path / "resumed.npz") as got:
        # 4 weights, then Adam's variables (its slots, the update count)
        assert len(want.files) == len(got.files) > 4
        for name in want.files:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
