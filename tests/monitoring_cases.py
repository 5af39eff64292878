"""What the monitoring tests share, on both backends (TensorFlow only where asked for)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import host_rss_workload
import keras
import numpy as np
import pytest

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
needs_tensorboard = pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard not installed")
#: The global batch of the TensorFlow tests: the CPU allocator counts only
#: allocations of 256 KiB and more, so their layers are wide and the batch large.
BATCH = 128


def run_host_rss_workload(tmp_path, batch, **env):
    """Runs tests/host_rss_workload.py on this backend in a fresh process.

    `env` is added to this process's environment, e.g. `TF_ENABLE_ONEDNN_OPTS="0"`
    for TensorFlow's CPU allocator without statistics. Returns the workload's
    result, its stderr and its log directory.
    """
    log_dir = tmp_path / f"logs{batch}"
    backend = os.environ["KERAS_BACKEND"]
    env = dict(os.environ, KERAS_BACKEND=backend, **env)
    done = subprocess.run([sys.executable, str(host_rss_workload.__file__), backend,
                           str(batch), str(log_dir)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):]), done.stderr, log_dir


def log_messages(records, needle):
    return [r.getMessage() for r in records if needle in r.getMessage()]


def assert_no_crash(records):
    assert not log_messages(records, "switched off"), log_messages(records, "switched off")


def dense_mlp(units=1024, inputs=64, depth=1):
    """The TensorFlow tests' model: wide enough for the CPU allocator to count."""
    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(units, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(10)]
    return keras.Sequential(layers)


def small_mlp(units=64, inputs=16, classes=8):
    """The JAX tests' model (the host RSS has no allocation threshold)."""
    return keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(units, activation="relu", name="dense_in"),
        keras.layers.Dense(classes, name="dense_out"),
    ])


def compile_model(model, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kwargs)
    return model


def random_data(n=256, inputs=16, classes=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, inputs)).astype("float32"),
            rng.integers(0, classes, n).astype("int32"))


def tf_batches(x, y, batch=BATCH, drop_remainder=True):
    """A batched `tf.data.Dataset` (TensorFlow tests only: imports TensorFlow)."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=drop_remainder)


def read_timeline(log_dir, subdir):
    with open(os.path.join(log_dir, subdir, "timeline.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def event_accumulator(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def text_summary(accumulator, tag) -> str:
    """The text of a TensorBoard text summary (Text tab) as TensorBoard decodes it."""
    (event,) = accumulator.Tensors(tag)
    return b"".join(event.tensor_proto.string_val).decode("utf-8")


def mesh_names(distribution):
    """The reference: device names straight from the distribution's mesh."""
    return sorted((f"CPU:{d.id}" for d in np.asarray(distribution.device_mesh.devices).flat),
                  key=lambda n: int(n.split(":")[1]))


class BatchLogs(keras.callbacks.Callback):
    """Placed after the monitors: records what later callbacks see in the logs."""

    def __init__(self):
        super().__init__()
        self.batch_keys = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_keys.append(set(logs or {}))
