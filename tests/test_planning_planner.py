"""`plan()`'s estimate (planning/planner.py, budget.py, memory_plan.py) on TensorFlow:
extrapolation, budgets, recommendations, bf16, bad arguments, and `keras-tpu-mem plan`.

References are independent of the code under test: extrapolations are checked against a
direct XLA compile at the target batch, accumulation against a plan at the micro-batch,
recommendations against plans of the recommended configuration.
"""

from __future__ import annotations

import keras
import pytest
from planning_models import digits_mlp, nbytes, small_convnet, small_transformer

from keras_tpu_mem import cli
from keras_tpu_mem.planning import compiled_memory, plan
from keras_tpu_mem.planning.budget import DeviceBudget, model_precision

MIB = 1024**2


@pytest.fixture(scope="module")
def mlp():
    """One digits MLP shared by the tests that only plan it: its compiles are cached."""
    return digits_mlp()


@pytest.mark.parametrize("build", ["mlp", small_convnet, small_transformer],
                         ids=["mlp", "convnet", "transformer"])
@pytest.mark.slow
def test_plan_extrapolates_activations_within_5_percent(build, request):
    model = request.getfixturevalue("mlp") if build == "mlp" else build()
    result = plan(model, 2048, device="v3-8")  # 8 replicas x 256
    assert result.per_replica_batch == 256 and result.device.replicas == 8
    assert result.extrapolated and max(result.compiled_batches) <= 64
    direct = compiled_memory(model, 256).temp_bytes
    assert abs(result.activation_bytes - direct) / direct < 0.05, (
        result.activation_bytes, direct)


def test_plan_with_accumulation_matches_plan_at_micro_batch(mlp):
    model = mlp
    accumulated = plan(model, 2048, device="v3-8", accumulation_steps=4)
    micro = plan(model, 512, device="v3-8")  # per-replica 64 = the micro-batch
    assert accumulated.micro_batch == micro.per_replica_batch == 64
    assert abs(accumulated.activation_bytes - micro.activation_bytes) <= \
        0.05 * micro.activation_bytes
    trainable = nbytes(model.trainable_weights)
    assert accumulated.accumulator_bytes == trainable and micro.accumulator_bytes == 0
    # The whole per-replica batch still arrives: 256 examples of 64 floats + label.
    assert accumulated.data_bytes == 256 * (64 * 4 + 4)
    assert accumulated.total_bytes == (
        accumulated.weight_bytes + accumulated.optimizer_bytes + trainable
        + accumulated.activation_bytes + accumulated.data_bytes + accumulated.other_bytes)


def test_plan_recommends_smallest_accumulation_that_fits(mlp):
    model = mlp
    full = plan(model, 1024, device="1GiB")  # one device, batch 1024
    by_k = {k: plan(model, 1024, device="1GiB", accumulation_steps=k).total_bytes
            for k in (2, 4, 8)}
    assert by_k[8] < by_k[4] < by_k[2] < full.total_bytes
    # A device between k=4 and k=2: the plan must pick 4 (with 8 also fitting).
    capacity = (by_k[4] + by_k[2]) // 2
    tight = plan(model, 1024, device=DeviceBudget("tight", capacity, 1, "test"),
                 headroom=0.0)
    assert not tight.fits
    assert tight.recommendation is not None
    assert tight.recommendation.accumulation_steps == 4
    assert tight.recommendation.micro_batch == 256
    assert tight.recommendation.total_bytes == by_k[4]
    assert "accumulation_steps=4" in str(tight)
    roomy = plan(model, 1024, device="1GiB")
    assert roomy.fits and roomy.capacity_bytes == 1024**3
    assert roomy.usable_bytes == int(0.9 * 1024**3)


def test_plan_reads_capacity_from_the_hbm_table(mlp):
    v3 = plan(mlp, 256, device="v3-8")
    v5e = plan(mlp, 512, device="v5litepod-16")
    assert v3.capacity_bytes == 16 * 1024**3 and v3.device.replicas == 8
    assert v5e.capacity_bytes == 16 * 1000**3 and v5e.device.replicas == 16
    text = str(v3)
    assert "v3-8" in text and "fits: yes" in text and "layout padding" in text
    by_count = plan(mlp, 64, device="3145728B")  # a byte count (issue 22)
    assert by_count.capacity_bytes == 3 * 1024**2 and by_count.device.replicas == 1
    assert plan(mlp, 64, device="3072KiB").capacity_bytes == 3 * 1024**2


