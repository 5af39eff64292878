"""Every Keras/TensorFlow internal the package reaches, called by name.

A Keras or TensorFlow release that moves one of them fails here first, with
the accessor's name in the test id, instead of somewhere inside a fit.
"""

from __future__ import annotations

import inspect
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import mlp, sparse_ce

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._compat import tensorflow as tf_compat

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "keras_tpu_mem"


def _compiled_mlp():
    model = mlp()
    model.compile(optimizer="sgd", loss=sparse_ce(), metrics=["accuracy"])
    return model


def test_scale_and_unscale_loss_for_distribution(mirrored):
    assert float(keras_compat.scale_loss_for_distribution(tf.constant(3.0))) == 3.0

    def replica():
        scaled = keras_compat.scale_loss_for_distribution(tf.constant(3.0))
        return scaled, keras_compat.unscale_loss_for_distribution(scaled)

    scaled, unscaled = mirrored.strategy.run(replica)
    assert [float(v) for v in mirrored.strategy.experimental_local_results(scaled)] == [1.5, 1.5]
    assert [float(v) for v in mirrored.strategy.experimental_local_results(unscaled)] == [3.0, 3.0]


def test_reduce_weighted_values():
    values = tf.constant([1.0, 2.0, 3.0, 6.0])
    weights = tf.constant([1.0, 1.0, 0.0, 0.5])
    got = keras_compat.reduce_weighted_values(values, sample_weight=weights,
                                              reduction="sum_over_batch_size", dtype="float32")
    np.testing.assert_allclose(float(got), (1 + 2 + 0 + 3) / 4, rtol=1e-6)


def test_functional_class_flatten_layers_inbound_node():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))
    assert isinstance(model, keras_compat.functional_class())
    # Sequential is not Functional in Keras 3 (precision.py checks both).
    assert not isinstance(keras.Sequential([keras.Input((4,))]), keras_compat.functional_class())
    names = [layer.name for layer in keras_compat.flatten_layers(model, include_self=False)]
    assert names[-2:] == ["hidden", "head"]
    history = model.outputs[0]._keras_history
    node = keras_compat.inbound_node(history.operation, history.node_index)
    assert node.input_tensors[0] is hidden


def test_convert_input_args_and_autocast_scope():
    layer = keras.layers.Dense(2)
    original = keras_compat.convert_input_args(layer)
    assert isinstance(original, bool)
    keras_compat.set_convert_input_args(layer, not original)
    assert keras_compat.convert_input_args(layer) is (not original)
    variable = keras.Variable(np.ones((2,), "float32"))
    with keras_compat.autocast_scope("bfloat16"):
        assert keras.backend.standardize_dtype(variable.value.dtype) == "bfloat16"


def test_trainer_internals(digits):
    (x, y), _ = digits
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss=sparse_ce(), metrics=["accuracy"])
    assert keras_compat.compiled_loss_object(model) is not None
    # The metrics container exists once the model is compiled with metrics and built.
    model.fit(x[:8], y[:8], epochs=1, verbose=0)
    assert keras_compat.compiled_metrics_object(model) is not None
    assert keras_compat.has_symbolic_build(model)
    keras_compat.symbolic_build(model, (x[:8], y[:8]))
    assert keras_compat.call_has_training_arg(model) is True
    y_pred = model(x[:8])
    loss = keras_compat.compute_loss(model, x[:8], y[:8], y_pred, None)
    expected = sparse_ce()(y[:8], y_pred)
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)
    keras_compat.loss_tracker(model).update_state(loss)


