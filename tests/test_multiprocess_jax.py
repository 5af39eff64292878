"""Two processes x 2 devices on localhost (`keras.distribution.initialize`, gloo CPU
collectives) against one process x 4 devices: with GradientAccumulation(4), with
Pruning and a live-teacher Distillation together, and under ShardedDataParallel; and
a two-process job killed mid-epoch and resumed by `ResumableCheckpoint`."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

# Subprocess-heavy (minutes): CI runs it on the newest line only (pyproject: markers).
pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).resolve().parent / "multiprocess_worker_jax.py"
TIMEOUT_S = 300  # each cluster; a hung collective fails the test instead of the suite
NEEDS_ORBAX = pytest.mark.skipif(importlib.util.find_spec("orbax") is None,
                                 reason='needs orbax-checkpoint: pip install '
                                        '"keras-tpu-mem[checkpoint]"')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cluster(tmp_path, num_processes, devices, features="accumulation", env_extra=None,
             killed=False, exit_code=0):
    """Runs the cluster; returns each process's results, or None where `killed` (every
    process must then end by SIGKILL: its own, or ours once one of them is gone, as a
    pod's other hosts stop when one is lost) or where every process must end with
    another `exit_code` than 0."""
    port = _free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    outs = [tmp_path / f"p{num_processes}_{i}.npz" for i in range(num_processes)]
    env = dict(os.environ, **(env_extra or {}))
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    logs = [open(tmp_path / f"p{num_processes}_{i}.log", "w") for i in range(num_processes)]
    processes = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(num_processes),
                                   str(devices), str(port), str(out), features],
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
                 for i, (out, log) in enumerate(zip(outs, logs))]
    try:
        if killed:
            # The first process gone ends the job: the others may wait in a collective.
            first = processes[0].wait(timeout=TIMEOUT_S)
            assert first == -signal.SIGKILL, f"process 0 ended with {first}, not killed"
            for process in processes[1:]:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
        for process in processes:
            process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a {num_processes}-process cluster did not finish in {TIMEOUT_S}s")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    if killed:
        return None
    for i, process in enumerate(processes):
        if process.returncode != exit_code:
            text = _log(tmp_path, i, num_processes)[-3000:]
            pytest.fail(f"process {i} of {num_processes} ended with {process.returncode}, "
                        f"not {exit_code}:\n{text}")
    if exit_code != 0:
        return None
    results = []
    for out in outs:
        with np.load(out) as data:
            results.append({"weights": [data[f"arr_{i}"] for i in range(len(data.files) - 2)],
                            "iterations": int(data["iterations"]),
                            "devices": int(data["devices"])})
    return results


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """`uninterrupted(features)`: the results of the job of `resume` / `resume_fsdp`
    never stopped (2 processes x 2 devices), run once per module."""
    cache = {}

    def get(features):
        if features not in cache:
            cache[features] = _cluster(tmp_path_factory.mktemp(features), 2, 2, features)
        return cache[features]
    return get


def _log(folder, process: int, num_processes: int = 2) -> str:
    return (folder / f"p{num_processes}_{process}.log").read_text()


def _max_diff(a, b):
    return max(float(np.max(np.abs(x.astype("float64") - y.astype("float64"))))
               for x, y in zip(a, b, strict=True))


def test_two_processes_give_the_weights_of_one_process_with_the_same_devices(tmp_path):
    single = _cluster(tmp_path, 1, 4)[0]
    pair = _cluster(tmp_path, 2, 2)
    assert single["devices"] == 4 and all(r["devices"] == 4 for r in pair)
    assert single["iterations"] == 5 and all(r["iterations"] == 5 for r in pair)
    assert _max_diff(pair[0]["weights"], pair[1]["weights"]) == 0.0
    assert _max_diff(pair[0]["weights"], single["weights"]) <= 1e-5


def test_two_processes_prune_and_distill_like_one_process(tmp_path):
    """Pruning + Distillation over `jax.distributed`: the weights of one process x 4
    devices (1e-5), every kernel at the schedule's 0.5 sparsity on every process."""
    single = _cluster(tmp_path, 1, 4, "prune_distill")[0]
    pair = _cluster(tmp_path, 2, 2, "prune_distill")
    assert single["iterations"] == 5 and all(r["iterations"] == 5 for r in pair)
    assert _max_diff(pair[0]["weights"], pair[1]["weights"]) == 0.0
    assert _max_diff(pair[0]["weights"], single["weights"]) <= 1e-5
    for result in (single, *pair):
        kernels = [w for w in result["weights"] if w.ndim == 2]
        assert len(kernels) == 2
        for kernel in kernels:
            assert abs(float(np.mean(kernel == 0)) - 0.5) <= 0.01, float(np.mean(kernel == 0))


def test_two_processes_shard_the_state_like_one_process(tmp_path):
    """ShardedDataParallel over 2 processes x 2 devices (weights and Adam slots split
    over all 4): the weights of one process x 4 devices (1e-5), identical on both."""
    single = _cluster(tmp_path, 1, 4, "sharded")[0]
    pair = _cluster(tmp_path, 2, 2, "sharded")
    assert single["iterations"] == 5 and all(r["iterations"] == 5 for r in pair)
    assert all(r["devices"] == 4 for r in pair)
    assert _max_diff(pair[0]["weights"], pair[1]["weights"]) == 0.0
    assert _max_diff(pair[0]["weights"], single["weights"]) <= 1e-5


