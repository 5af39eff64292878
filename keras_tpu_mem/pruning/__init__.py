"""Magnitude pruning for Keras 3 models: `Pruning`, `strip_pruning`, `sparsity_report`.

One module per job:

* `schedules`: *when* to recompute the masks and *how sparse* (`ConstantSparsity`,
  `PolynomialDecay`, tfmot's formulas in `keras.ops`);
* `masks`: the mask math (k-th largest by bisection, blocks, N:M), pure `keras.ops`;
* `selection`: which layers and weights are pruned (`find_prunable_weights`);
* `callback`: `Pruning`, the `fit` callback that applies the masks inside the
  step (what differs between backends: the `StepContext` verbs it calls);
* `export`: `strip_pruning`;
* `report`: `sparsity_report`, `SparsityReport`, `WeightSparsity`.
"""

from keras_tpu_mem.pruning.callback import Pruning
from keras_tpu_mem.pruning.export import strip_pruning
from keras_tpu_mem.pruning.masks import block_mask, kth_largest, m_by_n_mask, magnitude_mask
from keras_tpu_mem.pruning.report import SparsityReport, WeightSparsity, sparsity_report
from keras_tpu_mem.pruning.schedules import ConstantSparsity, PolynomialDecay, PruningSchedule
from keras_tpu_mem.pruning.selection import find_prunable_weights

__all__ = [
    "ConstantSparsity",
    "PolynomialDecay",
    "Pruning",
    "PruningSchedule",
    "SparsityReport",
    "WeightSparsity",
    "block_mask",
    "find_prunable_weights",
    "kth_largest",
    "m_by_n_mask",
    "magnitude_mask",
    "sparsity_report",
    "strip_pruning",
]
