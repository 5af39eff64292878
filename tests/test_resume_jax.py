"""`ResumableCheckpoint` across distributions: JAX only, because only
`keras.distribution` lays one model's state out in more than one way (saved split
over 8 devices, resumed replicated)."""

from __future__ import annotations

import numpy as np
import pytest
import resume_cases


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


def test_state_split_over_processes_is_refused_at_train_begin(tmp_path, monkeypatch):
    """Under `jax.distributed` every variable spans several processes' devices (not
    fully addressable): one split over them (not replicated) is refused by name in
    on_train_begin, before a save or restore, not at the first save; a replicated one
    is read (a two-process job resumes: tests/test_multiprocess_jax.py)."""
    import keras

    import keras_tpu_mem as ktm
    from keras_tpu_mem.backends.jax.trainer import Step

    class Spread:
        is_fully_addressable, is_fully_replicated = False, False

    class Replicated:
        is_fully_addressable, is_fully_replicated = False, True

    class Variable:
        path, value = "dense/kernel", Spread()

    class ReplicatedVariable:
        path, value = "dense/bias", Replicated()

    Step.check_state_readable([ReplicatedVariable()])
    with pytest.raises(ValueError, match=r"e\.g\. 'dense/kernel'\) are split over several"):
        Step.check_state_readable([ReplicatedVariable(), Variable()])
    seen, check = [], Step.check_state_readable

    def spread(variables):
        seen.extend(variables)
        check([Variable()])

    monkeypatch.setattr(Step, "check_state_readable", staticmethod(spread))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((16, 4), "float32")
    with pytest.raises(ValueError, match=r"split over processes \(Orbax\)"):
        model.fit(x, x[:, :3], batch_size=8, shuffle=False, verbose=0,
                  callbacks=[ktm.ResumableCheckpoint(str(tmp_path), every=1)])
    assert {id(v) for v in model.variables} <= {id(v) for v in seen}
    assert list(tmp_path.iterdir()) == []


def test_a_remote_directory_no_file_system_writes_is_refused_up_front():
    """On JAX remote paths go through fsspec: a scheme it does not know is refused when
    the callback is made, naming it (TensorFlow's file systems answer at the first
    write)."""
    import keras_tpu_mem as ktm

    with pytest.raises(ValueError, match="fsspec cannot write nosuchfs:// paths"):
        ktm.ResumableCheckpoint("nosuchfs://bucket/run")
