"""`ResumableCheckpoint` (issue 30): a fit stopped at any update resumes bit for bit.

Each exactness test compares against a run that was never stopped and never
checkpointed (the independent reference), with every training feature on
(`resume_cases.py`). The in-process tests stop the fit with an exception after a
synchronous save; the `slow` ones SIGKILL a separate process, as a preemption does,
with the default asynchronous saves. One body per behaviour, on both backends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import zlib

import keras
import numpy as np
import pytest
import resume_cases
from resume_cases import JAX_CASES, TENSORFLOW_CASES

import keras_tpu_mem as ktm
from keras_tpu_mem.cli import checkpoints_table
from keras_tpu_mem.resume import store

BACKEND = keras.backend.backend()
CASES = JAX_CASES if BACKEND == "jax" else TENSORFLOW_CASES


def _assert_bit_exact(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        diff = np.max(np.abs(got[key].astype("float64") - want[key].astype("float64")))
        assert diff == 0.0, (key, diff)


@pytest.fixture(scope="module")
def references():
    """Final state of each case's uninterrupted, uncheckpointed run (built once)."""
    cache = {}

    def get(case):
        if case not in cache:
            model, callbacks, history = resume_cases.train(case)
            cache[case] = resume_cases.state_arrays(model, callbacks), history.history
        return cache[case]

    return get


def _stop_then_resume(case, directory, stop_at):
    with pytest.raises(RuntimeError, match="preempted"):
        resume_cases.train(case, directory, stop_at=stop_at, asynchronous=False)
    # A restarted script: the same code, other initial weights (they are restored).
    model, callbacks, history = resume_cases.train(case, directory, seed=7)
    return model, callbacks, history


@pytest.mark.parametrize("case", [CASES[0]])
def test_stopped_mid_epoch_resumes_bit_exact_with_every_feature(case, references, tmp_path):
    """Stopped at update 17 (epoch 2, after the save at 15): the resumed run's weights,
    optimizer slots and pruning masks equal the uninterrupted run's exactly."""
    want, want_history = references(case)
    model, callbacks, history = _stop_then_resume(case, str(tmp_path), stop_at=17)
    checkpoint = callbacks[-1]
    assert (checkpoint.resumed_from.epoch, checkpoint.resumed_from.batch) == (1, 5)
    assert checkpoint.resumed_from.update == 15
    _assert_bit_exact(resume_cases.state_arrays(model, callbacks), want)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations.value)) == 30
    # The epochs after the restart log what the uninterrupted run logged (the
    # resumed epoch's metrics start from the saved sums).
    np.testing.assert_allclose(history.history["loss"], want_history["loss"][1:], rtol=1e-6)


class _SeeSigtermHandler(keras.callbacks.Callback):
    """Appends SIGTERM's handler at each batch's end to `seen`."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(signal.getsignal(signal.SIGTERM))


@pytest.fixture
def script_handler():
    """A SIGTERM handler of the test script's own, as a user's cleanup: it records the
    signal and raises (ending the fit), and is put back after the test."""
    handed = []

    def handler(signum, frame):
        handed.append(signum)
        raise RuntimeError("preempted by the notice")

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler, handed
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("case", [CASES[0]])
def test_a_preemption_notice_saves_at_the_next_update_and_resumes_bit_exact(
        case, references, tmp_path, script_handler):
    """A preemption notice (SIGTERM) at the end of batch 17, the periodic saves every
    1000 updates (none mid-epoch): the next update boundary (batch 7 of epoch 2;
    batch 6 ends inside an accumulation window) is saved, then the notice goes to the
    script's own handler, put back in place; the restart resumes there and ends on
    the uninterrupted run's bits."""
    handler, handed = script_handler
    want, want_history = references(case)
    directory = str(tmp_path)
    with pytest.raises(RuntimeError, match="preempted by the notice"):
        resume_cases.train(case, directory, stop_at=17, stop="notice", every=1000)
    assert handed == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is handler
    assert [(i.update, i.epoch, i.batch) for i in store.list_checkpoints(directory)] == [
        (10, 1, 0), (17, 1, 7)]
    model, callbacks, history = resume_cases.train(case, directory, seed=7)
    assert callbacks[-1].resumed_from.update == 17
    _assert_bit_exact(resume_cases.state_arrays(model, callbacks), want)
    np.testing.assert_allclose(history.history["loss"], want_history["loss"][1:], rtol=1e-6)


def test_sigterm_is_caught_only_while_a_fit_runs(tmp_path, script_handler):
    """The handler is the callback's during a fit and the script's before and after;
    a notice after a fit that ended in an error (no `on_train_end`: the callback's
    handler is still installed) goes straight to the script's handler, and nothing is
    saved for it. `save_on_preemption=False` leaves SIGTERM as it is."""
    handler, handed = script_handler
    seen = []

    x, y = _xy()
    for save_on_preemption in (True, False):
        checkpoint = ktm.ResumableCheckpoint(str(tmp_path / str(save_on_preemption)),
                                             every=1000,
                                             save_on_preemption=save_on_preemption)
        seen.clear()
        with pytest.raises(RuntimeError, match="preempted after 3 batches"):
            _small_model().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                               callbacks=[checkpoint, _SeeSigtermHandler(seen),
                                          resume_cases.StopAt(3, "raise")])
        assert (seen[0] is handler) is not save_on_preemption
        with pytest.raises(RuntimeError, match="preempted by the notice"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is handler
        assert ktm.list_checkpoints(str(tmp_path / str(save_on_preemption))) == []
    assert handed == [signal.SIGTERM, signal.SIGTERM]
    # A fit that ends normally puts the script's handler back.
    _small_model().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                       callbacks=[ktm.ResumableCheckpoint(str(tmp_path / "ends"))])
    assert signal.getsignal(signal.SIGTERM) is handler


