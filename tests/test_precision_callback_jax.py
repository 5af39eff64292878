"""MixedBFloat16 on the JAX backend: what only JAX's step shows.

The behaviours both backends share (the digits accuracy floor under DataParallel(8), with
accumulation, keep_after_fit, resume) are test_precision_callback.py's, collected on JAX too."""

from __future__ import annotations

import keras
from helpers_jax import RecordingDense, make_distribution, max_abs_diff

from keras_tpu_mem.precision import MixedBFloat16

BATCH = 64  # every batch (the last validation one too) divides by the 8 devices
EPOCHS = 12


class OutputDtype(keras.metrics.Metric):
    """Records the dtype of `y_pred` (the model's output as the loss sees it) when traced."""

    seen: list = []

    def __init__(self):
        super().__init__(name="output_dtype")
        self.calls = self.add_variable(shape=(), initializer="zeros", name="calls")

    def update_state(self, y_true, y_pred, sample_weight=None):
        OutputDtype.seen.append(keras.backend.standardize_dtype(y_pred.dtype))
        self.calls.assign_add(1.0)

    def result(self):
        return keras.ops.convert_to_tensor(self.calls)


class VariableDtypes(keras.callbacks.Callback):
    """Every variable's dtype (model and optimizer), read during the fit."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def on_train_batch_end(self, batch, logs=None):
        model = self.model
        self.dtypes |= {keras.backend.standardize_dtype(v.dtype)
                        for v in [*model.variables, *model.optimizer.variables]
                        if keras.backend.is_float_dtype(v.dtype)}


def _digits_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((64,)),
        RecordingDense(128, activation="relu", name="dense_hidden"),
        keras.layers.Dense(128, activation="relu", name="dense_hidden_2"),
        keras.layers.Dense(10, name="dense_head"),
    ])


def _fit(digits, callbacks):
    (x, y), (x_val, y_val) = digits
    x, y = x[:22 * BATCH], y[:22 * BATCH]
    x_val, y_val = x_val[:352], y_val[:352]  # batches of 64 and a last one of 32
    with make_distribution("dp8").scope():
        model = _digits_model()
        model.compile(optimizer=keras.optimizers.Adam(3e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy", OutputDtype()])
        # Builds metrics and optimizer before the record starts (fit's own
        # symbolic build traces the model before any callback runs).
        model.evaluate(x_val[:BATCH], y_val[:BATCH], batch_size=BATCH, verbose=0)
        RecordingDense.seen.clear()
        OutputDtype.seen.clear()
        dtypes = VariableDtypes()
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                            validation_data=(x_val, y_val),
                            callbacks=[*callbacks, dtypes])
        # What fit traced (training and validation), before predict traces again.
        record = {
            "hidden": {dtype for _, dtype in RecordingDense.seen},
            "outputs": set(OutputDtype.seen),
            "variables": dtypes.dtypes,
            "val_accuracy": history.history["val_accuracy"][-1],
        }
        predictions = model.predict(x_val, batch_size=BATCH, verbose=0)
    return model, predictions, record


def test_output_layer_forward_is_exactly_float32(digits):
    # The head's float32 forward pass with a bfloat16 backward: its value is
    # that of a plain float32 head on the same (bfloat16) input.
    (x, _), _ = digits
    model = _digits_model()
    callback = MixedBFloat16()
    callback.install(model)
    try:
        hidden = keras.Sequential(model.layers[:-1])(x[:64])
        head = model.layers[-1]
        got = head(hidden)
        expected = hidden.astype("float32") @ head.kernel.value + head.bias.value
    finally:
        callback.uninstall(model)
    assert keras.backend.standardize_dtype(got.dtype) == "float32"
    assert max_abs_diff([got], [expected]) <= 1e-5
