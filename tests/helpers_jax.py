"""Shared helpers of the JAX test modules (`*_jax.py`; conftest sets 8 host devices).

`helpers.py` imports TensorFlow; this module imports only Keras, JAX and numpy.
"""

from __future__ import annotations

import contextlib
import re

import jax
import keras
import numpy as np

from keras_tpu_mem._compat import jax as jax_compat

#: The distributions of the JAX test matrix (docs/testing.md).
CASES = ("none", "dp8", "mp2x4")


class RecordingDense(keras.layers.Dense):
    """A Dense layer that records the batch size and dtype of every traced call.

    `seen` is a class-level list of `(batch, input dtype)`; only JAX tracers are
    recorded (the step's trace), not concrete calls, so the record says which
    batch shapes the compiled step was traced with.
    """

    seen: list = []

    def call(self, inputs, *args, **kwargs):
        if isinstance(inputs, jax.core.Tracer):
            RecordingDense.seen.append((int(inputs.shape[0]),
                                        keras.backend.standardize_dtype(inputs.dtype)))
        return super().call(inputs, *args, **kwargs)


def mlp(inputs=16, hidden=32, classes=8, seed=1, recording=True, **dense_kwargs):
    """A small MLP whose widths divide by 4 (for a model axis of 4)."""
    keras.utils.set_random_seed(seed)
    first = RecordingDense if recording else keras.layers.Dense
    return keras.Sequential([
        keras.Input((inputs,)),
        first(hidden, activation="relu", name="dense_in", **dense_kwargs),
        keras.layers.Dense(hidden, activation="relu", name="dense_mid"),
        keras.layers.Dense(classes, name="dense_out"),
    ])


def sparse_ce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def toy_data(n=160, inputs=16, classes=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, inputs)).astype("float32")
    y = rng.integers(0, classes, n).astype("int32")
    return x, y


def make_distribution(case: str, output_layouts=None):
    """None, DataParallel over 8 devices, ModelParallel on a (2, 4) mesh with the
    Dense kernels sharded on the model axis (and `output_layouts`, more LayoutMap
    entries, e.g. `{".*dense_in/output": ("batch", "model")}`), or "fsdp8":
    `ktm.ShardedDataParallel()` over 8 devices (weights and slots split)."""
    if case == "none":
        return None
    if case == "fsdp8":
        from keras_tpu_mem.sharding import ShardedDataParallel

        return ShardedDataParallel(devices=jax.devices()[:8])
    if case == "dp8":
        return keras.distribution.DataParallel(devices=jax.devices()[:8])
    if case == "mp2x4":
        mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], jax.devices()[:8])
        layout = keras.distribution.LayoutMap(mesh)
        layout[".*dense.*kernel"] = (None, "model")
        for key, axes in (output_layouts or {}).items():
            layout[key] = axes
        return keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
    raise ValueError(f"unknown case {case!r}")


@contextlib.contextmanager
def compiled_function_names():
    """Yields a list that collects the name of every function XLA compiles meanwhile.

    `jax.log_compiles()` (public) logs "Compiling jit(NAME) ..." once per
    backend compile, a cache hit logs nothing; the names are read from those
    records.
    """
    import logging

    names: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            found = re.match(r"Compiling (?:jit|pjit)\((\w+)\)", record.getMessage())
            if found:
                names.append(found.group(1))

    handler = Collect(level=logging.DEBUG)
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield names
    finally:
        logger.removeHandler(handler)


def scope(distribution):
    return distribution.scope() if distribution is not None else contextlib.nullcontext()


def max_abs_diff(weights_a, weights_b) -> float:
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(weights_a, weights_b, strict=True))


# ------------------------------------------------------------------- HLO
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)="
                     r"\{?((?:%?[\w.\-]+(?:,\s*)?)+)\}?")
_WHILE_BODY = re.compile(r"\swhile\(.*body=%?([\w.\-]+)")


def hlo_computations(text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines, from `compiled.as_text()`."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" "):
            match = _COMPUTATION.match(line)
            current = match.group(1) if match else None
            if current is not None:
                computations[current] = []
        elif current is not None and line.strip() and line.strip() != "}":
            computations[current].append(line)
    return computations


def _reachable(computations, root) -> set[str]:
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for line in computations[name]:
            for group in _CALLED.findall(line):
                todo.extend(n.strip().lstrip("%") for n in group.split(","))
    return seen


def collectives_in_loop_bodies(text: str, opcode: str = "all-reduce") -> dict[str, int]:
    """For every while loop, how many `opcode` instructions its body (and what the
    body calls) holds."""
    computations = hlo_computations(text)
    counts = {}
    for lines in computations.values():
        for line in lines:
            match = _WHILE_BODY.search(line)
            if match:
                body = match.group(1)
                if not computations.get(body):
                    raise AssertionError(f"while body {body!r} not parsed from the HLO")
                counts[body] = sum(
                    _count_opcode(computations[name], opcode)
                    for name in _reachable(computations, body))
    return counts


def _count_opcode(lines, opcode) -> int:
    pattern = re.compile(rf"=\s*\S.*?\s{re.escape(opcode)}(?:-start)?\(")
    return sum(1 for line in lines if pattern.search(line))


def count_opcode(text: str, opcode: str) -> int:
    """Instructions with `opcode` in the whole compiled module."""
    return sum(_count_opcode(lines, opcode) for lines in hlo_computations(text).values())


def compiled_text(model, data) -> str:
    """The optimised HLO of the model's engine step for one batch `data`."""
    step = model.train_function.jitted_step
    state = jax_compat.jax_state(model)
    return step.lower(state, jax_compat.distribute_data(data)).compile().as_text()