def test_a_failed_save_at_a_notice_is_said_and_the_notice_still_handed_back(
        tmp_path, monkeypatch, caplog, script_handler):
    """The write at a notice fails: the error is logged (the notice may end the process
    before anything prints it) and the notice still goes to the script's handler."""
    handler, handed = script_handler

    def fail(*args, **kwargs):
        raise OSError("disk full")

    x, y = _xy()
    model = _small_model()
    monkeypatch.setattr(store, "write_checkpoint", fail)
    with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"), \
            pytest.raises(RuntimeError, match="preempted by the notice"):
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=1000),
                             resume_cases.StopAt(3, "notice")])
    assert handed == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is handler
    assert "the save at a preemption notice failed (RuntimeError" in caplog.text
    assert "disk full" in caplog.text


def test_a_jobs_sync_point_saves_at_the_update_it_names_then_exits(tmp_path, monkeypatch):
    """Where the backend's step names a job's sync point (JAX's preemption service on
    a `jax.distributed` job, which catches the SIGTERM itself), the callback asks it at
    every update boundary with consecutive numbers; at the boundary it names, it saves,
    waits for the files and exits with status 143. Over two real processes:
    tests/test_multiprocess_jax.py."""
    from keras_tpu_mem import backends

    calls = []

    def reached(call):
        calls.append(call)
        return len(calls) == 5

    monkeypatch.setattr(backends.current().trainer.Step, "preemption_sync",
                        staticmethod(lambda: reached))
    x, y = _xy()
    with pytest.raises(SystemExit) as ended:
        _small_model().fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                           callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=1000)])
    assert ended.value.code == 128 + signal.SIGTERM
    assert calls == list(range(calls[0], calls[0] + 5))
    # The fifth boundary is batch 4's: 4 updates made.
    assert [(i.update, i.epoch, i.batch) for i in ktm.list_checkpoints(str(tmp_path))] == [
        (4, 0, 4)]


