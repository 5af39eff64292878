"""`plan` without callbacks on JAX (planning/planner.py): no estimate here, the step is
compiled at the plan's batch with the levers its arguments name, so it must agree with
the same plan asked for with those callbacks (issue 22, item 4)."""

from __future__ import annotations

import pytest
from planning_models import wide_mlp

import keras_tpu_mem as ktm
from keras_tpu_mem.planning import plan


@pytest.fixture(scope="module")
def model():
    return wide_mlp(width=256, depth=2, inputs=128)


def test_the_plainest_plan_works_on_jax(model):
    # The host's compile with the HBM table's capacity (XLA:TPU's: test_planning_target_jax).
    planned = plan(model, 1024, device="v5e-1", compiler="host")
    same = plan(model, 1024, device="v5e-1", callbacks=[], compiler="host")
    assert planned.total_bytes == same.total_bytes > 0
    assert planned.fits and planned.capacity_bytes == 16 * 1000**3
    assert "v5e-1" in str(planned)
    tiny = plan(model, 64, device="3145728B")
    assert tiny.capacity_bytes == 3 * 1024**2


def test_accumulation_and_precision_arguments_are_the_features(model):
    planned = plan(model, 1024, device="16GiB", accumulation_steps=4, precision="bf16")
    by_callbacks = plan(model, 1024, device="16GiB",
                        callbacks=[ktm.GradientAccumulation(4), ktm.MixedBFloat16()])
    assert planned.total_bytes == by_callbacks.total_bytes
    assert planned.accumulation_steps == 4 and planned.precision == "mixed_bfloat16"
    plain = plan(model, 1024, device="16GiB", precision="float32")
    assert plain.total_bytes == plan(model, 1024, device="16GiB").total_bytes


@pytest.mark.parametrize("kwargs, words", [
    (dict(compile_batches=[32, 64]), "compile_batches"),
    (dict(precision="fp8"), "mixed_bfloat16"),
])
def test_bad_arguments_name_what_is_accepted(model, kwargs, words):
    with pytest.raises(ValueError, match=words):
        plan(model, 1024, device="v5e-1", **kwargs)


def test_cli_plan_on_jax_with_and_without_search(tmp_path, capsys):
    """The command line on JAX (issue 22: it was tested on TensorFlow only)."""
    from keras_tpu_mem import cli

    path = tmp_path / "factory.py"
    path.write_text("import keras\n\n"
                    "def build():\n"
                    "    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32),\n"
                    "                              keras.layers.Dense(10)])\n"
                    "    model.compile(optimizer='adam',\n"
                    "                  loss='sparse_categorical_crossentropy')\n"
                    "    return model\n")
    assert cli.main(["plan", "--model", f"{path}:build", "--global-batch", "512",
                     "--device", "v5e-1"]) == 0
    out = capsys.readouterr().out
    assert "Memory plan on v5e-1" in out and "fits: yes" in out
    assert cli.main(["plan", "--model", f"{path}:build", "--global-batch", "512",
                     "--device", "3145728B", "--search"]) == 0
    out = capsys.readouterr().out
    assert "search (compiled" in out
