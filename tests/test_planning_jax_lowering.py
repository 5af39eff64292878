"""`plan(..., compiler="tpu")` on TensorFlow: XLA:TPU plans the model's JAX lowering.

The TensorFlow process sends the model's config to a JAX subprocess
(`planning.jax_lowering`), which rebuilds it with shapes only and plans it with XLA:TPU
for the slice. The reference is the JAX backend's own plan of the same architecture,
computed in a second, independent JAX subprocess. Tests that compile need JAX and
libtpu (`pip install "keras-tpu-mem[jax,tpu-plan]"`) and skip without them; the checks
made before any subprocess runs are tested everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import jax_lowering
from keras_tpu_mem.planning.budget import DeviceBudget
from keras_tpu_mem.planning.by_layer import LayerTable
from keras_tpu_mem.planning.memory_plan import MemoryPlan, Recommendation

needs_xla_tpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None or importlib.util.find_spec("jax") is None,
    reason='needs JAX and libtpu: pip install "keras-tpu-mem[jax,tpu-plan]"')

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def checks_only(monkeypatch):
    """The parent's own checks, which run before the subprocess: on a line without JAX
    (CI's oldest) the JAX check is taken out of the way (it has its own test)."""
    monkeypatch.setattr(jax_lowering, "check_jax", lambda: None)

_MLP = """
import keras
model = keras.Sequential([keras.Input((512,))]
                         + [keras.layers.Dense(1024, activation="relu") for _ in range(4)]
                         + [keras.layers.Dense(16)])
model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
"""

# The same model planned by the JAX backend itself, in a fresh process.
_JAX_REFERENCE = _MLP + """
import keras_tpu_mem as ktm
print("TOTAL", ktm.plan(model, 256, device="v5e-8", compiler="tpu").total_bytes)
"""


def _mlp():
    scope = {}
    exec(_MLP, scope)  # the reference's model, built here on TensorFlow
    return scope["model"]


def _jax_reference() -> subprocess.Popen:
    """The JAX-side plan, started in the background (read with `_total`)."""
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    env.pop("TF_USE_LEGACY_KERAS", None)
    return subprocess.Popen([sys.executable, "-c", _JAX_REFERENCE], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _total(process: subprocess.Popen) -> int:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("TOTAL "))
    return int(line.split()[1])


# ---------------------------------------------------------------- with XLA:TPU (libtpu)
@needs_xla_tpu
def test_plan_on_tensorflow_is_xla_tpu_of_the_jax_lowering():
    assert keras.backend.backend() == "tensorflow"
    reference = _jax_reference()  # runs while this process plans
    model = _mlp()
    plan = ktm.plan(model, 256, device="v5e-8", compiler="tpu")
    assert isinstance(plan, MemoryPlan)
    assert plan.compiler.startswith("XLA:TPU via the JAX lowering (")
    assert "8 devices" in plan.compiler and "libtpu" in plan.compiler
    assert plan.device.replicas == 8 and plan.per_replica_batch == 32
    assert "the model's JAX lowering" in plan.notes[0]
    assert "Keras' JAX train step" in plan.notes[0]
    assert plan.fits and plan.refused == ""
    assert isinstance(plan.by_layer, LayerTable)
    assert plan.by_layer.total_bytes == plan.total_bytes
    # Rows by the layers' names, which the subprocess rebuilds from the config (Keras
    # numbers them per process: read them from the model).
    assert {model.layers[0].name, model.layers[-1].name} <= set(plan.by_layer.names())
    assert "compiled by XLA:TPU via the JAX lowering" in str(plan)
    expected = _total(reference)
    assert abs(plan.total_bytes - expected) <= 0.01 * expected, (plan.total_bytes, expected)


@needs_xla_tpu
def test_feature_callbacks_mirrored_model_and_sample_batch(mirrored):
    with mirrored.strategy.scope():  # only its config is sent
        model = _mlp()
    x = tf.zeros((4, 512))
    y = np.zeros((4, 16), dtype="float32")
    plan = ktm.plan(model, 256, device="v5e-8", compiler="tpu", by_layer=False,
                    callbacks=[ktm.GradientAccumulation(4), keras.callbacks.History()],
                    sample_batch=(x, y))
    assert plan.features == ("GradientAccumulation",)
    assert plan.accumulation_steps == 4 and plan.micro_batch == 8
    assert plan.accumulator_bytes > 0
    assert "the engine's JAX step for GradientAccumulation" in plan.notes[0]
    assert plan.by_layer is None


@needs_xla_tpu
def test_an_argument_plan_refuses_in_the_subprocess_is_a_value_error():
    model = _mlp()
    with pytest.raises(ValueError, match=r"mesh.*JAX subprocess"):
        ktm.plan(model, 256, device="v5e-8", compiler="tpu", mesh={"batch": 3})


_LAYERS_MODULE = """
import keras


class Scale(keras.layers.Layer):  # not registered: found by its module
    def __init__(self, factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return self.factor * x

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


@keras.saving.register_keras_serializable(package="KtmJaxLowering")
def halved_mse(y_true, y_pred):
    return 0.5 * keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


class Unrebuildable(Scale):  # its config holds a key its constructor refuses
    def get_config(self):
        return {**super().get_config(), "unexpected": 1}
"""


@pytest.fixture
def layers_module(tmp_path, monkeypatch):
    """An importable module of custom objects, on this process's sys.path only."""
    (tmp_path / "ktm_jax_lowering_layers.py").write_text(_LAYERS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("ktm_jax_lowering_layers")
    yield module
    sys.modules.pop("ktm_jax_lowering_layers", None)
    keras.saving.get_custom_objects().pop("KtmJaxLowering>halved_mse", None)


@needs_xla_tpu
def test_custom_objects_from_an_importable_module(layers_module):
    model = keras.Sequential([keras.Input((64,)), layers_module.Scale(3.0),
                              keras.layers.Dense(128)])
    model.compile(optimizer="adam", loss=layers_module.halved_mse)
    plan = ktm.plan(model, 64, device="v5e-8", compiler="tpu", by_layer=False)
    assert plan.compiler.startswith("XLA:TPU via the JAX lowering")
    assert plan.weight_bytes + plan.optimizer_bytes + plan.other_bytes >= 3 * 4 * (64 * 128)


@needs_xla_tpu
def test_a_model_the_subprocess_cannot_rebuild_is_a_value_error(layers_module):
    model = keras.Sequential([keras.Input((8,)), layers_module.Unrebuildable()])
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"could not rebuild the model.*Unrecognized keyword "
                                         r"arguments passed to Unrebuildable"):
        ktm.plan(model, 16, device="v5e-8", compiler="tpu", by_layer=False)


# ------------------------------------------------------- checks made before the subprocess
def test_a_class_defined_in_a_function_is_named(checks_only):
    class DoubleIt(keras.layers.Layer):
        def call(self, x):
            return 2.0 * x

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), DoubleIt()])
    model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"cannot find these classes: DoubleIt \(inside a "
                                         r"function.*register_keras_serializable"):
        ktm.plan(model, 16, device="v5e-8", compiler="tpu")