def test_a_fit_outside_the_main_thread_saves_no_notice_and_says_so(tmp_path, caplog):
    """Python catches signals on the main thread only: a fit on another thread leaves
    SIGTERM alone, with a warning that the periodic checkpoints still are saved."""
    x, y = _xy()
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def fit():
        _small_model().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                           callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3),
                                      _SeeSigtermHandler(seen)])

    with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"):
        thread = threading.Thread(target=fit)
        thread.start()
        thread.join()
    assert "runs outside the main thread" in caplog.text
    assert "periodic checkpoints (`every`) still are" in caplog.text
    assert set(seen) == {before}
    assert [i.update for i in ktm.list_checkpoints(str(tmp_path))] == [6, 8]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_sigkill_at_a_random_update_resumes_bit_exact(case, references, tmp_path):
    """The issue's floor: a process SIGKILLed at a random update (not an epoch end)
    with asynchronous saves every 5 updates; the restarted process ends where the
    uninterrupted run ended, bit for bit (weights, slots, masks)."""
    want, _ = references(case)
    rng = np.random.default_rng(sum(map(ord, case)))
    kill_at = int(rng.choice([b for b in range(11, 30) if b % 10]))
    directory, out = str(tmp_path / "checkpoints"), str(tmp_path / "final.npz")
    command = [sys.executable, resume_cases.__file__, case, directory, out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    killed = subprocess.run([*command, "--kill-at", str(kill_at)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert store.list_checkpoints(directory, warn=False), "nothing was saved before the kill"
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr, resumed.stderr[-3000:]
    with np.load(out) as got:
        _assert_bit_exact(dict(got), want)


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[0]])
def test_a_preemption_notice_ends_the_process_after_its_save(case, references, tmp_path):
    """A process sent SIGTERM at the end of batch 17 with no handler of its own (the
    periodic saves every 1000 updates): it saves update 17 and then ends by SIGTERM,
    as the notice would have ended it; the restarted process resumes there and ends
    on the uninterrupted run's bits."""
    want, _ = references(case)
    directory, out = str(tmp_path / "checkpoints"), str(tmp_path / "final.npz")
    command = [sys.executable, resume_cases.__file__, case, directory, out]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    noticed = subprocess.run([*command, "--notice-at", "17"], env=env, capture_output=True,
                             text=True, timeout=600)
    assert noticed.returncode == -signal.SIGTERM, noticed.stderr[-3000:]
    assert "update 17 (epoch 2, batch 7) saved at a preemption notice" in noticed.stderr
    assert max(i.update for i in store.list_checkpoints(directory)) == 17
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(update 17): epoch 2, batch 7" in resumed.stderr, resumed.stderr[-3000:]
    with np.load(out) as got:
        _assert_bit_exact(dict(got), want)


def test_a_half_written_or_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    directory = str(tmp_path)
    arrays = {"model": [("w", np.arange(6, dtype="float32").reshape(2, 3))]}
    store.write_checkpoint(directory, 5, arrays, {"epoch": 0, "batch": 5})
    store.write_checkpoint(directory, 10, {"model": [("w", np.ones((2, 3), "float32"))]},
                           {"epoch": 1, "batch": 0})
    # update 15: killed mid-save (the hidden partial folder); update 10: its arrays cut short.
    os.makedirs(tmp_path / ".partial-update-000000015")
    with open(tmp_path / "update-000000010" / "state.bin", "r+b") as handle:
        handle.truncate(100)
    with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"):
        info, groups = store.latest_complete(directory)
    assert info.update == 5 and (info.epoch, info.batch) == (0, 5)
    np.testing.assert_array_equal(groups["model"][0][1], arrays["model"][0][1])
    warned = caplog.text
    assert ".partial-update-000000015" in warned and "update-000000010" in warned


def test_arrays_come_back_with_their_dtype_and_shape(tmp_path):
    import ml_dtypes

    values = [("scalar", np.array(7, "int64")), ("bf16", np.arange(4).astype(ml_dtypes.bfloat16)),
              ("mask", np.array([[True, False]])),
              ("strided", np.arange(12, dtype="float32").reshape(3, 4)[:, ::2])]
    path = store.write_checkpoint(str(tmp_path), 3, {"g": values}, {"epoch": 0, "batch": 3})
    groups = store.read_arrays(store.read_info(path))
    for (name, want), (got_name, got) in zip(values, groups["g"]):
        assert got_name == name and got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    record = json.load(open(os.path.join(path, "checkpoint.json")))
    assert record["update"] == 3
    # Hashed while written (nothing read back): the file's own digest and size; each
    # array's bytes at its 64-byte aligned offset.
    with open(os.path.join(path, "state.bin"), "rb") as handle:
        written = handle.read()
    assert record["crc32"] == zlib.crc32(written) and record["format"] == 3
    assert record["size_bytes"] == len(written)
    for entry, (_, want) in zip(record["arrays"]["g"], values):
        assert entry["offset"] % 64 == 0
        raw = np.ascontiguousarray(want).tobytes()
        assert written[entry["offset"]:entry["offset"] + len(raw)] == raw


def test_a_pruned_checkpoints_folder_is_written_over_by_the_next_save(tmp_path):
    """`prune(recycle=True)` keeps the folder it prunes as a hidden spare, which no
    reader takes for a checkpoint; the next save writes over its `state.bin` in place
    (the same file: its blocks reused) and cuts it to the new size."""
    directory = str(tmp_path)
    big = {"g": [("w", np.arange(4096, dtype="float32")), ("b", np.ones(7, "float64"))]}
    small = {"g": [("w", np.full(3, 2.5, "float32"))]}
    for update in (1, 2):
        store.write_checkpoint(directory, update, big, {"epoch": 0, "batch": update})
    store.prune(directory, 1, recycle=True)
    assert sorted(os.listdir(tmp_path)) == [".spare", "update-000000002"]
    assert [info.update for info in ktm.list_checkpoints(directory)] == [2]
    spare_file = os.stat(tmp_path / ".spare" / "state.bin")
    path = store.write_checkpoint(directory, 3, small, {"epoch": 0, "batch": 3})
    assert sorted(os.listdir(tmp_path)) == ["update-000000002", "update-000000003"]
    written = os.stat(os.path.join(path, "state.bin"))
    assert (written.st_ino, written.st_dev) == (spare_file.st_ino, spare_file.st_dev)
    info = store.read_info(path)
    assert written.st_size == info.size_bytes == 12 < spare_file.st_size
    np.testing.assert_array_equal(store.read_arrays(info)["g"][0][1], small["g"][0][1])
    # Only a folder of exactly the two files a save writes is recycled (not one of
    # Orbax's, not one holding anything else), and the spare is dropped at a fit's end.
    os.makedirs(tmp_path / "update-000000001" / "state.orbax")
    (tmp_path / "update-000000001" / "checkpoint.json").write_text("{}")
    store.prune(directory, 2, recycle=True)
    assert sorted(os.listdir(tmp_path)) == ["update-000000002", "update-000000003"]
    store.prune(directory, 1, recycle=True)
    assert sorted(os.listdir(tmp_path)) == [".spare", "update-000000003"]
    store.drop_spare(directory)
    assert sorted(os.listdir(tmp_path)) == ["update-000000003"]


def test_a_checkpoint_of_the_second_format_is_checked_against_its_sha256(tmp_path, caplog):
    """Format 2 recorded a SHA-256 of `state.bin` (format 3: a CRC-32)."""
    arrays = {"g": [("w", np.arange(6, dtype="float32").reshape(2, 3))]}
    for update in (4, 8):
        path = store.write_checkpoint(str(tmp_path), update, arrays, {"epoch": 0, "batch": 0})
        with open(os.path.join(path, "state.bin"), "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
        record = json.load(open(os.path.join(path, "checkpoint.json")))
        del record["crc32"]
        record.update(format=2, sha256=digest if update == 4 else "0" * 64)
        with open(os.path.join(path, "checkpoint.json"), "w") as handle:
            json.dump(record, handle)
    with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"):
        info, groups = store.latest_complete(str(tmp_path))
    assert info.update == 4 and "update-000000008" in caplog.text and "SHA-256" in caplog.text
    np.testing.assert_array_equal(groups["g"][0][1], arrays["g"][0][1])


def test_a_checkpoint_of_the_first_format_still_reads_back(tmp_path):
    """Checkpoints written before `state.bin` (format 1: `state.npz`, each array's
    bytes under `group/index`) read back as they were saved."""
    import io

    want = [("w", np.arange(6, dtype="float32").reshape(2, 3)), ("step", np.array(7, "int64"))]
    buffer = io.BytesIO()
    np.savez(buffer, **{f"g/{i}": v.reshape(-1).view(np.uint8) for i, (_, v) in enumerate(want)})
    folder = tmp_path / "update-000000007"
    folder.mkdir()
    (folder / "state.npz").write_bytes(buffer.getvalue())
    record = {"format": 1, "epoch": 0, "batch": 7, "update": 7, "saved_at": 0.0,
              "size_bytes": len(buffer.getvalue()),
              "sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
              "arrays": {"g": [{"path": p, "shape": list(v.shape), "dtype": v.dtype.name}
                               for p, v in want]}}
    (folder / "checkpoint.json").write_text(json.dumps(record))
    info, groups = store.latest_complete(str(tmp_path))
    assert info.update == 7
    for (name, value), (got_name, got) in zip(want, groups["g"]):
        assert got_name == name and got.dtype == value.dtype and got.shape == value.shape
        np.testing.assert_array_equal(got, value)


@pytest.fixture
def remote_directory(request):
    """A fresh remote directory standing in for gs://: TensorFlow's in-memory `ram://`
    (tf.io.gfile), fsspec's `memory://` on JAX (the path gcsfs takes for gs://)."""
    name = f"ktm-resume-{request.node.name}"
    if BACKEND == "jax":
        fsspec = pytest.importorskip("fsspec")
        yield f"memory://{name}"
        fsspec.filesystem("memory").rm(f"/{name}", recursive=True)
    else:
        import tensorflow as tf

        yield f"ram://{name}"
        if tf.io.gfile.exists(f"ram://{name}"):
            tf.io.gfile.rmtree(f"ram://{name}")


def test_a_remote_directory_writes_the_json_last_and_reads_back_checked(
        remote_directory, caplog):
    """No folder rename on an object store: a checkpoint whose `checkpoint.json` is
    missing (the save cut short) is skipped with a warning naming it and pruned; arrays
    come back with their dtypes (bfloat16 too)."""
    import ml_dtypes

    directory = remote_directory
    first = [("w", np.arange(6, dtype="float32").reshape(2, 3)),
             ("bf16", np.arange(4).astype(ml_dtypes.bfloat16))]
    store.write_checkpoint(directory, 5, {"model": first}, {"epoch": 0, "batch": 5})
    path = store.write_checkpoint(directory, 10, {"model": [("w", np.ones((2, 3), "float32")),
                                                            first[1]]},
                                  {"epoch": 1, "batch": 0})
    assert path == f"{directory}/update-000000010"
    # update 15: killed after its arrays were copied up, before its checkpoint.json.
    cut = store.write_checkpoint(directory, 15, {"model": first}, {"epoch": 1, "batch": 5})
    store._files().rmtree(cut)
    store._files().makedirs(cut)
    store._copy(os.path.join(path, "state.bin"), os.path.join(cut, "state.bin"))
    with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"):
        info, groups = store.latest_complete(directory)
    assert info.update == 10 and (info.epoch, info.batch) == (1, 0)
    assert "update-000000015" in caplog.text and "cut short" in caplog.text
    np.testing.assert_array_equal(groups["model"][0][1], np.ones((2, 3), "float32"))
    assert groups["model"][1][1].dtype == first[1][1].dtype
    table = checkpoints_table(directory)  # `keras-tpu-mem checkpoints gs://...`
    assert "2 complete checkpoint(s)" in table and "skipped:" in table
    store.prune(directory, keep=1)
    assert [i.update for i in ktm.list_checkpoints(directory)] == [10]
    assert sorted(store._listdir(directory)) == ["update-000000010"]


def test_a_remote_scan_asks_once_per_complete_checkpoint(remote_directory, monkeypatch):
    """Each request to an object store is a round trip: listing a remote directory of
    three complete checkpoints and one cut short reads each `checkpoint.json` once and
    asks whether a file exists only for the folder whose read failed."""
    directory = remote_directory
    for update in (5, 10, 15, 20):
        store.write_checkpoint(directory, update, {"model": [("w", np.ones(2, "float32"))]},
                               {"epoch": 0, "batch": update})
    cut = os.path.join(directory, "update-000000020")  # its checkpoint.json never written
    store._files().rmtree(cut)
    store._files().makedirs(cut)
    store._copy(os.path.join(directory, "update-000000015", "state.bin"),
                os.path.join(cut, "state.bin"))
    files, calls = store._files(), []

    class Counted:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(files, name)

    monkeypatch.setattr(store, "_files", Counted)
    found, skipped = store.scan(directory)
    assert [info.update for info in found] == [5, 10, 15] and len(skipped) == 1
    assert "cut short" in skipped[0]
    assert sorted(calls) == ["GFile"] * 4 + ["exists", "isdir", "listdir"], calls


def test_a_fit_stopped_mid_epoch_resumes_bit_exact_from_a_remote_directory(
        remote_directory):
    """Saved every 3 updates (and at epoch ends) to the remote directory, stopped after
    update 12, restarted with other weights: it resumes at update 11 (epoch 2, batch 3)
    and ends equal to the run never stopped. (Synchronous saves: an asynchronous save of
    update 11 may still be on its way when the exception ends the fit in this process.)"""
    x, y = _xy()
    reference = _small_model()
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = _small_model()
    with pytest.raises(RuntimeError, match="preempted"):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[ktm.ResumableCheckpoint(remote_directory, every=3,
                                                     asynchronous=False),
                             resume_cases.StopAt(12, "raise")])
    restarted = _small_model(seed=7)
    checkpoint = ktm.ResumableCheckpoint(remote_directory, every=3)
    restarted.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[checkpoint])
    found = checkpoint.resumed_from
    assert (found.update, found.epoch, found.batch) == (11, 1, 3)
    for got, want in zip(restarted.get_weights(), reference.get_weights()):
        assert np.max(np.abs(got - want)) == 0.0


