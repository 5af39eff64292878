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