def test_set_initial_epoch_starts_the_running_fit_there():
    """`keras_compat.set_initial_epoch` from on_train_begin: fit starts at that epoch."""
    class StartAt2(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            keras_compat.set_initial_epoch(self.model, 2)

        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

    epochs = []
    model = mlp()
    model.compile(optimizer="sgd", loss=sparse_ce())
    x, y = np.zeros((8, 16), "float32"), np.zeros(8, "int32")
    model.fit(x, y, epochs=4, verbose=0, callbacks=[StartAt2()])
    assert epochs == [2, 3]


def test_fit_data_is_none_outside_a_fit():
    """`keras_compat.fit_data` and `keras_compat.fit_frame` find no running fit here;
    the reads inside a fit, on both backends (for every kind of data): tests/test_resume.py."""
    assert keras_compat.fit_data(mlp()) is None
    assert keras_compat.fit_frame(mlp()) is None


def test_epoch_start_batches_by_hand_and_no_position_outside_a_fit():
    """`keras_compat.epoch_starts` and `keras_compat.epoch_start_batches` on cases
    counted by hand (against Keras' own `EpochIterator` on both backends:
    tests/test_resume.py), and `keras_compat.position_fit_data` refusing where no fit
    runs."""
    # 8 batches, 3 per epoch: epochs begin at 0, 3, 6; epoch 2 ends early at the
    # data's end (batches 6 and 7), so epoch 3 begins a new pass.
    assert [keras_compat.epoch_start_batches(e, 3, 8, 1) for e in range(5)] == [0, 3, 6, 0, 3]
    starts = keras_compat.epoch_starts(3, 8, 1)
    assert [next(starts) for _ in range(5)] == [0, 3, 6, 0, 3]
    # 16 batches, 5 steps in calls of 4 read 8 an epoch: the third epoch opens a pass.
    starts = keras_compat.epoch_starts(5, 16, 4)
    assert [next(starts) for _ in range(4)] == [0, 8, 0, 8]
    # Calls of 2 batches: 2 calls (4 batches) an epoch, endless data.
    assert keras_compat.epoch_start_batches(3, 3, None, 2) == 12
    assert keras_compat.epoch_start_batches(3, None, 8, 1) == 0  # a new pass each epoch
    with pytest.raises(RuntimeError, match="running fit's data iterator"):
        keras_compat.position_fit_data(mlp(), 1)


def test_dataset_shuffles_reads_each_shuffle_of_the_chain():
    """`tf_compat.dataset_shuffles`: `(seeded, reshuffles)` of every `shuffle` under a
    dataset, through batch/map/zip/repeat/prefetch; None for what is not a dataset.
    (Without a global seed: the test's would seed every shuffle.)"""
    tf.random.set_seed(None)
    base = tf.data.Dataset.range(32)
    assert tf_compat.dataset_shuffles(base.batch(4)) == []
    assert tf_compat.dataset_shuffles(base.shuffle(8).batch(4).prefetch(2)) == [(False, True)]
    seeded = base.shuffle(8, seed=3).map(lambda v: v + 1).repeat().batch(4)
    assert tf_compat.dataset_shuffles(seeded) == [(True, True)]
    fixed = base.shuffle(8, seed=3, reshuffle_each_iteration=False)
    assert sorted(tf_compat.dataset_shuffles(tf.data.Dataset.zip((fixed, base.shuffle(4))))) \
        == [(False, True), (True, False)]
    assert tf_compat.dataset_shuffles(np.zeros(3)) is None


def test_model_strategy(mirrored):
    assert keras_compat.model_strategy(mlp()) is None  # made outside any strategy scope
    with mirrored.strategy.scope():
        model = mlp()
    assert keras_compat.model_strategy(model) is mirrored.strategy


def test_aggregate_additional_loss():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(
        1, kernel_regularizer=keras.regularizers.L2(0.5), kernel_initializer="ones")])
    model.compile(optimizer="sgd", loss="mse")
    (reg,) = model.losses
    np.testing.assert_allclose(float(keras_compat.aggregate_additional_loss(model, reg)), 1.0,
                               rtol=1e-6)


def test_backend_trainer_class():
    trainer = keras_compat.backend_trainer_class()
    assert issubclass(keras.Model, trainer)
    assert hasattr(trainer, "train_step") and hasattr(trainer, "make_train_function")


