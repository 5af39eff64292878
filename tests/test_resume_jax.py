"""`ResumableCheckpoint` across distributions: JAX only, because only
`keras.distribution` lays one model's state out in more than one way (saved split
over 8 devices, resumed replicated)."""

from __future__ import annotations

import importlib.util
import re
import sys

import numpy as np
import pytest
import resume_cases

#: Orbax, which writes state split over processes: the `[checkpoint]` extra (installed on
#: every CI line that runs JAX).
NEEDS_ORBAX = pytest.mark.skipif(
    importlib.util.find_spec("orbax") is None,
    reason='needs orbax-checkpoint: pip install "keras-tpu-mem[checkpoint]"')


@pytest.mark.slow
def test_saved_sharded_resumes_under_data_parallel(tmp_path):
    """Issue 30's floor: stopped under `ShardedDataParallel()` (weights and slots split
    over 8 devices), resumed under `DataParallel(8)`: within 1e-6 of the run that was
    never stopped (measured: 0.0; the checkpoint holds whole arrays)."""
    reference, callbacks, _ = resume_cases.train("fsdp8")
    want = resume_cases.state_arrays(reference, callbacks)
    with pytest.raises(RuntimeError, match="preempted"):
        resume_cases.train("fsdp8", str(tmp_path), stop_at=17, asynchronous=False)
    model, callbacks, _ = resume_cases.train("dp8", str(tmp_path), seed=7)
    assert callbacks[-1].resumed_from.update == 15
    got = resume_cases.state_arrays(model, callbacks)
    for key in want:
        np.testing.assert_allclose(got[key].astype("float64"), want[key].astype("float64"),
                                   rtol=0, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_sharded_checkpoint_with_a_file_gone_or_cut_is_skipped_before_orbax_reads_it(
        tmp_path, where, monkeypatch, caplog):
    """The commit of Orbax's files records each with its size (`checkpoint.json`'s
    `files`); a folder where one is missing or another size is skipped, with a warning
    naming the file, before Orbax reads any of it (Orbax's failed reads outlive the
    restore and print tracebacks). Fake Orbax folders: the check reads only the list."""
    import logging
    import os
    import types

    import jax.numpy as jnp

    from keras_tpu_mem.backends.jax import sharded_checkpoint
    from keras_tpu_mem.resume import store

    if where == "remote":
        pytest.importorskip("fsspec")
        directory = f"memory://ktm-sharded-{os.getpid()}"
    else:
        directory = str(tmp_path)
    files = store._files()
    saved = [types.SimpleNamespace(path="dense/kernel", shape=(2,), dtype="float32")]

    def write(path, size):
        if where == "local":
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with store._open(path, "wb") as handle:
            handle.write(b"x" * size)

    folders = {}
    for update in (5, 10):
        staging = store.staging_folder(directory, update)
        folders[update] = store.sharded_state_folder(staging)
        write(os.path.join(folders[update], "manifest.ocdbt"), 10)
        write(os.path.join(folders[update], "d", "chunk"), 100)
        store.commit_sharded(directory, staging, update, {"model": saved},
                             {"epoch": 0, "batch": update})
    infos = store.list_checkpoints(directory)
    assert infos[-1].meta["files"] == {"manifest.ocdbt": 10, "d/chunk": 100}
    read = []
    monkeypatch.setattr(sharded_checkpoint, "restore", lambda path, like: read.append(
        path.rsplit("/update-", 1)[1]) or {"model": [jnp.ones(2)]})
    like = {"model": [jnp.zeros(2)]}
    write(os.path.join(infos[-1].path, "state.orbax", "d", "chunk"), 50)  # cut short
    with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"):
        info, groups = store.latest_complete(directory, like=like)
    assert info.update == 5 and read == ["000000005/state.orbax"]
    assert "state.orbax/d/chunk has 50 bytes where 100 were written" in caplog.text
    np.testing.assert_array_equal(groups["model"][0][1], np.ones(2))
    files.rmtree(os.path.join(infos[0].path, "state.orbax", "d"))  # a data folder gone
    with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"):
        assert store.latest_complete(directory, like=like) is None
    assert "update-000000005: state.orbax/d/chunk is missing" in caplog.text
    assert read == ["000000005/state.orbax"]
    if where == "remote":
        files.rmtree(directory)


def _split_fit(tmp_path, monkeypatch, **kwargs):
    """A fit whose kernel `Step.split_over_processes` reports split over processes (as
    under `ShardedDataParallel` on a pod); returns the variables it was asked about."""
    import keras

    import keras_tpu_mem as ktm
    from keras_tpu_mem.backends.jax.trainer import Step

    seen = []

    def split(variables):
        seen.extend(variables)
        return [v.path for v in variables if v.path.endswith("kernel")]

    monkeypatch.setattr(Step, "split_over_processes", staticmethod(split))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((16, 4), "float32")
    model.fit(x, x[:, :3], batch_size=8, shuffle=False, verbose=0,
              callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=1, **kwargs)])
    return model, seen


