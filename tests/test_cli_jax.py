"""`keras-tpu-mem plan` on JAX (cli.py): the plan, `--search` and `--by-layer` (issue 22
item 2; the TensorFlow twin is test_cli.py). On JAX every plan compiles the step, so
`--by-layer` prints the plan's own table."""

from __future__ import annotations

import importlib.util

import pytest

from keras_tpu_mem import cli
from keras_tpu_mem.planning import compiled_memory, plan

_FACTORY = (
    "import keras\n\n"
    "def build():\n"
    "    model = keras.Sequential([keras.Input((64,)),\n"
    "                              keras.layers.Dense(256, activation='relu'),\n"
    "                              keras.layers.Dense(10)])\n"
    "    model.compile(optimizer='adam', loss='sparse_categorical_crossentropy')\n"
    "    return model\n")


@pytest.fixture
def factory(tmp_path):
    path = tmp_path / "factory.py"
    path.write_text(_FACTORY)
    namespace = {}
    exec(_FACTORY, namespace)
    return f"{path}:build", namespace["build"]


def _split(out):
    plan_text, sep, table_text = out.partition("\n\nMemory by layer of ")
    assert sep, out
    return plan_text, table_text.rstrip("\n").splitlines()


def test_plan_by_layer_prints_the_planned_steps_whole_table(factory, capsys):
    spec, build = factory
    assert cli.main(["plan", "--model", spec, "--global-batch", "512", "--device", "v5e-1",
                     "--by-layer", "--compiler", "host"]) == 0
    plan_text, lines = _split(capsys.readouterr().out)
    assert plan_text.startswith("Memory plan on v5e-1") and "fits: yes" in plan_text
    assert lines[0].startswith("the planned step, per-replica batch 512")
    # The API's table for a model from the same factory: the same totals, every row.
    table = compiled_memory(build(), 512, hlo_text=False).by_layer()
    assert lines[1] == str(table).splitlines()[0]
    assert len(lines) == 1 + 2 + len(table)


@pytest.mark.slow  # two searches (the command's and the API's reference): about 40 s
def test_plan_search_by_layer_prints_the_recommendations_table(factory, capsys):
    spec, build = factory
    whole = compiled_memory(build(), 512, hlo_text=False).total_bytes
    device = f"{whole * 0.6 / 1024**2:.4f}MiB"
    assert cli.main(["plan", "--model", spec, "--global-batch", "512", "--device", device,
                     "--search", "--by-layer"]) == 0
    plan_text, lines = _split(capsys.readouterr().out)
    assert "search (compiled" in plan_text and "-> fits with GradientAccumulation(" in plan_text
    assert lines[0].startswith("the recommendation (GradientAccumulation(")
    planned = plan(build(), 512, device=device, search=True)
    assert lines[0] == planned.by_layer_of + ":"
    assert lines[1] == str(planned.by_layer).splitlines()[0]
    assert len(lines) == 1 + 2 + len(planned.by_layer)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason='needs libtpu: pip install "keras-tpu-mem[tpu-plan]"')
def test_plan_on_a_slice_builds_shapes_only_and_says_xla_tpu(factory, capsys):
    spec, build = factory
    assert cli.main(["plan", "--model", spec, "--batch", "512", "--device", "v5e-8",
                     "--compiler", "tpu"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("Memory plan on v5e-8 (15.75 GiB per replica)")
    assert lines[1].startswith("  compiled by XLA:TPU (TPU v5 lite, v5e:2x4, 8 devices")
    reference = plan(build(), 512, device="v5e-8", compiler="tpu", by_layer=False)
    assert out.count(devices_format(reference.total_bytes)) >= 1


def devices_format(n):
    from keras_tpu_mem.devices import format_bytes

    return format_bytes(n)


def test_plan_help_lists_the_known_slices(capsys):
    try:
        cli.main(["plan", "--help"])
    except SystemExit:  # argparse's exit after printing the help
        pass
    out = " ".join(capsys.readouterr().out.split())
    for name in ("v3-8", "v4-32", "v5e-16", "v6e-256", "--compiler", "--mesh"):
        assert name in out


_SEQUENCE_FACTORY = (
    "import keras\n"
    "import numpy as np\n\n"
    "def build():\n"
    "    tokens = keras.Input((None,), dtype='int32')\n"
    "    h = keras.layers.Embedding(500, 64)(tokens)\n"
    "    h = keras.layers.Dense(128, activation='relu')(h)\n"
    "    outputs = keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h))\n"
    "    model = keras.Model(tokens, outputs)\n"
    "    model.compile(optimizer='adam',\n"
    "                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n"
    "    return model\n\n"
    "def batch():\n"
    "    return np.zeros((2, 96), 'int32'), np.zeros((2,), 'int32')\n")


def test_plan_sample_batch_defines_a_sequence_models_inputs(tmp_path, capsys):
    """`--sample-batch MODULE:FUNCTION`: the step is compiled at the batch's sequence length,
    as `plan(..., sample_batch=...)` compiles it; without it, a model of unknown sequence
    length is an error naming `sample_batch`."""
    path = tmp_path / "sequence.py"
    path.write_text(_SEQUENCE_FACTORY)
    namespace = {}
    exec(_SEQUENCE_FACTORY, namespace)
    argv = ["plan", "--model", f"{path}:build", "--batch", "64", "--device", "1GiB",
            "--compiler", "host"]
    assert cli.main(argv + ["--sample-batch", f"{path}:batch"]) == 0
    out = capsys.readouterr().out
    reference = plan(namespace["build"](), 64, device="1GiB", compiler="host",
                     sample_batch=namespace["batch"](), by_layer=False)
    shorter = plan(namespace["build"](), 64, device="1GiB", compiler="host", by_layer=False,
                   sample_batch=(namespace["batch"]()[0][:, :32], namespace["batch"]()[1]))
    assert reference.activation_bytes > shorter.activation_bytes
    assert devices_format(reference.total_bytes) in out, out
    assert devices_format(shorter.total_bytes) not in out
    assert cli.main(argv + ["--sample-batch", f"{path}:nothing"]) != 0
    assert "--sample-batch: " in capsys.readouterr().err
    # Without it the sequence length is unknown: the error names the way out.
    assert cli.main(argv) != 0
    assert "sample_batch" in capsys.readouterr().err
