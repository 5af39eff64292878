"""`EpochOrder`: each epoch's order of a dataset's examples, a pure function of a seed
and the epoch, so a restarted run reads every epoch in the order the first run did.

`fit(shuffle=True)` and `tf.data`'s `shuffle` draw a new order from a random state
that a restart starts afresh: after a preemption, epoch 3 would come in epoch 0's
order (or in any order), and a resumed epoch would train on other examples. Here
the order of epoch `e` is `numpy.random.default_rng([seed, e]).permutation(n)`:
nothing but `seed` and `e` decides it. `TPUStrategyWrapper.distribute(seed=...)`
batches arrays through one; `ResumableCheckpoint` tells it the epoch a restarted
`fit` resumes at (`set_epoch`). No framework is imported here.
"""

from __future__ import annotations

import threading

import numpy as np

from keras_tpu_mem._utils import check_non_negative_int, check_positive_int


class EpochOrder:
    """The order of `num_examples` examples in each epoch, from `seed` and the epoch.

    The epoch starts at 0 and moves on by one at the end of each complete pass over
    the examples (`pass_done`, called by the batches that read through it), or is set
    (`set_epoch`: `ResumableCheckpoint` sets it to `fit`'s epoch at each epoch's start).

    Args:
        num_examples: How many examples the dataset has.
        seed: A non-negative int.

    Example:

    ```python
    from keras_tpu_mem.epoch_order import EpochOrder

    order = EpochOrder(10, seed=3)
    first = order.rows(0, 4)        # the rows of epoch 0's first batch of 4
    order.set_epoch(2)
    order.rows(0, 4)                # epoch 2's: the same at every run
    ```
    """

    def __init__(self, num_examples: int, seed: int):
        check_positive_int(num_examples, "num_examples")
        self.num_examples = int(num_examples)
        self.seed = check_non_negative_int(seed, "seed")
        self._epoch = 0
        self._permutation = None
        # Keras' JAX iterator and tf.data's prefetch read from other threads.
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int:
        """The epoch whose order `rows` gives."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Makes `rows` give epoch `epoch`'s order (0-based, as `fit` counts)."""
        epoch = check_non_negative_int(epoch, "epoch")
        with self._lock:
            if epoch != self._epoch:
                self._epoch, self._permutation = epoch, None

    def pass_done(self) -> None:
        """The current epoch's examples were all read: the next pass is the next epoch."""
        with self._lock:
            self._epoch, self._permutation = self._epoch + 1, None

    def permutation(self) -> np.ndarray:
        """The current epoch's order: row indices, int64."""
        with self._lock:
            if self._permutation is None:
                rng = np.random.default_rng([self.seed, self._epoch])
                self._permutation = rng.permutation(self.num_examples).astype(np.int64)
            return self._permutation

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Row indices of positions `start:stop` of the current epoch's order."""
        return self.permutation()[start:stop]

    def __repr__(self) -> str:
        return (f"EpochOrder(num_examples={self.num_examples}, seed={self.seed}, "
                f"epoch={self._epoch})")


__all__ = ["EpochOrder"]