def test_split_state_without_orbax_is_refused_at_train_begin(tmp_path, monkeypatch):
    """State split over processes (not fully addressable, not replicated) is written
    through Orbax; `orbax=False`, or Orbax not installed, is refused by name in
    on_train_begin, before a save or restore, not at the first save."""
    import keras

    from keras_tpu_mem.backends.jax import sharded_checkpoint
    from keras_tpu_mem.backends.jax.trainer import Step
    from keras_tpu_mem.engine import Engine

    class Spread:
        is_fully_addressable, is_fully_replicated = False, False

    class Replicated:
        is_fully_addressable, is_fully_replicated = False, True

    class Variable:
        path, value = "dense/kernel", Spread()

    class ReplicatedVariable:
        path, value = "dense/bias", Replicated()

    assert Step.split_over_processes([ReplicatedVariable(), Variable()]) == ["dense/kernel"]
    step = Step(Engine.attach(keras.Sequential([keras.layers.Dense(1)])))
    with pytest.raises(ValueError, match=r"e\.g\. 'dense/kernel'\) are split over several"):
        step.state_values([ReplicatedVariable(), Variable()])
    with pytest.raises(ValueError, match=r"orbax=False.*e\.g\. 'sequential\w*/dense\w*/kernel'"):
        _split_fit(tmp_path, monkeypatch, orbax=False)
    assert list(tmp_path.iterdir()) == []
    # Orbax not installed, as Python sees it.
    monkeypatch.setitem(sys.modules, "orbax", None)
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    assert "orbax-checkpoint is not installed" in sharded_checkpoint.problem()
    with pytest.raises(ImportError, match=r"split over several.*keras-tpu-mem\[checkpoint\]"):
        _split_fit(tmp_path, monkeypatch)
    assert list(tmp_path.iterdir()) == []
    import keras_tpu_mem as ktm

    with pytest.raises(ImportError, match=r"orbax=True.*keras-tpu-mem\[checkpoint\]"):
        ktm.ResumableCheckpoint(str(tmp_path), orbax=True)


def _orbax_fit(case, directory=None, stop_at=None):
    """`resume_cases.train` with `ResumableCheckpoint(orbax=True)`, saving synchronously
    (an in-process stop must not leave a save in flight)."""
    return resume_cases.train(case, directory, stop_at=stop_at, asynchronous=False,
                              orbax=True)


@pytest.mark.slow
@NEEDS_ORBAX
def test_orbax_checkpoints_resume_bit_exact_and_a_damaged_one_is_skipped(tmp_path, caplog):
    """`orbax=True` in one process (what a pod's processes do with split state, checked
    with two processes in tests/test_multiprocess_jax.py): stopped under
    `ShardedDataParallel()` with every feature on, the newest checkpoint's Orbax files
    damaged (a data folder gone): it is skipped with a warning naming it, the one before
    is restored into `DataParallel(8)`'s layouts (Orbax reshards), and the run ends
    within 1e-6 of the run never stopped."""
    import logging
    import os
    import shutil

    from keras_tpu_mem.resume import store

    reference, callbacks, _ = resume_cases.train("fsdp8")
    want = resume_cases.state_arrays(reference, callbacks)
    with pytest.raises(RuntimeError, match="preempted"):
        _orbax_fit("fsdp8", str(tmp_path), stop_at=17)
    saved = store.list_checkpoints(str(tmp_path))
    assert [info.update for info in saved] == [10, 15] and all(map(store.is_sharded, saved))
    shutil.rmtree(os.path.join(saved[-1].path, "state.orbax", "d"))
    with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"):
        model, callbacks, _ = _orbax_fit("dp8", str(tmp_path))
    assert callbacks[-1].resumed_from.update == 10
    # Named from checkpoint.json's list of Orbax's files, before Orbax reads any of it
    # (its failed reads would print tracebacks after the restore).
    assert re.search(r"update-000000015: state\.orbax/d/\S+ is missing", caplog.text)
    got = resume_cases.state_arrays(model, callbacks)
    for key in want:
        np.testing.assert_allclose(got[key].astype("float64"), want[key].astype("float64"),
                                   rtol=0, atol=1e-6, err_msg=key)


