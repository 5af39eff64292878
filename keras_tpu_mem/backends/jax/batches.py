"""Global batches of in-memory arrays fed by every process, on JAX.

JAX only (contract: `keras_tpu_mem.backends.contracts.Batches`): under
`keras.distribution` each process feeds its own share of every global batch, which
`ArrayBatches` slices out of arrays (`strategy.Placement.batches`). TensorFlow's
`tf.distribute` splits a `tf.data` dataset over the replicas itself.
"""

from __future__ import annotations

import keras


class ArrayBatches(keras.utils.PyDataset):
    """Static global batches of in-memory arrays, in order, for `fit` on JAX.

    Every batch has exactly `global_batch_size` rows (the last partial batch
    is dropped unless `drop_remainder=False`), so XLA compiles one step. Under
    several processes each yields only its own rows of every global batch,
    which is what `keras.distribution` expects of each process's input.

    Args:
        data: An array, or a tuple / list / dict of arrays of one length.
        global_batch_size: Rows per step over all processes.
        drop_remainder: Drop the last partial batch.
        process_index, process_count: This process's place among the
            processes that feed the distribution.

    Example:

    ```python
    import numpy as np
    from keras_tpu_mem.backends.jax.batches import ArrayBatches

    batches = ArrayBatches(np.arange(40), 8, process_index=1, process_count=2)
    batches[1]   # array([12, 13, 14, 15]): process 1's half of rows 8-15
    ```
    """

    def __init__(self, data, global_batch_size, *, drop_remainder=True,
                 process_index=0, process_count=1):
        super().__init__()
        self.data = data
        leaves = keras.tree.flatten(data)
        if not leaves:
            raise ValueError("`dataset` holds no arrays.")
        lengths = {len(leaf) for leaf in leaves}
        if len(lengths) != 1:
            raise ValueError(
                f"Every array in `dataset` needs the same length; got {sorted(lengths)}.")
        self.num_examples = lengths.pop()
        self.global_batch_size = global_batch_size
        self.process_index, self.process_count = process_index, process_count
        if global_batch_size % process_count:
            raise ValueError(
                f"global_batch_size={global_batch_size} does not split over "
                f"{process_count} processes; use a multiple of {process_count}.")
        full, rest = divmod(self.num_examples, global_batch_size)
        self._batches = full + (1 if rest and not drop_remainder else 0)
        if self._batches == 0:
            raise ValueError(
                f"`dataset` has {self.num_examples} examples, fewer than one global batch of "
                f"{global_batch_size}.")

    def __len__(self):
        return self._batches

    def __getitem__(self, index):
        if not 0 <= index < self._batches:
            raise IndexError(index)
        start = index * self.global_batch_size
        stop = min(start + self.global_batch_size, self.num_examples)
        share = (stop - start) // self.process_count
        begin = start + self.process_index * share
        rows = slice(begin, begin + share)
        batch = keras.tree.map_structure(lambda a: a[rows], self.data)
        return tuple(batch) if isinstance(batch, list) else batch