class _NumberedBatches(keras.utils.PyDataset):
    """Batch `i` of `num_batches` (None: endless) is filled with `i`."""

    def __init__(self, num_batches):
        super().__init__()
        self._num_batches = num_batches

    @property
    def num_batches(self):
        return self._num_batches

    def __getitem__(self, index):
        return np.full((2, 4), index, "float32"), np.zeros((2, 3), "float32")


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
@pytest.mark.parametrize("num_batches, steps_per_epoch, per_call", [
    (8, 3, 1), (8, 3, 2), (8, 5, 2), (8, 8, 1), (None, 3, 2), (6, None, 2)])
def test_epoch_start_batches_is_where_keras_epoch_iterator_starts_each_epoch(
        num_batches, steps_per_epoch, per_call):
    """`_compat.keras.epoch_start_batches` against Keras' own `EpochIterator` (the
    reference, read here only): the first batch of each of 5 epochs (batch `i` holds
    `i`, counted from the start of the data's current pass) is the count it gives, with
    `steps_per_epoch` shorter than the data (a stream across epochs, ending an epoch
    early at the data's end), endless data, and none."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    from keras_tpu_mem._compat import keras as keras_compat

    iterator = EpochIterator(_NumberedBatches(num_batches), steps_per_epoch=steps_per_epoch,
                             steps_per_execution=per_call)
    got = []
    for _ in range(5):
        firsts = [int(np.asarray(batches[0][0])[0, 0])
                  for _, _, batches in iterator.enumerate_epoch()]
        got.append(firsts[0])
    want = [keras_compat.epoch_start_batches(epoch, steps_per_epoch, num_batches, per_call)
            for epoch in range(5)]
    assert got == want


def _stream(kind, x, y):
    """`(fit's data arguments)`: arrays in batches of 8, or endless batches of the same
    examples (a shuffled, repeated tf.data.Dataset on TensorFlow, a PyDataset on JAX)."""
    if kind == "arrays":
        return {"x": x, "y": y, "batch_size": 8}
    if BACKEND == "tensorflow":
        import tensorflow as tf

        # A seeded shuffle that reshuffles each repetition: one stream, the same at
        # every run.
        return {"x": tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=5)
                .batch(8).repeat()}
    return {"x": _EndlessBatches(x, y, 8)}


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
@pytest.mark.parametrize("kind, stop_at, resumed", [
    ("arrays", 6, (5, 1, 2)), ("arrays", 8, (6, 2, 0)), ("endless", 8, (6, 2, 0))])
def test_steps_per_epoch_shorter_than_the_data_resumes_where_the_data_was(
        kind, stop_at, resumed, tmp_path):
    """With `steps_per_epoch` (3) shorter than the data (8 batches, or endless) one
    iterator runs on across epochs, and epoch 2 of the arrays ends early at their end:
    a restart at a later epoch first reads on to where the uninterrupted run's data was
    (`_compat.keras.position_fit_data`), mid-epoch and at an epoch's start, and ends
    equal to the run never stopped."""
    x, y = _xy()
    fit = dict(epochs=4, steps_per_epoch=3, shuffle=False, verbose=0)
    # Each fit reads data of its own, as each run of a script does (a dataset's
    # reshuffling seed generator goes on from one iteration to the next), made under
    # the same global seed (a shuffle's order depends on it, as in a restarted script).
    reference_data, stopped_data, restarted_data = (_stream(kind, x, y) for _ in range(3))
    reference = _small_model()
    reference.fit(**reference_data, **fit)
    with pytest.raises(RuntimeError, match="preempted"):
        _small_model().fit(**stopped_data, **fit, callbacks=[
            ktm.ResumableCheckpoint(str(tmp_path), every=2, asynchronous=False),
            resume_cases.StopAt(stop_at, "raise")])
    restarted = _small_model(seed=7)
    checkpoint = ktm.ResumableCheckpoint(str(tmp_path), every=2)
    restarted.fit(**restarted_data, **fit, callbacks=[checkpoint])
    found = checkpoint.resumed_from
    assert (found.update, found.epoch, found.batch) == resumed
    _assert_bit_exact(dict(enumerate(restarted.get_weights())),
                      dict(enumerate(reference.get_weights())))


def _small_model(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="mse")
    return model


def _xy(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def test_keeps_the_newest_checkpoints_and_saves_at_update_boundaries(tmp_path):
    x, y = _xy()
    model = _small_model()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3, keep=3)])
    found = [(info.update, info.epoch, info.batch) for info in ktm.list_checkpoints(str(tmp_path))]
    # Saves at updates 3, 6, the epoch end (8), 11, 14 and the epoch end (16); the
    # newest three are kept.
    assert found == [(11, 1, 3), (14, 1, 6), (16, 2, 0)]
    # A save cut short earlier is pruned; what is not a checkpoint is left alone, and a
    # file with a checkpoint's name is not counted among the kept.
    os.makedirs(tmp_path / ".partial-update-000000017")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "update-000000999").write_text("not a checkpoint")
    model.fit(x, y, batch_size=8, epochs=3, initial_epoch=2, shuffle=False, verbose=0,
              callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3, keep=3)])
    assert sorted(os.listdir(tmp_path)) == [
        "notes.txt", "update-000000019", "update-000000022", "update-000000024",
        "update-000000999"]


def test_a_features_state_is_read_and_written_whole_once_per_save_and_restore(
        tmp_path, monkeypatch):
    """A feature's state is saved as one group and read through one engine call per
    save, restored through one (a call per leaf would copy the whole state once per
    leaf: Pruning's masks of every pruned layer); the masks come back equal."""
    from keras_tpu_mem.engine import Engine

    calls = {"feature_state": 0, "set_feature_state": 0}
    for name in calls:
        original = getattr(Engine, name)

        def counted(self, *args, _name=name, _original=original):
            if sys._getframe(1).f_code.co_filename.endswith(os.path.join("resume",
                                                                         "callback.py")):
                calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(Engine, name, counted)

    def model_and_pruning():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(8) for _ in range(4)])
        model.compile(optimizer="adam", loss="mse")
        return model, ktm.Pruning(ktm.ConstantSparsity(0.5, begin_step=0, frequency=2))

    x, y = _xy()
    y = np.tile(y, (1, 3))[:, :8]
    model, pruning = model_and_pruning()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[
        pruning, ktm.ResumableCheckpoint(str(tmp_path), every=2, asynchronous=False)])
    saved = [m.copy() for m in pruning.masks]
    assert len(saved) == 4 and not all(m.all() for m in saved)
    # 4 saves (updates 2, 4, 6 and the epoch end), a read each, and up to 3 at the
    # fit's start (the state's structure, the readable check, the saved groups); a
    # read per leaf would be 4 a save.
    assert 4 <= calls["feature_state"] <= 4 + 3 and calls["set_feature_state"] == 0, calls
    calls.update(feature_state=0)
    model, pruning = model_and_pruning()
    checkpoint = ktm.ResumableCheckpoint(str(tmp_path), every=100, asynchronous=False)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[pruning, checkpoint])
    assert checkpoint.resumed_from.epoch == 1
    assert calls["set_feature_state"] == 1
    for got, want in zip(pruning.masks, saved):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_failed_write_is_raised_on_the_training_thread(tmp_path, monkeypatch, asynchronous):
    """A write that fails (a full disk) is not lost on the writer thread: the fit stops
    with a `RuntimeError` naming the directory and the cause (Keras' traceback filter
    drops the chain), at the save after it (asynchronous) or at it; the checkpoints
    written before it stay complete."""
    calls = []
    write = store.write_checkpoint

    def failing(directory, update, groups, meta):
        calls.append(update)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return write(directory, update, groups, meta)

    monkeypatch.setattr(store, "write_checkpoint", failing)
    x, y = _xy()
    with pytest.raises(RuntimeError, match="could not write to .*No space left on device"):
        _small_model().fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
            ktm.ResumableCheckpoint(str(tmp_path), every=2, asynchronous=asynchronous)])
    # Synchronous: raised at the second save; asynchronous: at the third, which waits.
    assert calls == [2, 4]
    assert [info.update for info in ktm.list_checkpoints(str(tmp_path))] == [2]


