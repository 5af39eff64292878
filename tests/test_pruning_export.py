"""`strip_pruning`: the pruned model as ordinary layers, predicting identically, saved safely."""

import keras
import numpy as np
import pytest
from helpers import toy_data
from test_pruning_callback import _small_mlp, _strategy

from keras_tpu_mem.pruning import ConstantSparsity, Pruning, sparsity_report, strip_pruning


@pytest.mark.parametrize("case", ["default", "mirrored"])
def test_strip_pruning_predicts_identically_and_round_trips(case, tmp_path):
    x, y = toy_data(128, inputs=16)
    model = _small_mlp(_strategy(case), spe=2)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[Pruning(ConstantSparsity(0.6, begin_step=1, frequency=2))])
    stripped = strip_pruning(model)
    assert stripped is not model
    assert [type(layer) for layer in stripped.layers] == [keras.layers.Dense] * 2
    stripped_out = stripped.predict(x, verbose=0)
    if case == "default":
        # The same computation (same weights, strategy, batch and kernels): exact.
        np.testing.assert_array_equal(stripped_out, model.predict(x, verbose=0))
    else:
        # The clone is made outside the scope, so it predicts on the default strategy
        # while the trained model splits each batch over 2 replicas: other GEMM shapes,
        # so oneDNN sums in another order (measured: 29 of 640 values off by 2.4e-07 on
        # an AMD EPYC). Equal up to float32 rounding, not bitwise.
        np.testing.assert_allclose(stripped_out, model.predict(x, verbose=0), rtol=0,
                                   atol=1e-6)
    path = str(tmp_path / "pruned.keras")
    stripped.save(path)
    loaded = keras.saving.load_model(path, safe_mode=True)
    # The round trip itself is exact: the loaded model and the one saved run the same
    # computation on the same (default) strategy, and the weights are the trained ones.
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), stripped_out)
    for got, want in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert sparsity_report(loaded).sparsity == pytest.approx(0.6, abs=0.01)
    # The trained model itself carries no pruning state either.
    model.save(str(tmp_path / "trained.keras"))
    again = keras.saving.load_model(str(tmp_path / "trained.keras"), safe_mode=True)
    assert len(again.weights) == len(model.weights)