def test_a_class_registered_in_a_function_is_named(checks_only):
    custom = keras.saving.get_custom_objects()

    @keras.saving.register_keras_serializable(package="JaxLoweringTest")
    class HalveIt(keras.layers.Layer):
        def call(self, x):
            return 0.5 * x

    try:
        model = keras.Sequential([keras.Input((8,)), HalveIt(), keras.layers.Dense(8)])
        model.compile(optimizer="adam", loss="mse")
        with pytest.raises(ValueError, match=r"HalveIt \(inside a function"):
            jax_lowering.plan_with_jax(model, 16, device="v5e-8")
    finally:
        custom.pop("JaxLoweringTest>HalveIt", None)


def test_without_jax_the_error_names_the_extras(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jax" else find_spec(name, *a))
    model = _mlp()
    with pytest.raises(ValueError, match=r'pip install "keras-tpu-mem\[jax,tpu-plan\]"'):
        ktm.plan(model, 256, device="v5e-8", compiler="tpu")


def test_bad_inputs_name_the_argument(checks_only):
    model = _mlp()
    with pytest.raises(TypeError, match="`model`"):
        jax_lowering.plan_with_jax("model", 256)
    uncompiled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="compile the model first"):
        jax_lowering.plan_with_jax(uncompiled, 256)
    with pytest.raises(ValueError, match="`device` to name a TPU slice"):
        jax_lowering.plan_with_jax(model, 256, device="16GiB")
    with pytest.raises(ValueError, match="`timeout`"):
        jax_lowering.plan_with_jax(model, 256, timeout=0)
    with pytest.raises(TypeError, match="`x_spec`"):
        jax_lowering.plan_with_jax(model, 256, x_spec="512")

    class NoConfig(ktm.GradientAccumulation):
        get_config = None

    with pytest.raises(ValueError, match=r"callbacks\[0\]"):
        jax_lowering.plan_with_jax(model, 256, callbacks=[NoConfig(2)])