@pytest.mark.parametrize("fails", [False, True], ids=["written", "failed"])
def test_a_new_callback_waits_for_the_write_an_interrupted_fit_left_in_flight(
        tmp_path, monkeypatch, caplog, fails):
    """A notebook cell interrupted mid-fit (no `on_train_end`) and run again makes a new
    callback on the same directory while the old one's last save may still be writing
    (a slow disk, a Drive mount): the new one waits for it, then resumes from it, or,
    where it failed, from the one before, with a warning naming the failure."""
    import threading

    write, started = store.write_checkpoint, threading.Event()

    def slow(directory, update, groups, meta):
        if update == 6 and not started.is_set():  # the interrupted fit's save only
            started.set()
            threading.Event().wait(0.5)  # the save of update 6 is still writing
            if fails:
                raise OSError(5, "Input/output error")
        return write(directory, update, groups, meta)

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 6:  # update 7: the save of update 6 began before this batch
                assert started.wait(5)
                raise RuntimeError("interrupted")

    monkeypatch.setattr(store, "write_checkpoint", slow)
    x, y = _xy()
    with pytest.raises(RuntimeError, match="interrupted"):
        _small_model().fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[
            ktm.ResumableCheckpoint(str(tmp_path), every=3), Interrupt()])
    again = ktm.ResumableCheckpoint(str(tmp_path), every=3)
    with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"):
        _small_model().fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                           callbacks=[again])
    assert again.resumed_from.update == (3 if fails else 6)
    assert "cut short" not in caplog.text
    assert ("the last write of the previous callback" in caplog.text) == fails
    assert ("Input/output error" in caplog.text) == fails


