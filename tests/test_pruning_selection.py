"""Which weights `Pruning` prunes: supported layers, selection by name and type, errors."""

import keras
import numpy as np
import pytest
from helpers import sparse_ce
from test_pruning_callback import _expected_zeros

from keras_tpu_mem.pruning import ConstantSparsity, Pruning, find_prunable_weights


class _Prunable(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], 4), name="w")
        self.b = self.add_weight(shape=(4,), initializer="zeros", name="b")

    def call(self, x):
        return x @ self.w + self.b

    def get_prunable_weights(self):
        return [self.w]


def _zoo():
    keras.utils.set_random_seed(0)
    image = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(4, 3, name="conv")(image)
    h = keras.layers.DepthwiseConv2D(3, name="depthwise")(h)
    h = keras.layers.SeparableConv2D(4, 1, name="separable")(h)
    h = keras.layers.Conv2DTranspose(4, 3, name="transpose")(h)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    t = keras.layers.Embedding(20, 8, name="embedding")(tokens)
    t = keras.layers.Conv1D(8, 3, padding="same", name="conv1d")(t)
    t = keras.layers.MultiHeadAttention(2, 4, name="mha")(t, t)
    t = keras.layers.LayerNormalization(name="ln")(t)
    t = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 8), bias_axes="d",
                                 name="einsum")(t)
    t = keras.layers.GlobalAveragePooling1D()(t)
    volume = keras.Input((4, 4, 4, 2), name="volume")
    v = keras.layers.GlobalAveragePooling3D()(keras.layers.Conv3D(4, 2, name="conv3d")(volume))
    h = keras.layers.Concatenate()([h, t, v])
    h = _Prunable(name="custom")(h)
    out = keras.layers.Dense(3, name="head")(h)
    return keras.Model([image, tokens, volume], out)


ZOO_PRUNED = {
    "conv/kernel", "depthwise/kernel", "separable/pointwise_kernel", "transpose/kernel",
    "embedding/embeddings", "conv1d/kernel", "mha/query/kernel", "mha/key/kernel",
    "mha/value/kernel", "mha/attention_output/kernel", "einsum/kernel", "conv3d/kernel",
    "custom/w", "head/kernel",
}


def test_supported_layers_and_never_biases_or_norms():
    model = _zoo()
    assert {w.path for w in find_prunable_weights(model)} == ZOO_PRUNED
    model.compile("sgd", sparse_ce())
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(16, 8, 8, 3)).astype("float32"), rng.integers(0, 20, (16, 6)),
         rng.normal(size=(16, 4, 4, 4, 2)).astype("float32")]
    y = rng.integers(0, 3, 16)
    pruning = Pruning(ConstantSparsity(0.5, begin_step=1, frequency=1))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[pruning])
    assert set(pruning.pruned_weights) == ZOO_PRUNED
    for variable in model.weights:
        value = np.asarray(variable.value)
        if variable.path in ZOO_PRUNED:
            assert int(np.sum(value == 0)) == _expected_zeros(value.size, 0.5), variable.path
        elif variable.trainable and value.size > 1:
            # Biases and normalisation weights: nothing forced to zero.
            assert np.mean(value == 0) < 0.5, variable.path


def test_layer_selection_by_name_and_type():
    model = _zoo()
    by_name = find_prunable_weights(model, ["head", "conv"])
    assert [w.path for w in by_name] == ["head/kernel", "conv/kernel"]
    by_type = {w.path for w in find_prunable_weights(model, keras.layers.MultiHeadAttention)}
    assert by_type == {"mha/query/kernel", "mha/key/kernel", "mha/value/kernel",
                       "mha/attention_output/kernel"}
    mixed = {w.path for w in find_prunable_weights(model, ["custom", keras.layers.Conv3D])}
    assert mixed == {"custom/w", "conv3d/kernel"}


@pytest.mark.parametrize("layers, match", [
    (["head", "nope"], "names no layer of the model: nope"),
    ([keras.layers.LSTM], "names no layer of the model: LSTM"),
    (["bn"], "'bn' \\(BatchNormalization\\) has no prunable weights"),
    ([], "empty"),
])
def test_layer_selection_errors(layers, match):
    with pytest.raises(ValueError, match=match):
        find_prunable_weights(_zoo(), layers)


def test_bad_layers_type():
    with pytest.raises(TypeError, match="layers"):
        Pruning(ConstantSparsity(0.5, 0), layers=[3])


def test_nothing_prunable_is_an_error_at_fit():
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu")])
    model.compile("sgd", "mse")
    with pytest.raises(ValueError, match="Nothing to prune"):
        model.fit(np.ones((8, 4)), np.ones((8, 4)), verbose=0,
                  callbacks=[Pruning(ConstantSparsity(0.5, 0))])