def test_maybe_merge_call(mirrored):
    variable = None
    with mirrored.strategy.scope():
        variable = tf.Variable(0.0)

    def replica():
        def merged(strategy, value):
            return strategy.extended.update(variable, lambda v, d: v.assign_add(d),
                                            args=(value,), group=False)

        return tf_compat.maybe_merge_call(merged, tf.distribute.get_strategy(), 1.0)

    mirrored.strategy.run(replica)
    assert float(variable.read_value()) == 1.0  # one update, not one per replica


def test_reduce_per_replica(mirrored):
    outputs = mirrored.strategy.run(lambda: {"loss": tf.constant(2.0)})
    reduced = tf_compat.reduce_per_replica(outputs, mirrored.strategy, reduction="auto")
    assert float(reduced["loss"]) == 2.0


def test_make_keras_train_function_and_per_replica_parts(mirrored):
    model = _compiled_mlp()
    fn = tf_compat.make_keras_train_function(model, model.train_step)
    assert callable(fn)
    dataset = mirrored.strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(np.zeros((8, 3), "float32")).batch(4))
    parts = tf_compat.per_replica_parts(dataset.element_spec)
    assert parts is not None and len(parts) == 2
    assert tf_compat.per_replica_parts(tf.TensorSpec((4, 3))) is None


def test_variable_layout_set_variable_layout_and_name_scope_callers():
    variable = keras.Variable(np.zeros((2, 3), "float32"), name="v")
    assert keras_compat.variable_layout(variable) is None
    layout = keras.distribution.TensorLayout((None, None))
    keras_compat.set_variable_layout(variable, layout)
    assert keras_compat.variable_layout(variable) is layout
    keras_compat.set_variable_layout(variable, None)
    assert keras_compat.variable_layout(variable) is None
    optimizer = keras.optimizers.SGD()
    assert optimizer not in keras_compat.name_scope_callers()
    with keras.name_scope("outer"), keras.name_scope("sgd", caller=optimizer):
        assert keras_compat.name_scope_callers()[-1] is optimizer
    assert optimizer not in keras_compat.name_scope_callers()


def test_no_internal_reach_outside_compat():
    """Issue 12's floor: private Keras/TF imports only in `_compat`."""
    pattern = re.compile(r"keras\.src|tf\.__internal__|from tensorflow\.python")
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "_compat" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("name", sorted(
    n for n in dir(keras_compat) if not n.startswith("_") and callable(getattr(keras_compat, n))
    and getattr(getattr(keras_compat, n), "__module__", "") == keras_compat.__name__))
def test_every_keras_accessor_is_tested_by_name(name):
    """Each accessor of `_compat.keras` appears in a test above (so none goes untested)."""
    source = pathlib.Path(__file__).read_text()
    assert source.count(f"keras_compat.{name}(") >= 1


def test_model_building_finds_the_model_whose_fit_builds_the_optimizer():
    """`model_building`: Keras' fit builds the optimizer from a method of the model."""
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=sparse_ce())
    found = []
    build = model.optimizer.build

    def spy(variables):
        found.append(keras_compat.model_building(model.optimizer))
        return build(variables)

    model.optimizer.build = spy
    x = np.zeros((8,) + tuple(model.inputs[0].shape[1:]), "float32")
    model.fit(x, np.zeros(8, "int32"), epochs=1, verbose=0)
    assert found == [model]
    assert keras_compat.model_building(model.optimizer) is None  # no fit on the stack