@pytest.mark.slow
@NEEDS_ORBAX
def test_an_orbax_checkpoint_resumes_on_another_device_count(tmp_path):
    """Saved split over 8 devices through Orbax, resumed under `ShardedDataParallel`
    over 4: Orbax reads each array into the 4-device layout. A run over 4 devices sums
    its gradients in another order than one over 8 (0.016 apart after 30 updates
    here), so the reference is the same update read whole: a `state.bin` checkpoint the
    same run saved at the same update, resumed under the same 4 devices (within 1e-6)."""
    resumed = {}
    for name, orbax in (("orbax", True), ("state.bin", False)):
        directory = str(tmp_path / name)
        with pytest.raises(RuntimeError, match="preempted"):
            resume_cases.train("fsdp8", directory, stop_at=17, asynchronous=False,
                               orbax=orbax)
        model, callbacks, _ = resume_cases.train("fsdp4", directory, asynchronous=False,
                                                 orbax=orbax)
        assert callbacks[-1].resumed_from.update == 15
        assert model.weights[0].value.sharding.num_devices == 4
        resumed[name] = resume_cases.state_arrays(model, callbacks)
    for key, want in resumed["state.bin"].items():
        np.testing.assert_allclose(resumed["orbax"][key].astype("float64"),
                                   want.astype("float64"), rtol=0, atol=1e-6, err_msg=key)


def test_a_remote_directory_no_file_system_writes_is_refused_up_front():
    """On JAX remote paths go through fsspec: a scheme it does not know is refused when
    the callback is made, naming it (TensorFlow's file systems answer at the first
    write)."""
    import keras_tpu_mem as ktm

    with pytest.raises(ValueError, match="fsspec cannot write nosuchfs:// paths"):
        ktm.ResumableCheckpoint("nosuchfs://bucket/run")


@pytest.mark.parametrize("orbax", [False, pytest.param(True, marks=NEEDS_ORBAX)],
                         ids=["state.bin", "orbax"])
def test_a_save_mid_epoch_reads_the_state_where_the_fit_holds_it(tmp_path, orbax):
    """A save between two steps reads Keras' training state as `fit` holds it, without
    the `model` property's sync into every variable (which Keras would gather back
    before the next step), through `state.bin` and through Orbax alike; the newest
    checkpoint gone, a restart resumes from the mid-epoch one and ends where the run
    never stopped ends (one device: the same program on the same batches)."""
    import shutil

    import keras

    import keras_tpu_mem as ktm
    from keras_tpu_mem._compat import jax as jax_compat
    from keras_tpu_mem.resume import store

    x = np.random.default_rng(0).normal(size=(80, 6)).astype("float32")
    y = (np.arange(80) % 3).astype("int32")

    def fit(callbacks, seed=0):
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3)])
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
        return [np.asarray(v.value) for v in model.variables + model.optimizer.variables]

    synced = []

    class Checkpoint(ktm.ResumableCheckpoint):
        def _save(self, epoch, batch, *counted):
            super()._save(epoch, batch, *counted)
            if batch:  # mid-epoch (Keras syncs the state itself at an epoch's end)
                synced.append(jax_compat.state_synced(self._model))

    want = fit([])
    directory = str(tmp_path / "run")
    fit([Checkpoint(directory, every=4, asynchronous=False, orbax=orbax)])
    assert synced == [False, False]  # the saves at updates 4 and 8
    saved = store.list_checkpoints(directory)
    assert [info.update for info in saved] == [8, 10]
    shutil.rmtree(saved[-1].path)  # the epoch end's: the restart resumes at update 8
    resumed = ktm.ResumableCheckpoint(directory, every=4, asynchronous=False, orbax=orbax)
    got = fit([resumed], seed=1)
    assert resumed.resumed_from.update == 8
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@NEEDS_ORBAX
def test_a_spare_folder_a_killed_run_left_is_deleted_at_the_end_of_an_orbax_fit(tmp_path):
    """A `.spare` (the folder a prune keeps for the next `state.bin` save to write over)
    that a killed run left is deleted by the writing process at the end of a fit that
    writes through Orbax, as at the end of one that writes `state.bin`; the
    checkpoints stay."""
    import os

    import keras

    import keras_tpu_mem as ktm
    from keras_tpu_mem.resume import store

    spare = tmp_path / ".spare"
    spare.mkdir()
    (spare / "state.bin").write_bytes(b"\0" * 64)
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    model.fit(x, x[:, :2], batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=2, orbax=True)])
    assert sorted(os.listdir(tmp_path)) == ["update-000000002", "update-000000004"]
    assert [info.update for info in store.list_checkpoints(str(tmp_path))] == [2, 4]