def test_specs_are_sent_as_shapes_and_dtypes():
    encode = jax_lowering._encode_structure
    spec = {"a": tf.TensorSpec((None, 8), tf.float32),
            "b": (keras.KerasTensor((None, 3), dtype="int32"),)}
    assert encode(spec, "x_spec", arrays=False) == {"dict": [
        ["a", {"spec": [[None, 8], "float32"]}],
        ["b", {"tuple": [{"spec": [[None, 3], "int32"]}]}]]}
    assert encode([np.zeros((5, 2), "int64")], "sample_batch", arrays=True) == {
        "list": [{"spec": [[1, 2], "int64"]}]}


def test_the_plan_comes_back_whole():
    rec = Recommendation(4, 8, 1000, bf16=True, compiled=True, remat_layers=("d",))
    data = {
        "device": {"name": "v5e-8", "capacity_bytes": 100, "replicas": 8, "source": "x"},
        "global_batch_size": 256, "per_replica_batch": 32, "accumulation_steps": 1,
        "micro_batch": 32, "precision": "float32", "model_precision": "float32",
        "headroom": 0.1, "weight_bytes": 1, "trainable_bytes": 1, "gradient_bytes": 1,
        "optimizer_bytes": 2, "accumulator_bytes": 0, "activation_bytes": 3,
        "data_bytes": 4, "other_bytes": 5, "activations_per_sample": 0.5,
        "activations_fixed": 0.0, "compiled_batches": [32], "extrapolated": False,
        "recommendation": {**rec.__dict__, "remat_layers": ["d"]},
        "bf16_activation_bytes": None, "bf16_total_bytes": None,
        "bf16_recommendation": None, "largest_batch": 7, "notes": ["n"],
        "features": ["GradientAccumulation"],
        "candidates": [{**rec.__dict__, "remat_layers": ["d"]}], "searched": True,
        "by_layer": {"rows": [["d", 1, 2, 3, 9]], "peak_bytes": 9, "total_bytes": 15},
        "by_layer_of": "the planned step",
        "compiler": "XLA:TPU (TPU v5 lite, v5e:2x4, 8 devices, libtpu 0.0.42.1)",
        "refused": "", "pulled": True}
    plan = jax_lowering.plan_from_json(data, features=True)
    assert plan.device == DeviceBudget("v5e-8", 100, 8, "x")
    assert plan.recommendation == rec and plan.candidates == (rec,)
    assert plan.compiler == ("XLA:TPU via the JAX lowering (TPU v5 lite, v5e:2x4, 8 "
                             "devices, libtpu 0.0.42.1)")
    assert plan.notes[1:] == ("n",) and "GradientAccumulation" in plan.notes[0]
    assert plan.by_layer["d"].at_peak == 9 and plan.by_layer.slack_bytes == 6
    assert plan.total_bytes == 15 and plan.compiled_batches == (32,)
    assert plan.pulled  # micro-batches pulled from the dataset, planned in the worker