def test_in_symbolic_build_is_true_only_inside_keras_build():
    """`in_symbolic_build`: Keras' `_symbolic_build` is on the stack while it builds the
    model from a batch, and not during a plain call."""
    seen = []

    class Spy(keras.layers.Layer):
        def call(self, inputs):
            seen.append(keras_compat.in_symbolic_build())
            return inputs

    model = keras.Sequential([keras.Input((3,)), Spy(), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    seen.clear()
    model(np.zeros((2, 3), "float32"))
    assert seen == [False]
    keras_compat.symbolic_build(model, (np.zeros((2, 3), "float32"), np.zeros((2, 2), "float32")))
    assert seen[1:] and all(seen[1:])
    assert keras_compat.in_symbolic_build() is False


def test_distribution_layout_map():
    """`distribution_layout_map`: the attribute Keras' ModelParallel keeps its LayoutMap in
    (read from its constructor: with Keras 3.12 on TensorFlow no keras.distribution can be
    constructed, its distribution_lib lacks `num_processes`; a real ModelParallel is read in
    tests/test_compat_jax.py)."""
    source = inspect.getsource(keras.distribution.ModelParallel.__init__)
    assert "self._layout_map = layout_map" in source

    class Holder:
        _layout_map = object()

    holder = Holder()
    assert keras_compat.distribution_layout_map(holder) is Holder._layout_map
    assert keras_compat.distribution_layout_map(object()) is None


def _deferred_variable(name="deferred"):
    """A variable Keras defers (no value), taken off Keras' list of variables to
    initialise when a stateless scope exits (else another test's scope would)."""
    with keras.StatelessScope(initialize_variables=False):
        variable = keras.Variable(initializer="zeros", shape=(2,), name=name)
    keras_compat.set_uninitialized_variables(
        v for v in keras_compat.uninitialized_variables() if v is not variable)
    return variable


def test_deferred_variable_internals():
    """in_stateless_scope, has_value, (set_)variable_initializer,
    (set_)uninitialized_variables, initialize_variable_layout, initialize_deferred."""
    assert keras_compat.in_stateless_scope() is False
    with keras.StatelessScope(initialize_variables=False):
        assert keras_compat.in_stateless_scope() is True
        variable = keras.Variable(initializer="zeros", shape=(2,), name="deferred")
    assert not keras_compat.has_value(variable)
    assert any(v is variable for v in keras_compat.uninitialized_variables())
    keras_compat.set_uninitialized_variables(
        v for v in keras_compat.uninitialized_variables() if v is not variable)
    assert not any(v is variable for v in keras_compat.uninitialized_variables())
    ones = keras.initializers.Ones()
    keras_compat.set_variable_initializer(variable, ones)
    assert keras_compat.variable_initializer(variable) is ones
    keras_compat.initialize_variable_layout(variable)  # TensorFlow: no layouts
    assert keras_compat.variable_layout(variable) is None
    keras_compat.initialize_deferred(variable)
    assert keras_compat.has_value(variable) and variable.numpy().tolist() == [1.0, 1.0]
    assert keras_compat.variable_initializer(variable) is None


def test_set_initialized_value():
    variable = _deferred_variable()
    keras_compat.set_initialized_value(variable, tf.Variable([3.0, 4.0]))
    assert variable.numpy().tolist() == [3.0, 4.0]
    assert keras_compat.variable_initializer(variable) is None


def test_intercept_variable_init_and_intercept_direct_assign():
    from keras_tpu_mem import shapes

    seen = []

    def init_spy(init, variable, initializer, shape, dtype, *args, **kwargs):
        seen.append(("init", kwargs.get("name")))
        init(variable, initializer, shape, dtype, *args, **kwargs)

    def assign_spy(own, variable, value):
        seen.append(("assign", variable.name))
        return own(variable, value)

    try:
        keras_compat.intercept_variable_init(init_spy)
        keras_compat.intercept_direct_assign(assign_spy)
        keras_compat.intercept_variable_init(init_spy)  # once: not wrapped twice
        variable = keras.Variable(np.zeros(2, "float32"), name="spied")
        variable.assign(np.ones(2, "float32"))
    finally:
        shapes._install()  # keras_tpu_mem.shapes' own interceptors back
    assert seen == [("init", "spied"), ("assign", "spied")]
    assert variable.numpy().tolist() == [1.0, 1.0]


def test_intercept_model_runs_sees_fit_evaluate_and_predict_through_a_subclass():
    from keras_tpu_mem import shapes

    class Pipeline(keras.Sequential):
        """Overrides `fit` and calls Keras' (keras-hub's `PipelineModel` does)."""

        def fit(self, *args, **kwargs):
            return super().fit(*args, **kwargs)

    seen = []

    def run_spy(own, model, method, *args, **kwargs):
        seen.append((model.name, method))
        return own(model, *args, **kwargs)

    model = Pipeline([keras.Input((4,)), keras.layers.Dense(2)], name="piped")
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((4, 4), "float32"), np.zeros((4, 2), "float32")
    try:
        keras_compat.intercept_model_runs(run_spy)
        keras_compat.intercept_model_runs(run_spy)  # once: not wrapped twice
        model.fit(x, y, epochs=1, verbose=0)
        model.evaluate(x, y, verbose=0)
        model.predict(x, verbose=0)
    finally:
        shapes._install()  # keras_tpu_mem.shapes' own interceptors back
    assert seen == [("piped", "fit"), ("piped", "evaluate"), ("piped", "predict")]


def test_intercept_slot_creation_intercept_variable_key_and_rekey_optimizer():
    from keras_tpu_mem import shapes

    calls = []

    def slot_spy(own, base, optimizer, reference, name, initializer):
        calls.append(name)
        return own(optimizer, reference, name=name, initializer=initializer)

    def key_spy(own, optimizer, variable):
        calls.append("key")
        return own(optimizer, variable)

    model = mlp()
    optimizer = keras.optimizers.Adam()
    try:
        keras_compat.intercept_slot_creation(slot_spy)
        keras_compat.intercept_variable_key(key_spy)
        optimizer.build(model.trainable_variables)
    finally:
        shapes._install()
    assert {"momentum", "velocity", "key"} <= set(calls)
    indices = dict(optimizer._trainable_variables_indices)
    optimizer._trainable_variables_indices = {}
    keras_compat.rekey_optimizer(optimizer)
    assert optimizer._trainable_variables_indices == indices


def test_optimizer_slot_positions_follow_keras_slot_index():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="a"),
                              keras.layers.Dense(4, name="b")])
    weights = model.trainable_variables
    for optimizer, slots_each in ((keras.optimizers.Adam(), 2),
                                  (keras.optimizers.SGD(momentum=0.9), 1),
                                  (keras.optimizers.LossScaleOptimizer(
                                      keras.optimizers.Adam()), 2),
                                  (keras.optimizers.SGD(), 0)):
        optimizer.build(weights)
        variables = optimizer.variables
        found = keras_compat.optimizer_slot_positions(optimizer, weights)
        for weight, positions in zip(weights, found):
            prefix = weight.path.replace("/", "_") + "_"  # Keras' slot names
            expected = [i for i, v in enumerate(variables) if v.name.startswith(prefix)]
            assert positions == expected, (type(optimizer).__name__, weight.path)
        assert [len(p) for p in found] == [slots_each] * len(weights)
    stranger = keras.Variable(np.zeros((4,), "float32"))
    assert keras_compat.optimizer_slot_positions(keras.optimizers.Adam(), [stranger]) == [[]]


def test_compile_metric_variables_before_any_build():
    """`_compat.keras.compile_metric_variables`: the variables of metric objects given to
    `compile` (Keras' `CompileMetrics._user_metrics` / `_user_weighted_metrics`), which
    `model.metrics_variables` lists only once the compiled metrics are built."""
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    weighted = keras.metrics.Mean(name="weighted_mean")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=[accuracy, "mae"], weighted_metrics=[weighted])
    found = keras_compat.compile_metric_variables(model)
    assert [id(v) for v in found] == [id(v) for v in accuracy.variables + weighted.variables]
    listed = {id(v) for v in model.metrics_variables}
    assert not listed & {id(v) for v in found}  # the compiled metrics are not built yet
    assert keras_compat.compile_metric_variables(keras.Sequential()) == []
