"""Global batches of in-memory arrays, in their order or in each epoch's `EpochOrder`.

`TPUStrategyWrapper.distribute` returns them: on JAX for arrays (under
`keras.distribution` each process feeds its own share of every global batch, which
`ArrayBatches` slices out), and on both backends for arrays with `seed=` (each
epoch's rows in an `EpochOrder`; Keras calls `on_epoch_end` at the end of every epoch
from its fit loop, so the order moves on with the epochs and with nothing else). No
framework is imported here; TensorFlow's `tf.distribute` splits a `tf.data` dataset
over the replicas itself.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_tpu_mem.epoch_order import EpochOrder


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
        seed: Take each epoch's rows in the order of an `EpochOrder` of this
            seed (the `epoch_order` attribute): a pure function of the seed and
            the epoch, which moves on at `on_epoch_end` after a pass that read
            the last batch, or is set (`ResumableCheckpoint` sets it to `fit`'s
            epoch). None: the rows in their order.

    Example:

    ```python
    import numpy as np
    from keras_tpu_mem.array_batches import ArrayBatches

    batches = ArrayBatches(np.arange(40), 8, process_index=1, process_count=2)
    batches[1]   # array([12, 13, 14, 15]): process 1's half of rows 8-15
    ```
    """

    def __init__(self, data, global_batch_size, *, drop_remainder=True,
                 process_index=0, process_count=1, seed=None):
        super().__init__()
        self.data = data
        self._read_last = False
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
        #: The `EpochOrder` of the rows (with `seed`), or None.
        self.epoch_order = None if seed is None else EpochOrder(self.num_examples, seed)

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
        if self.epoch_order is not None:
            rows = self.epoch_order.rows(rows.start, rows.stop)
            self._read_last = self._read_last or index == self._batches - 1
        batch = keras.tree.map_structure(lambda a: a[rows], self.data)
        return tuple(batch) if isinstance(batch, list) else batch

    def on_epoch_end(self):
        # Keras also calls this once before a fit's first epoch, with nothing read.
        if self.epoch_order is not None and self._read_last:
            self.epoch_order.pass_done()
        self._read_last = False


def array_batches(dataset, global_batch_size: int, accepted: str, **options) -> ArrayBatches:
    """`ArrayBatches(options)` of `dataset`'s leaves as numpy arrays; a `TypeError` saying
    that `dataset` must be `accepted` where they cannot be read as arrays."""
    try:
        data = keras.tree.map_structure(np.asarray, dataset)
    except Exception as err:
        raise TypeError(f"`dataset` must be {accepted}; got {type(dataset).__name__}.") from err
    return ArrayBatches(data, global_batch_size, **options)
