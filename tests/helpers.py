"""The shared test helpers: tiny models, data, fits and comparisons, and HLO readers.

Imports only Keras and numpy at the top, so that both backends' tests use it:
`batched` gives a tf.data pipeline on TensorFlow and the same batches as a
`keras.utils.PyDataset` on JAX (no TensorFlow imported there); what needs JAX (the
distribution matrix, `RecordingDense`, the HLO readers) imports it where it runs.
"""

from __future__ import annotations

import contextlib
import re

import keras
import numpy as np


# ------------------------------------------------------- models and data
def mlp(inputs=16, hidden=32, classes=5, seed=1):
    """16 -> 32 -> 5, unnamed layers."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(classes),
    ])


def sparse_ce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def toy_data(n=160, inputs=16, classes=5, seed=0):
    """`n` float32 rows of `inputs` standard normals and int32 labels below `classes`."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, inputs)).astype("float32")
    y = rng.integers(0, classes, n).astype("int32")
    return x, y


def batched(x, y, batch, sample_weight=None):
    """`(x, y[, sample_weight])` in batches of `batch`, the last partial one dropped."""
    parts = (x, y) if sample_weight is None else (x, y, sample_weight)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices(parts).batch(batch, drop_remainder=True)
    return _Batches(parts, batch)


class _Batches(keras.utils.PyDataset):
    """tf.data's `.batch(batch, drop_remainder=True)` of numpy arrays, in order."""

    def __init__(self, parts, batch):
        super().__init__()
        self.parts, self.batch = parts, batch

    def __len__(self):
        return len(self.parts[0]) // self.batch

    def __getitem__(self, index):
        window = slice(index * self.batch, (index + 1) * self.batch)
        return tuple(part[window] for part in self.parts)


def max_abs_diff(weights_a, weights_b) -> float:
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(weights_a, weights_b, strict=True))


class RaiseAtEpoch(keras.callbacks.Callback):
    """Simulates an interruption (preemption) at the start of an epoch."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError(f"interrupted at epoch {epoch}")


# ------------------------------------------------- the JAX test matrix
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
        import jax

        if isinstance(inputs, jax.core.Tracer):
            RecordingDense.seen.append((int(inputs.shape[0]),
                                        keras.backend.standardize_dtype(inputs.dtype)))
        return super().call(inputs, *args, **kwargs)


def mesh_mlp(inputs=16, hidden=32, classes=8, seed=1, recording=True, **dense_kwargs):
    """16 -> 32 -> 32 -> 8 with named layers (`dense_in`, `dense_mid`, `dense_out`), widths
    that divide by 4 (for a model axis of 4); the first layer a `RecordingDense`."""
    keras.utils.set_random_seed(seed)
    first = RecordingDense if recording else keras.layers.Dense
    return keras.Sequential([
        keras.Input((inputs,)),
        first(hidden, activation="relu", name="dense_in", **dense_kwargs),
        keras.layers.Dense(hidden, activation="relu", name="dense_mid"),
        keras.layers.Dense(classes, name="dense_out"),
    ])


def make_distribution(case: str, output_layouts=None):
    """None, DataParallel over 8 devices, ModelParallel on a (2, 4) mesh with the
    Dense kernels sharded on the model axis (and `output_layouts`, more LayoutMap
    entries, e.g. `{".*dense_in/output": ("batch", "model")}`), or "fsdp8":
    `ktm.ShardedDataParallel()` over 8 devices (weights and slots split)."""
    if case == "none":
        return None
    import jax

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

    import jax

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
    from keras_tpu_mem._compat import jax as jax_compat

    step = model.train_function.jitted_step
    state = jax_compat.jax_state(model)
    return step.lower(state, jax_compat.distribute_data(data)).compile().as_text()


# ------------------------------------------- sharded state (JAX, 8 devices)
def small_model(seed=0):
    """16 -> 64 -> 32 -> 10: every kernel splits over 8 devices; the head's bias
    (10,) does not."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="dense_in"),
        keras.layers.Dense(32, activation="relu", name="dense_mid"),
        keras.layers.Dense(10, name="dense_out"),
    ])


def issue_mlp(seed=0):
    """The issue's MLP: 512 inputs, 4 x Dense(1024), a 16-way head."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((512,))]
        + [keras.layers.Dense(1024, activation="relu") for _ in range(4)]
        + [keras.layers.Dense(16)])


def compile_adam(model, learning_rate=1e-2, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


def fit_under(distribution, *, init=None, callbacks=(), epochs=1, model_fn=small_model,
        **compile_kwargs):
    """Builds, compiles and fits in `distribution`'s scope: 160 examples at global
    batch 32 (5 updates an epoch), in order."""
    x, y = toy_data(classes=10)
    with distribution.scope():
        model = model_fn()
        if init is not None:
            model.set_weights(init)
        compile_adam(model, **compile_kwargs)
        model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=list(callbacks))
    return model


def max_weight_diff(model_a, model_b) -> float:
    return max_abs_diff(model_a.get_weights(), model_b.get_weights())


def state_bytes(compiled) -> int:
    """Per-device bytes of the step's arguments less the batch: the model state."""
    return compiled.argument_bytes - compiled.data_bytes