def test_a_fit_resumed_at_its_end_runs_nothing_and_the_next_fit_trains(tmp_path):
    # The resumed fit makes no call of the train function: its first-batch observer
    # (which refuses another global batch) must not reach the next fit's first step.
    x, y = _xy()
    model, reference = _small_model(), _small_model()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[ktm.ResumableCheckpoint(str(tmp_path / "a"), every=3)])
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    resumed = ktm.ResumableCheckpoint(str(tmp_path / "a"), every=3)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                        callbacks=[resumed])
    assert resumed.resumed_from.update == 8 and history.history == {}
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[ktm.ResumableCheckpoint(str(tmp_path / "b"), every=3)])
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert int(np.asarray(model.optimizer.iterations)) == 12
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_different_global_batch_is_refused_and_the_model_left_as_it_was(tmp_path):
    x, y = _xy()
    _small_model().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                       callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
    model = _small_model(seed=3)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="steps per epoch"):
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                  callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
    _assert_bit_exact(dict(enumerate(model.get_weights())), dict(enumerate(before)))


class _EndlessBatches(keras.utils.PyDataset):
    """Batches of `size`, round and round (`num_batches` None): fit knows only the
    `steps_per_epoch` it is given, not the global batch."""

    def __init__(self, x, y, size):
        super().__init__()
        self.x, self.y, self.size = x, y, size

    @property
    def num_batches(self):
        return None

    def __getitem__(self, index):
        start = index * self.size % len(self.x)
        return self.x[start:start + self.size], self.y[start:start + self.size]


