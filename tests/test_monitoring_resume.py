"""Both monitors across a preemption and a `BackupAndRestore` resume (issues #7, #12, #16),
one body on both backends (conftest's BOTH_BACKENDS): the second attempt appends to the
first's files and continues its step axis from the restored optimizer's counter, under
the conftest's data-parallel strategy (MirroredStrategy over 2 CPUs on TensorFlow,
`DataParallel` over 8 devices on JAX)."""

from __future__ import annotations

import os
import time

import keras
import monitoring_cases as cases
import pytest
from conftest import MIRRORED

from keras_tpu_mem import monitoring as mon
from keras_tpu_mem.report import load_timeline

BATCH, STEPS = 64, 6  # per epoch


class _InterruptAt(keras.callbacks.Callback):
    """Simulates a preemption at a given batch of a given epoch."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.epoch, self.batch, self._epoch = epoch, batch, None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self._epoch, batch) == (self.epoch, self.batch):
            raise RuntimeError("preempted")


def test_resume_with_backup_and_restore_continues_the_timeline(tmp_path, ktm_records):
    x, y = cases.random_data(BATCH * STEPS)
    log_dir, backup = tmp_path / "logs", tmp_path / "backup"
    subdirs = ("ktm_memory", "ktm_throughput")

    def run(extra):
        with MIRRORED.scope():
            model = cases.compile_model(cases.small_mlp())
            callbacks = [keras.callbacks.BackupAndRestore(str(backup)), mon.HBMMonitor(log_dir),
                         mon.ThroughputMonitor(log_dir)] + extra
            return model.fit(x, y, batch_size=BATCH, epochs=3, verbose=0, shuffle=False,
                             callbacks=callbacks)

    def steps(subdir):
        return [r["step"] for r in cases.read_timeline(log_dir, subdir)
                if r.get("phase") != "eval"]

    with pytest.raises(RuntimeError, match="preempted"):
        run([_InterruptAt(epoch=1, batch=2)])  # backed up after epoch 0, lost at step 9
    # No on_train_end after the crash: the writer threads still put steps 1..9 on disk
    # within about a second (as a preempted process would have before dying).
    lost_at = list(range(1, STEPS + 4))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(
            os.path.exists(log_dir / d / "timeline.jsonl") and steps(d) == lost_at
            for d in subdirs):
        time.sleep(0.2)
    before = {d: (log_dir / d / "timeline.jsonl").read_text() for d in subdirs}
    run([])  # resumes at epoch 1, from the backed-up step 6
    cases.assert_no_crash(ktm_records)
    for subdir in subdirs:
        path = log_dir / subdir / "timeline.jsonl"
        assert path.read_text().startswith(before[subdir])  # appended, not clobbered
        records = [r for r in cases.read_timeline(log_dir, subdir) if r.get("phase") != "eval"]
        assert [r["step"] for r in records if r["attempt"] == 1] == lost_at
        second = [r for r in records if r["attempt"] == 2]
        # The restored optimizer's step counter continues the step axis.
        assert [r["step"] for r in second] == list(range(STEPS + 1, 3 * STEPS + 1))
        assert {r["begin_step"] for r in second} == {STEPS}
        # Read as TensorBoard would: the re-trained steps replace the lost ones.
        kept = [r for r in load_timeline(str(path)) if r.get("phase") != "eval"]
        assert [r["step"] for r in kept] == list(range(1, 3 * STEPS + 1))
        assert {r["attempt"] for r in kept if r["step"] > STEPS} == {2}
        if cases.HAS_TENSORBOARD:  # one event file per attempt
            assert len([f for f in os.listdir(log_dir / subdir) if "tfevents" in f]) == 2
