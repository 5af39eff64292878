"""`sparsity_report`: zeros and the bytes of each sparse format, by hand."""

import keras
import numpy as np

from keras_tpu_mem.pruning import sparsity_report


def test_sparsity_report_by_hand():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, use_bias=False),
                              keras.layers.Dense(2)])
    kernel = np.arange(1, 13, dtype="float32").reshape(4, 3)
    kernel[kernel % 2 == 0] = 0  # 6 of 12 zero
    model.layers[0].kernel.assign(kernel)
    report = sparsity_report(model, compressed=True)
    first = report.weights[0]
    assert (first.size, first.zeros, first.sparsity) == (12, 6, 0.5)
    assert first.dense_bytes == 48
    assert first.csr_bytes == 6 * (4 + 4) + (4 + 1) * 4  # values + col idx + row ptr
    assert first.bitmask_bytes == 6 * 4 + 2
    assert first.best_bytes == 26
    assert first.compressed_bytes > 0
    head = report.weights[1]
    assert head.zeros == int(np.sum(np.asarray(model.layers[1].kernel.value) == 0))
    assert report.model_bytes == (12 + 3 * 2 + 2) * 4
    assert report.saved_bytes == 48 - 26 + head.dense_bytes - head.best_bytes
    text = str(report)
    assert "sequential" in text and "50.00%" in text