def test_a_process_that_does_not_write_reads_nothing_at_a_save_mid_epoch(tmp_path, monkeypatch):
    """A process of a job whose state another process writes (replicated state, JAX's
    processes after the first) keeps the schedule by the updates counted between steps:
    mid-epoch it reads nothing (a read would wait for its steps in flight, and the
    job's next collective would make every process wait), at an epoch's end it reads
    the optimizer's count; it writes no checkpoint."""
    import os

    import keras

    import keras_tpu_mem as ktm
    from keras_tpu_mem.backends.jax.trainer import Step

    monkeypatch.setattr(Step, "writes_checkpoints", staticmethod(lambda: False))
    reads, saves = [], []

    class Checkpoint(ktm.ResumableCheckpoint):
        def _reader(self):
            read = super()._reader()
            return lambda variables: reads.append(len(variables)) or read(variables)

        def _save(self, epoch, batch, *counted):
            super()._save(epoch, batch, *counted)
            saves.append(self._last_saved)

    x = np.random.default_rng(0).normal(size=(80, 4)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    model.fit(x, x[:, :2], batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[Checkpoint(str(tmp_path), every=3)])
    # Saves at updates 3, 6, 9, the epoch's end (10), 13, 16, 19 and the end (20).
    assert saves == [3, 6, 9, 10, 13, 16, 19, 20]
    assert reads == [1, 1]  # `iterations`, at the two epochs' ends
    assert os.listdir(tmp_path) == []


def test_a_distributed_job_asks_jaxs_preemption_service_and_warns_without_it(
        tmp_path, monkeypatch, caplog):
    """The JAX step's `preemption_sync`: None in a process that is no `jax.distributed`
    job (the callback catches SIGTERM itself), JAX's sync point in one, and a refusal
    where the job runs without the service; the callback then says the notices are
    not saved at, keeps SIGTERM's handler and still saves periodically."""
    import logging
    import signal

    import jax
    import keras
    from jax.experimental import multihost_utils

    import keras_tpu_mem as ktm
    from keras_tpu_mem.backends.jax.trainer import Step

    assert Step.preemption_sync() is None
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert Step.preemption_sync() is multihost_utils.reached_preemption_sync_point
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="mse")
    x = np.ones((32, 4), "float32")
    before = signal.getsignal(signal.SIGTERM)
    jax.config.update("jax_enable_preemption_service", False)
    try:
        with pytest.raises(RuntimeError, match="`jax_enable_preemption_service` is off"):
            Step.preemption_sync()
        with caplog.at_level(logging.WARNING, logger="keras_tpu_mem"):
            model.fit(x, x[:, :3], batch_size=8, epochs=1, shuffle=False, verbose=0,
                      callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=2)])
    finally:
        jax.config.update("jax_enable_preemption_service", True)
    assert "not saved at: this jax.distributed job runs without JAX's preemption" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is before
    assert [i.update for i in ktm.list_checkpoints(str(tmp_path))] == [2, 4]