def _unknown_length(x, y, size):
    """Batches of `size` whose global batch fit does not know: a filtered
    `tf.data.Dataset` (static batch dimension, unknown cardinality) on TensorFlow, an
    endless PyDataset read for 4 steps per epoch on JAX (a generator is refused)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(size, drop_remainder=True)
                .filter(lambda *_: True)), {}
    return _EndlessBatches(x, y, size), {"steps_per_epoch": 4}


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_a_different_batch_of_unknown_length_data_is_refused_at_the_first_step(tmp_path):
    """Data whose length fit does not know: the global batch is compared at the first
    step, before it runs, and the model is put back as it was."""
    x, y = _xy()
    data, kwargs = _unknown_length(x, y, 8)
    _small_model().fit(data, epochs=1, verbose=0, shuffle=False, **kwargs,
                       callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
    model = _small_model(seed=3)
    before = [w.copy() for w in model.get_weights()]
    data, kwargs = _unknown_length(x, y, 16)
    with pytest.raises(ValueError, match="global batch of 8, and this fit's is 16"):
        model.fit(data, epochs=2, verbose=0, shuffle=False, **kwargs,
                  callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
    _assert_bit_exact(dict(enumerate(model.get_weights())), dict(enumerate(before)))
    # The same model fits normally afterwards (nothing of the refused resume is left).
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model._initial_epoch is None


@pytest.mark.parametrize("kwargs,error,match", [
    ({"directory": 3}, TypeError, "`directory` must be a path"),
    ({"directory": "d", "every": 0}, ValueError, "`every` must be an int >= 1"),
    ({"directory": "d", "keep": 1.5}, TypeError, "`keep` must be an int >= 1"),
    ({"directory": "d", "asynchronous": "yes"}, TypeError, "`asynchronous` must be a bool"),
    ({"directory": "d", "orbax": "yes"}, TypeError, "`orbax` must be None .*, True or False"),
    ({"directory": "d", "save_on_preemption": 1}, TypeError,
     "`save_on_preemption` must be a bool"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        ktm.ResumableCheckpoint(**kwargs)


@pytest.mark.tensorflow_only("TensorFlow has no Orbax writer: its strategies hold every "
                              "value whole in one process")
def test_orbax_is_refused_on_tensorflow():
    with pytest.raises(ValueError, match=r"orbax=True\) writes JAX arrays.*TensorFlow backend"):
        ktm.ResumableCheckpoint("/tmp/unused", orbax=True)


def test_another_model_is_refused_before_anything_changes(tmp_path):
    x, y = _xy()
    _small_model().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                       callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
    keras.utils.set_random_seed(0)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                              keras.layers.Dense(3)])
    other.compile(optimizer="adam", loss="mse")
    before = [w.copy() for w in other.get_weights()]
    with pytest.raises(ValueError, match="Build the same model"):
        other.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                  callbacks=[ktm.ResumableCheckpoint(str(tmp_path))])
    _assert_bit_exact(dict(enumerate(other.get_weights())), dict(enumerate(before)))
    assert ktm.ResumableCheckpoint(str(tmp_path), every=4).get_config() == {
        "directory": str(tmp_path), "every": 4, "keep": 2, "asynchronous": True,
        "orbax": None, "save_on_preemption": True}


class _IndexedBatches(keras.utils.PyDataset):
    def __init__(self, x, y, size):
        super().__init__()
        self.x, self.y, self.size = x, y, size

    def __len__(self):
        return len(self.x) // self.size

    def __getitem__(self, index):
        rows = slice(index * self.size, (index + 1) * self.size)
        return self.x[rows], self.y[rows]


def _generator(x, y, size):
    while True:
        for start in range(0, len(x), size):
            yield x[start:start + size], y[start:start + size]


def test_fit_frame_is_the_running_keras_fit_and_none_outside_it():
    """`keras_compat.fit_frame`: from a callback, the frame of Keras' own `Trainer.fit`
    (the backend's trainer module), still on the stack at each batch; None outside."""
    from keras_tpu_mem._compat import keras as keras_compat

    class SeeFrame(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            frames.append(keras_compat.fit_frame(self.model))

        def on_train_batch_end(self, batch, logs=None):
            stack, frame = [], sys._getframe()
            while frame is not None:
                stack.append(frame)
                frame = frame.f_back
            on_stack.append(frames[0] in stack)

    frames, on_stack = [], []
    model = _small_model()
    x, y = _xy(16)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[SeeFrame()])
    frame = frames[0]
    assert frame.f_code.co_name == "fit"
    assert frame.f_globals["__name__"] == f"keras.src.backend.{keras.backend.backend()}.trainer"
    assert on_stack == [True, True]
    assert keras_compat.fit_frame(model) is None


def test_fit_data_reads_the_running_fits_data_adapter():
    """`_compat.keras.fit_data` (Keras' `Trainer.fit` local `epoch_iterator`, its
    `data_adapter` and that adapter's shuffle attribute) from inside a callback, on both
    backends' fit (tests/test_compat.py has the read outside a fit)."""
    from keras_tpu_mem._compat import keras as keras_compat

    class Record(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append(keras_compat.fit_data(self.model))

    x, y = _xy(32)
    indexed, endless = _IndexedBatches(x, y, 8), _EndlessBatches(x, y, 8)
    runs = [((x, y), {"batch_size": 8, "shuffle": True}, ("arrays", True, None)),
            ((x, y), {"batch_size": 8, "shuffle": False}, ("arrays", False, None)),
            ((indexed,), {"shuffle": True}, ("keras.utils.PyDataset", True, indexed)),
            ((indexed,), {"shuffle": False}, ("keras.utils.PyDataset", False, indexed)),
            ((endless,), {"steps_per_epoch": 2}, ("keras.utils.PyDataset", False, endless)),
            ((_generator(x, y, 8),), {"steps_per_epoch": 2}, ("Python generator", False, None))]
    for args, kwargs, want in runs:
        seen = []
        _small_model().fit(*args, epochs=1, verbose=0, callbacks=[Record()], **kwargs)
        assert len(seen) == 1 and tuple(seen[0][:2]) == want[:2], (kwargs, seen)
        assert seen[0].source is want[2]


@pytest.mark.parametrize("data,kwargs,error,match", [
    ("generator", {"steps_per_epoch": 4}, TypeError, "cannot position a Python generator"),
    ("arrays", {"batch_size": 8}, ValueError, r"fit\(shuffle=True\), the default, reorders "
                                              "the arrays"),
    ("py_dataset", {"shuffle": True}, ValueError, "reorders the keras.utils.PyDataset"),
])
def test_data_a_restart_cannot_read_again_in_order_is_refused_before_anything_changes(
        tmp_path, data, kwargs, error, match):
    """Refused at on_train_begin of the first run (no checkpoint written) and of a
    restart (the model left as it was, nothing restored)."""
    x, y = _xy()
    make = {"generator": lambda: (_generator(x, y, 8),), "arrays": lambda: (x, y),
            "py_dataset": lambda: (_IndexedBatches(x, y, 8),)}[data]
    with pytest.raises(error, match=match):
        _small_model().fit(*make(), epochs=1, verbose=0, **kwargs,
                           callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
    assert os.listdir(tmp_path) == []
    _small_model().fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                       callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
    model = _small_model(seed=3)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(error, match=match):
        model.fit(*make(), epochs=2, verbose=0, **kwargs,
                  callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
    _assert_bit_exact(dict(enumerate(model.get_weights())), dict(enumerate(before)))
    assert model._initial_epoch is None


@pytest.mark.tensorflow_only("a tf.data.Dataset's own shuffle")
@pytest.mark.parametrize("shuffle, fit_kwargs, match", [
    ({}, {"epochs": 1}, "shuffles without a seed"),
    ({"seed": 1}, {"epochs": 2}, "reshuffle_each_iteration=True"),
    # 8 batches a pass, 3 x 6 steps: the second epoch ends with the pass, the third
    # opens a second one (a second iterator).
    ({"seed": 1}, {"epochs": 3, "steps_per_epoch": 6}, "reshuffle_each_iteration=True"),
    # 16 batches of 4; 5 steps an epoch in calls of 4 read 8: the third epoch opens
    # a second pass, though 3 x 5 steps are fewer than the 16 batches.
    ({"seed": 1}, {"epochs": 3, "steps_per_epoch": 5, "batch": 4, "steps_per_execution": 4},
     "reshuffle_each_iteration=True"),
    # 8 batches, 3 x 3 steps (and 2 x 6): the last epoch ends early with the pass
    # (Keras stops it at the data's end) and no epoch opens a second one: accepted.
    ({"seed": 1}, {"epochs": 3, "steps_per_epoch": 3}, None),
    ({"seed": 1}, {"epochs": 2, "steps_per_epoch": 6}, None),
])
def test_a_tf_data_shuffle_a_restart_would_draw_anew_is_refused(
        tmp_path, shuffle, fit_kwargs, match):
    """A tf.data.Dataset's shuffle without a seed, and a seeded one that reshuffles for
    each of several passes (Keras' rule for when an epoch opens a pass), are refused at
    on_train_begin, before anything is written; the same seeded shuffle over one pass
    or with `reshuffle_each_iteration=False` is accepted (and the endless, reshuffled
    stream resumes bit for bit: `test_steps_per_epoch_shorter_than_the_data_...`)."""
    import tensorflow as tf

    fit_kwargs = dict(fit_kwargs)
    batch = fit_kwargs.pop("batch", 8)
    steps_per_execution = fit_kwargs.pop("steps_per_execution", 1)
    x, y = _xy()
    tf.random.set_seed(None)  # the test's seed would seed every shuffle (as it should)

    def data(**options):
        return (tf.data.Dataset.from_tensor_slices((x, y))
                .shuffle(64, **dict(shuffle, **options)).batch(batch))

    def model():
        built = _small_model()
        built.compile(optimizer="adam", loss="mse", steps_per_execution=steps_per_execution)
        return built

    given = data()  # before the model: `_small_model` sets the global seed
    if match is None:
        model().fit(given, verbose=0, **fit_kwargs,
                    callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
        assert ktm.list_checkpoints(str(tmp_path))
        return
    with pytest.raises(ValueError, match=match):
        model().fit(given, verbose=0, **fit_kwargs,
                    callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=3)])
    assert os.listdir(tmp_path) == []
    if shuffle and steps_per_execution == 1:
        for options, epochs in (({}, 1), ({"reshuffle_each_iteration": False}, 2)):
            model().fit(data(**options), epochs=epochs, verbose=0, callbacks=[
                ktm.ResumableCheckpoint(str(tmp_path / str(epochs)), every=3)])


def test_distribute_seed_orders_each_epoch_by_seed_and_epoch_alone():
    """`TPUStrategyWrapper.distribute(seed=)`: every epoch reads each example once, in an
    order of its own; a second run (another wrapper, the restarted script) set to an
    epoch reads that epoch's order; fit's epochs move it on (Keras' on_epoch_end)."""
    ids = np.arange(40, dtype="float32")[:, None]
    wrapper = ktm.TPUStrategyWrapper()

    def epoch_rows(batches):
        return np.concatenate([batches[i][0][:, 0] for i in range(len(batches))])

    first = wrapper.distribute((ids, ids), 8, seed=5)
    orders = []
    for _ in range(3):
        orders.append(epoch_rows(first))
        first.on_epoch_end()
    for rows in orders:
        np.testing.assert_array_equal(np.sort(rows), ids[:, 0])
    assert len({tuple(rows) for rows in orders} | {tuple(ids[:, 0])}) == 4
    again = ktm.TPUStrategyWrapper().distribute((ids, ids), 8, seed=5)
    again.epoch_order.set_epoch(2)
    np.testing.assert_array_equal(epoch_rows(again), orders[2])
    other_seed = wrapper.distribute((ids, ids), 8, seed=6)
    assert not np.array_equal(epoch_rows(other_seed), orders[0])

    batches = wrapper.distribute((ids, ids), 8, seed=5)
    keras.utils.set_random_seed(0)
    one = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    one.compile(optimizer="sgd", loss="mse")
    one.fit(batches, epochs=3, shuffle=False, verbose=0)
    assert batches.epoch_order.epoch == 3


@pytest.mark.parametrize("seed,match", [(-1, "non-negative int"), ("7", "non-negative int"),
                                        (True, "non-negative int")])
def test_distribute_seed_must_be_a_non_negative_int(seed, match):
    with pytest.raises(TypeError, match=f"`seed` must be a {match}"):
        ktm.TPUStrategyWrapper().distribute(np.zeros((16, 2)), 8, seed=seed)


@pytest.mark.tensorflow_only("a tf.data.Dataset input")
def test_distribute_seed_refuses_a_tf_data_dataset():
    import tensorflow as tf

    with pytest.raises(TypeError, match="cannot be reordered by index"):
        ktm.TPUStrategyWrapper().distribute(tf.data.Dataset.range(16), 8, seed=1)


def test_monitors_count_no_step_for_skipped_batches_and_the_restart_continues_the_run(
        tmp_path):
    """A restarted fit with `ThroughputMonitor` and `HBMMonitor`: the resumed epoch's
    skipped batches count no step (the monitors' steps end at the optimizer's
    `iterations`, not beyond), and the report reads the restart as a resumed attempt of
    the same training run, starting where the checkpoint was."""
    from keras_tpu_mem.report.timeline import load_timeline, split_training_runs

    x, y = _xy()
    logs, directory = str(tmp_path / "logs"), str(tmp_path / "checkpoints")

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 13:
                raise RuntimeError("preempted")

    def callbacks():
        return [ktm.ResumableCheckpoint(directory, every=3, asynchronous=False),
                ktm.ThroughputMonitor(logs, warmup_steps=0), ktm.HBMMonitor(logs)]

    with pytest.raises(RuntimeError, match="preempted"):
        _small_model().fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                           callbacks=[*callbacks(), Stop()])
    model = _small_model(seed=3)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks())
    assert int(model.optimizer.iterations.numpy()) == 24
    for subdir in ("ktm_throughput", "ktm_memory"):
        path = os.path.join(logs, subdir, "timeline.jsonl")
        with open(path) as f:
            raw = [json.loads(line) for line in f]
        second = [r for r in raw if r.get("attempt") == raw[-1]["attempt"]]
        # Saved at update 11 (epoch 2, batch 3): batches 0-2 of epoch 2 are skipped.
        assert second[0]["begin_step"] == 11, subdir
        assert max(r["step"] for r in second) == 24, subdir
        assert min(r["step"] for r in second) > 11, subdir
        runs = split_training_runs(load_timeline(path))
        assert len(runs) == 1 and len(runs[0].attempts) == 2, subdir