def test_bf16_estimate_halves_the_per_sample_part(mlp):
    model = mlp
    f32 = plan(model, 2048, device="v3-8")
    assert f32.precision == "float32" and f32.bf16_activation_bytes is not None
    # Half the per-sample bytes, plus a bfloat16 copy of the trainable weights.
    expected = (f32.activations_fixed + 0.5 * f32.activations_per_sample * 256
                + nbytes(model.trainable_weights) / 2)
    assert f32.bf16_activation_bytes == pytest.approx(expected, rel=0.01)
    bf16 = plan(model, 2048, device="v3-8", precision="bf16")
    assert bf16.precision == "mixed_bfloat16"
    assert bf16.activation_bytes == f32.bf16_activation_bytes
    assert bf16.weight_bytes == f32.weight_bytes  # mixed_bfloat16 keeps f32 variables


def test_bf16_model_is_recognised_and_planned_as_it_is(mlp):
    f32 = mlp
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        bf16 = digits_mlp()
    finally:
        keras.config.set_dtype_policy("float32")
    assert model_precision(bf16) == "mixed_bfloat16"
    assert model_precision(f32) == "float32"
    f32_mem, bf16_mem = compiled_memory(f32, 64), compiled_memory(bf16, 64)
    # mixed_bfloat16 keeps float32 variables and slots. (Its temporaries on
    # XLA:CPU are no guide to a TPU: the CPU computes many bf16 ops in float32;
    # on TF 2.19 they even exceed the float32 model's.)
    assert bf16_mem.weight_bytes == f32_mem.weight_bytes
    assert bf16_mem.argument_bytes == f32_mem.argument_bytes
    planned = plan(bf16, 512, device="v3-8")
    assert planned.precision == "mixed_bfloat16" and planned.bf16_total_bytes is None
    assert planned.activation_bytes == bf16_mem.temp_bytes  # per replica 64: compiled
    as_f32 = plan(bf16, 512, device="v3-8", precision="float32")
    assert as_f32.activation_bytes > planned.activation_bytes
    assert "estimated" in str(as_f32)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(device="v9-8"), ValueError, "v3-8"),
    (dict(device=8), TypeError, "device"),
    (dict(headroom=1.0), ValueError, "headroom"),
    (dict(headroom=-0.1), ValueError, "headroom"),
    (dict(accumulation_steps=0), ValueError, "accumulation_steps"),
    (dict(accumulation_steps=2.5), TypeError, "accumulation_steps"),
    (dict(accumulation_steps=3), ValueError, "divisors"),
    (dict(precision="fp8"), ValueError, "mixed_bfloat16"),
    (dict(compile_batches=[]), TypeError, "compile_batches"),
])
def test_plan_rejects_bad_arguments(kwargs, error, words):
    with pytest.raises(error, match=words):
        plan(digits_mlp(), 64, **{"device": "v3-8", **kwargs})


def test_plan_rejects_batch_that_does_not_split_over_replicas():
    with pytest.raises(ValueError, match="multiple of 8"):
        plan(digits_mlp(), 100, device="v3-8")
    with pytest.raises(ValueError, match="global_batch_size"):
        plan(digits_mlp(), 0, device="v3-8")


FACTORY = '''
import keras

def build():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model
'''


def test_cli_plan_prints_the_plan(tmp_path, capsys):
    path = tmp_path / "factory.py"
    path.write_text(FACTORY)
    code = cli.main(["plan", "--model", f"{path}:build", "--global-batch", "512",
                     "--device", "v3-8", "--accumulation-steps", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "Memory plan on v3-8" in out and "2 micro-batches of 32" in out and "fits" in out


def test_cli_plan_search_recommends_what_fits(tmp_path, capsys):
    path = tmp_path / "factory.py"
    path.write_text(FACTORY)
    roomy = cli.main(["plan", "--model", f"{path}:build", "--global-batch", "512",
                      "--device", "16GiB", "--search"])
    out = capsys.readouterr().out
    assert roomy == 0 and "fits: yes" in out and "search (compiled" in out
    assert cli.main(["plan", "--model", f"{path}:build", "--global-batch", "512",
                     "--search", "--accumulation-steps", "2"]) == 2
    assert "accumulation_steps" in capsys.readouterr().err


def test_cli_plan_errors_are_messages(tmp_path, capsys):
    path = tmp_path / "factory.py"
    path.write_text(FACTORY)
    assert cli.main(["plan", "--model", f"{path}:build", "--global-batch", "512",
                     "--device", "v99-8"]) == 2
    assert "device" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "no_colon", "--global-batch", "8"]) == 2
    assert "MODULE:FUNCTION" in capsys.readouterr().err


def test_a_shapes_only_model_on_tensorflow_is_refused_naming_the_two_ways():
    """TensorFlow's compile traces the variables themselves: a model built in
    `ktm.shapes_only()` plans through its JAX lowering or after `materialize`."""
    from keras_tpu_mem.shapes import shapes_only

    with shapes_only():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4)])
        model.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"compiler='tpu'.*ktm\.materialize\(model\)"):
        plan(model, 64, device="16GiB", callbacks=[])
