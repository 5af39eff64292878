"""Exact resume after a preemption: step-level checkpoints with the data position.

`callback.py` is `ResumableCheckpoint` (what is saved, when, and how a restarted
`fit` gets back to its batch); `store.py` is the directory of checkpoints (written
whole or not at all, read back checked).
"""

from keras_tpu_mem.resume.callback import ResumableCheckpoint
from keras_tpu_mem.resume.store import CheckpointInfo, list_checkpoints

__all__ = ["CheckpointInfo", "ResumableCheckpoint", "list_checkpoints"]
