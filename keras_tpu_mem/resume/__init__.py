"""Exact resume after a preemption: step-level checkpoints with the data position.

`callback.py` is `ResumableCheckpoint` (what is saved, when, and how a restarted
`fit` gets back to its batch); `store.py` is the directory of checkpoints (written
whole or not at all, read back checked). Nothing is imported here: `store` needs
no framework, so `keras-tpu-mem checkpoints DIR` lists a directory without loading
Keras. The public names are `ktm.ResumableCheckpoint`, `ktm.CheckpointInfo` and
`ktm.list_checkpoints`.
"""