@pytest.mark.parametrize("features, arrays_in", [
    ("resume", "state.bin"), pytest.param("resume_fsdp", "state.orbax", marks=NEEDS_ORBAX)])
def test_two_processes_each_killed_resume_bit_exact(tmp_path, features, arrays_in,
                                                    uninterrupted):
    """Issue 30's floor: 2 processes x 2 devices, every training feature on, data
    shuffled through `distribute(seed=...)`, saves every 5 updates; each process
    SIGKILLed at the end of batch 17 (epoch 2), the job started again: the final
    weights, optimizer slots and pruning masks equal those of the job never stopped,
    bit for bit, on both processes. Under `DataParallel` over the 4 devices (the state
    replicated: process 0 writes `state.bin`), and under `ShardedDataParallel` (the
    state split over the processes: each writes its shards through Orbax)."""
    want = uninterrupted(features)
    directory = str(tmp_path / "checkpoints")
    _cluster(tmp_path / "killed", 2, 2, features,
             {"KTM_RESUME_DIR": directory, "KTM_KILL_AT": "17"}, killed=True)
    from keras_tpu_mem.resume import store

    saved = store.list_checkpoints(directory)
    assert saved and max(i.update for i in saved) >= 10 and max(i.update for i in saved) < 17, \
        [i.update for i in saved]
    assert all(os.path.exists(os.path.join(info.path, arrays_in)) for info in saved)
    split = arrays_in == "state.bin" and importlib.util.find_spec("orbax") is not None
    if split:  # a copy, before the restart below saves on into `directory`
        shutil.copytree(directory, tmp_path / "checkpoints_split")
    got = _cluster(tmp_path / "restarted", 2, 2, features, {"KTM_RESUME_DIR": directory})
    # Each process resumed (a run from the start would end on the same bits).
    resumed_from = f"resumed from update {max(i.update for i in saved)}"
    assert all(resumed_from in _log(tmp_path / "restarted", i) for i in range(2))
    for result in got:
        assert result["iterations"] == want[0]["iterations"] == 30
        assert len(result["weights"]) == len(want[0]["weights"])
        assert _max_diff(result["weights"], want[0]["weights"]) == 0.0
    assert _max_diff(want[0]["weights"], want[1]["weights"]) == 0.0
    if split:
        resharded = _cluster(tmp_path / "restarted_split", 2, 2, "resume_fsdp",
                             {"KTM_RESUME_DIR": str(tmp_path / "checkpoints_split")})
        assert all(resumed_from in _log(tmp_path / "restarted_split", i) for i in range(2))
        # It saved on with the state split over the processes: through Orbax.
        newest = max(store.list_checkpoints(str(tmp_path / "checkpoints_split")),
                     key=lambda info: info.update)
        assert newest.update == 30 and os.path.isdir(os.path.join(newest.path, "state.orbax"))
        for result in resharded:
            assert result["iterations"] == 30
            assert len(result["weights"]) == len(want[0]["weights"])
            assert _max_diff(result["weights"], want[0]["weights"]) <= 1e-6


@pytest.mark.parametrize("features", ["resume", pytest.param("resume_fsdp", marks=NEEDS_ORBAX)])
def test_a_preemption_notice_to_one_process_saves_every_process_at_one_update(
        tmp_path, features, uninterrupted):
    """A preemption notice (SIGTERM) to process 0 alone at the end of batch 7, the
    periodic saves every 1000 updates (none mid-epoch): JAX's preemption service tells
    process 1, both save at the same update boundary after it and exit with status
    143; the job started again resumes there on both processes and ends on the bits
    of the job never stopped. Under `DataParallel` (process 0 writes `state.bin`) and
    `ShardedDataParallel` (every process its shards through Orbax: a collective save,
    which hangs unless both save at the same update)."""
    want = uninterrupted(features)
    directory = str(tmp_path / "checkpoints")
    _cluster(tmp_path / "noticed", 2, 2, features,
             {"KTM_RESUME_DIR": directory, "KTM_NOTICE_AT": "7"}, exit_code=128 + 15)
    from keras_tpu_mem.resume import store

    saved = max(info.update for info in store.list_checkpoints(directory))
    # A save after the notice (the only periodic one before the end is at update 10).
    assert 7 < saved < 30, [info.update for info in store.list_checkpoints(directory)]
    for i in range(2):
        assert f"update {saved} (epoch" in _log(tmp_path / "noticed", i)
    got = _cluster(tmp_path / "restarted", 2, 2, features, {"KTM_RESUME_DIR": directory})
    assert all(f"resumed from update {saved}" in _log(tmp_path / "restarted", i)
               for i in range(2))
    for result in got:
        assert result["iterations"] == 30
        assert _max_diff(result["weights"], want[0]["weights"]) == 0.0
