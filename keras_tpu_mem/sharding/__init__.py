"""Model state sharded over the data-parallel devices (ZeRO / FSDP), on JAX.

`ShardedDataParallel` is a `keras.distribution` that splits the batch and
the model state (weights and optimizer slots, or only the slots) over the
same axis; `reshard` moves an existing model there in place;
`sharded_dim(variable)` says how a variable is split. The rule that picks
the dimension is `rule.shard_dim` (no framework). On TensorFlow each raises
an error naming JAX.
"""

from __future__ import annotations

from keras_tpu_mem.sharding.distribution import ShardedDataParallel
from keras_tpu_mem.sharding.reshard import reshard
from keras_tpu_mem.sharding.rule import SHARD_MODES, shard_dim
from keras_tpu_mem.sharding.state import sharded_dim, state_bytes_per_device

__all__ = ["SHARD_MODES", "ShardedDataParallel", "reshard", "shard_dim", "sharded_dim",
           "state_bytes_per_device"]
