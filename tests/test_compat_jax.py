"""Every JAX / Keras-JAX internal the package reaches (`keras_tpu_mem._compat.jax`),
called by name: a release that moves one fails here, with the accessor's name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from helpers import make_distribution, mesh_mlp, scope, sparse_ce, toy_data
from jax.sharding import PartitionSpec

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem._compat import keras as keras_compat


def _compiled(distribution=None):
    with scope(distribution):
        model = mesh_mlp()
        model.compile(optimizer="adam", loss=sparse_ce(), metrics=["accuracy"])
        model.optimizer.build(model.trainable_variables)
    return model


def test_shard_map():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("batch", "model"))

    def local(x):
        return jax.lax.psum(x.sum(axis=0), "batch")

    mapped = jax_compat.shard_map(local, mesh=mesh, in_specs=(PartitionSpec("batch"),),
                                  out_specs=PartitionSpec(), manual_axes={"batch"})
    x = jnp.arange(32.0).reshape(8, 4)
    np.testing.assert_allclose(jax.jit(mapped)(x), np.asarray(x).sum(axis=0))


def test_backend_mesh():
    distribution = make_distribution("mp2x4")
    mesh = jax_compat.backend_mesh(distribution.device_mesh)
    assert isinstance(mesh, jax.sharding.Mesh)
    assert tuple(mesh.axis_names) == ("batch", "model") and mesh.devices.shape == (2, 4)


def test_state_sharding_spec():
    model = _compiled(make_distribution("dp8"))
    trainable, non_trainable, optimizer, metrics = jax_compat.state_sharding_spec(model)
    assert len(trainable) == len(model.trainable_variables)
    assert len(optimizer) == len(model.optimizer.variables)
    assert len(metrics) == len(model.metrics_variables)
    assert all(isinstance(s, jax.sharding.NamedSharding) for s in trainable)


def test_losses_override():
    model = mesh_mlp()
    assert model.losses == []
    with jax_compat.losses_override(model, [jnp.float32(2.0)]):
        assert [float(v) for v in model.losses] == [2.0]
    assert model.losses == []


def test_seed_generators():
    layer = keras.layers.Dropout(0.5, seed=1)
    generators = jax_compat.seed_generators(layer)
    assert len(generators) == 1 and isinstance(generators[0], keras.random.SeedGenerator)
    assert jax_compat.seed_generators(keras.layers.Dense(2)) == []


def test_is_nnx_enabled():
    assert jax_compat.is_nnx_enabled() is False


def test_state_synced_and_set_state_synced():
    model = _compiled()
    flag = jax_compat.state_synced(model)
    assert isinstance(flag, bool)
    jax_compat.set_state_synced(model, False)
    assert model._jax_state_synced is False
    jax_compat.set_state_synced(model, flag)


def test_jax_state():
    model = _compiled()
    state = jax_compat.jax_state(model)
    assert [len(part) for part in state] == [len(model.trainable_variables),
                                             len(model.non_trainable_variables),
                                             len(model.optimizer.variables),
                                             len(model.metrics_variables)]
    assert model.trainable_variables[0].value is not None  # not purged


def test_fit_state_index_and_fit_state_values_read_the_state_without_syncing_it():
    """Mid-epoch, `fit_state_values` reads Keras' training state where the fit holds
    it (`fit_state_index` places each variable; the variables stay unsynced) and
    gives what the `model` property's sync then puts into the variables; a Keras
    variable the index does not place syncs the state."""
    model = _compiled()
    x, y = toy_data()
    other, leaf = keras.Variable(np.full((2,), 3.0, "float32")), type("Leaf", (), {})()
    leaf.value = np.ones(3)
    seen = {}

    class Read(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch != 3:
                return
            own = self._model
            variables = own.variables + own.optimizer.variables + own.metrics_variables
            index = jax_compat.fit_state_index(own)
            read = jax_compat.fit_state_values(own, variables + [leaf], index)
            seen["unsynced"] = not jax_compat.state_synced(own)
            seen["iterations"] = read[[id(v) for v in variables].index(
                id(own.optimizer.iterations))]
            seen["read"] = [np.asarray(value) for value in read]
            seen["synced"] = [np.asarray(v.value) for v in self.model.variables
                              + own.optimizer.variables + own.metrics_variables] + [leaf.value]
            jax_compat.set_state_synced(own, False)  # the state is out again
            seen["other"] = jax_compat.fit_state_values(own, [other], index)[0]
            seen["synced by other"] = jax_compat.state_synced(own)

    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Read()])
    assert seen["unsynced"] and seen["synced by other"]
    assert len(seen["read"]) == len(seen["synced"])
    for read, synced in zip(seen["read"], seen["synced"]):
        np.testing.assert_array_equal(read, synced)
    assert int(seen["iterations"]) == 3  # the state before batch 3, not the variables'
    np.testing.assert_array_equal(seen["other"], [3.0, 3.0])


def test_distribute_data():
    x, y = toy_data(32, classes=8)
    with make_distribution("dp8").scope():
        placed_x, placed_y = jax_compat.distribute_data((x, y))
    assert placed_x.sharding.spec == PartitionSpec("batch", None)
    assert len(placed_x.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(placed_y), y)


def test_tensor_layouts_for_manual_axes():
    distribution = make_distribution("mp2x4", {".*dense_in/output": ("batch", "model")})
    before = distribution.get_tensor_layout("sequential/dense_in/output")
    assert tuple(before.axes) == ("batch", "model")
    with jax_compat.tensor_layouts_for_manual_axes(distribution, {"batch"}):
        inside = distribution.get_tensor_layout("sequential/dense_in/output")
        assert inside == PartitionSpec(None, "model")
        assert distribution.get_tensor_layout("sequential/other/output") is None
    assert "get_tensor_layout" not in distribution.__dict__
    assert tuple(distribution.get_tensor_layout("sequential/dense_in/output").axes) == (
        "batch", "model")


def test_memory_analysis_reads_the_compiled_step_and_refuses_none():
    compiled = jax.jit(lambda a: (a @ a.T).sum()).lower(jnp.ones((64, 32))).compile()
    stats = jax_compat.memory_analysis(compiled)
    assert stats.argument_size_in_bytes == 64 * 32 * 4

    class NoAnalysis:
        def memory_analysis(self):
            return None

    with pytest.raises(RuntimeError, match="memory_analysis\\(\\) returned None"):
        jax_compat.memory_analysis(NoAnalysis())


def test_laid_out_hbm_bytes_reads_xlas_memory_usage_report(tmp_path):
    """`memory_report_options` makes XLA write its memory-usage report and
    `laid_out_hbm_bytes` reads its default memory space's total. On XLA:CPU that total is
    `memory_analysis()`'s (arguments + temporaries + results - aliased) to the byte; on
    XLA:TPU it is not (tests/test_planning_target_jax.py)."""
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.tanh(jnp.tanh(x @ w) @ w.T).sum())(w)

    lowered = jax.jit(step, donate_argnums=0).lower(jnp.ones((256, 256)), jnp.ones((512, 256)))
    compiled = jax_compat.compile_for_memory(
        lowered, "cpu", jax_compat.memory_report_options(str(tmp_path / "report")))
    m = jax_compat.memory_analysis(compiled)
    assert m.temp_size_in_bytes > 0
    assert jax_compat.laid_out_hbm_bytes(str(tmp_path / "report")) == (
        m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
        - m.alias_size_in_bytes)
    report = jax_compat.dumped_text(str(tmp_path / "report"), "memory-usage-report.txt",
                                    "read the report")
    assert report.startswith("Memory Space: default (color=0)")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="memory-usage-report"):
        jax_compat.laid_out_hbm_bytes(str(tmp_path / "empty"))


def test_backends_initialized():
    jax.devices()  # the suite has started JAX's backends by now; make sure
    assert jax_compat.backends_initialized() is True


def test_distribution_layout_map_of_a_model_parallel():
    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], jax.devices()[:8])
    layout_map = keras.distribution.LayoutMap(mesh)
    parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    assert keras_compat.distribution_layout_map(parallel) is layout_map
    assert keras_compat.distribution_layout_map(keras.distribution.DataParallel()) is None


def test_compile_with_dump_writes_buffer_assignment_and_live_ranges(tmp_path):
    lowered = jax.jit(lambda a: jnp.tanh(a @ a.T).sum()).lower(jnp.ones((64, 32)))
    compiled = jax_compat.compile_with_dump(lowered, str(tmp_path))
    assert float(compiled(jnp.ones((64, 32)))) == pytest.approx(64 * 64 * np.tanh(32.0))
    names = [p.name for p in tmp_path.iterdir()]
    for suffix in ("after_optimizations.txt", "after_optimizations-buffer-assignment.txt",
                   "after_optimizations-live-range.txt"):
        assert any(n.endswith(suffix) for n in names), suffix
    live = next(p for p in tmp_path.iterdir() if p.name.endswith("-live-range.txt"))
    assert "(peak)" in live.read_text()
    # No per-pass dumps: only the module before and after optimization.
    assert not any("before_" in n and "optimizations" not in n for n in names)


def test_in_symbolic_build_sees_the_batch_fit_builds_from():
    """`in_symbolic_build`: JAX's fit reads a one-worker PyDataset's first batch inside
    Keras' `_symbolic_build` (before any callback), then the training batches outside it."""
    import keras
    import numpy as np

    calls = []

    class Data(keras.utils.PyDataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            calls.append(keras_compat.in_symbolic_build())
            return np.zeros((4, 3), "float32"), np.zeros((4, 2), "float32")

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(Data(), epochs=1, verbose=0, shuffle=False)
    assert calls[0] is True and calls[-2:] == [False, False]


def test_initialize_variable_layout_and_set_initialized_value():
    """The JAX side of `keras_compat.initialize_variable_layout` (the distribution's
    layout for a deferred variable) and `set_initialized_value` (a laid out value)."""
    with make_distribution("dp8").scope():
        with keras.StatelessScope(initialize_variables=False):
            variable = keras.Variable(initializer="zeros", shape=(8, 4), name="deferred")
        keras_compat.set_uninitialized_variables(
            v for v in keras_compat.uninitialized_variables() if v is not variable)
        assert keras_compat.variable_layout(variable) is None
        keras_compat.initialize_variable_layout(variable)
    layout = keras_compat.variable_layout(variable)
    assert layout is not None
    value = jax.device_put(np.ones((8, 4), "float32"), getattr(layout, "backend_layout", layout))
    keras_compat.set_initialized_value(variable, value)
    assert variable.value is value and keras_compat.variable_initializer(variable) is None


def test_compile_for_memory_reads_what_a_default_compile_reads():
    """`_compat.jax.compile_for_memory` switches LLVM's optimisation off on the host: every
    figure of `memory_analysis()` of a Keras train step (an attention block, Adam) is the
    default compile's, on CPU; a TPU compile gets no such options."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 32))
    h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)(inputs, inputs)
    h = keras.layers.LayerNormalization()(inputs + h)
    h = keras.layers.Dense(64, activation="gelu")(h)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.build((None, 16, 32))
    model.optimizer.build(model.trainable_variables)
    state = (model.trainable_variables, model.non_trainable_variables,
             model.optimizer.variables, model.metrics_variables)
    state = jax.tree_util.tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), state)
    batch = (jax.ShapeDtypeStruct((8, 16, 32), "float32"), jax.ShapeDtypeStruct((8,), "int32"))
    lowered = jax.jit(model.train_step, donate_argnums=0).lower(state, batch)
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes")
    default = jax_compat.memory_analysis(lowered.compile())
    host = jax_compat.memory_analysis(jax_compat.compile_for_memory(lowered, "cpu"))
    for field in fields:
        assert getattr(host, field) == getattr(default, field), field
    assert default.temp_size_in_bytes > 0
    calls = []

    class Lowered:  # what compile_for_memory asks of XLA, per platform
        def compile(self, options=None):
            calls.append(options)

    jax_compat.compile_for_memory(Lowered(), "tpu")
    jax_compat.compile_for_memory(Lowered(), "tpu", {"xla_dump_to": "/x"})
    jax_compat.compile_for_memory(Lowered(), "cpu")
    assert calls == [None, {"xla_dump_to": "/x"}, jax_compat._MEMORY_ONLY_HOST_OPTIONS]
