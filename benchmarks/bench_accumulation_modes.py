"""Both accumulation modes vs plain fit vs Keras' own accumulation, in one run (issue 17).

Model: input 512, 8 x Dense(512, relu), Dense(10); 4 updates of a global batch
of 8192 per measured fit, k = 8 (micro-batches of 1024). Configurations:

* plain `fit` at 8192 (the reference of the ratios) and at the micro-batch
  (1024, 32 steps: the memory floor of every accumulation scheme);
* Keras `Adam(gradient_accumulation_steps=8)` fed micro-batches of 1024 (the
  peer; default strategy only: it fails under MirroredStrategy,
  keras-team/keras#20582);
* `GradientAccumulation(8)` fed global batches of 8192;
* `GradientAccumulation(8, dataset_yields="micro_batches")` fed micro-batches.

Each without and with `jit_compile=True`, on the default strategy, and (ours
and plain fit) under MirroredStrategy over 2 logical CPUs. Memory: the CPU
allocator's peak above the bytes held before the fit (oneDNN on; the peaks
repeat to the MiB). Time: median over `--reps` interleaved repetitions of the
seconds per global batch (8192 samples), since single epochs vary by ±30% here.

Run:  python benchmarks/bench_accumulation_modes.py [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Allocator statistics exist only with oneDNN on (off by default on AVX2 CPUs).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_tpu_mem import GradientAccumulation  # noqa: E402
from keras_tpu_mem.devices import read_memory, reset_peak  # noqa: E402

GLOBAL, K, UPDATES = 8192, 8, 4
MICRO = GLOBAL // K
MIB = 1024 * 1024


def build(strategy, jit, optimizer=None):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((512,))] + [keras.layers.Dense(512, activation="relu")
                                     for _ in range(8)] + [keras.layers.Dense(10)])
        model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit)
    return model


def dataset(batch, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 512)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    # One batch repeated: the pipeline holds one batch, as a cached feed would.
    return tf.data.Dataset.from_tensors((x, y)).repeat(steps).prefetch(1)


class Config:
    def __init__(self, name, strategy_name, strategy, jit, batch, callbacks=(), optimizer=None):
        self.name, self.strategy_name, self.jit = name, strategy_name, jit
        self.batch, self.callbacks = batch, list(callbacks)
        self.steps = UPDATES * GLOBAL // batch
        self.model = build(strategy, jit, optimizer)
        self.times, self.peaks = [], []

    def run(self):
        data = dataset(self.batch, self.steps)
        reset_peak("CPU:0")
        before = read_memory("CPU:0")[0]
        start = time.perf_counter()
        self.model.fit(data, epochs=1, verbose=0, callbacks=self.callbacks)
        elapsed = time.perf_counter() - start
        self.peaks.append(read_memory("CPU:0")[1] - before)
        return elapsed / UPDATES

    def row(self):
        return {"config": self.name, "strategy": self.strategy_name, "jit": self.jit,
                "peak_mib": max(self.peaks) / MIB,
                "seconds_per_global_batch": statistics.median(self.times)}


def configs(strategy_name, strategy, jit):
    out = [
        Config("plain fit @ 8192", strategy_name, strategy, jit, GLOBAL),
        Config("plain fit @ 1024", strategy_name, strategy, jit, MICRO),
        Config("ours, global batches", strategy_name, strategy, jit, GLOBAL,
               [GradientAccumulation(K)]),
        Config("ours, micro-batches", strategy_name, strategy, jit, MICRO,
               [GradientAccumulation(K, dataset_yields="micro_batches")]),
    ]
    if strategy_name == "default":
        out.append(Config("Keras gradient_accumulation_steps=8", strategy_name, strategy, jit,
                          MICRO, optimizer=keras.optimizers.Adam(
                              1e-4, gradient_accumulation_steps=K)))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if read_memory("CPU:0") is None:
        raise SystemExit("The CPU allocator is unreadable: run with TF_ENABLE_ONEDNN_OPTS=1.")
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    cells = [("default", tf.distribute.get_strategy(), False),
             ("default", tf.distribute.get_strategy(), True),
             ("mirrored(2)", mirrored, False)]
    # (jit_compile=True together with MirroredStrategy fails inside TensorFlow on CPU.)
    rows = []
    for strategy_name, strategy, jit in cells:
        group = configs(strategy_name, strategy, jit)
        for config in group:
            config.run()            # warm-up: trace and compile
            config.peaks.clear()
        for _ in range(args.reps):
            for config in group:    # interleaved: drift hits every config alike
                config.times.append(config.run())
        group_rows = [c.row() for c in group]
        plain = group_rows[0]
        micro = group_rows[1]
        keras_row = next((r for r in group_rows if r["config"].startswith("Keras")), None)
        for row in group_rows:
            row["peak_vs_plain"] = row["peak_mib"] / plain["peak_mib"]
            row["time_vs_plain"] = row["seconds_per_global_batch"] / plain[
                "seconds_per_global_batch"]
            row["time_vs_micro_fit"] = row["seconds_per_global_batch"] / micro[
                "seconds_per_global_batch"]
            row["peak_vs_keras"] = (row["peak_mib"] / keras_row["peak_mib"]
                                    if keras_row else None)
        rows.extend(group_rows)
        del group
    print("| config | strategy | XLA | peak MiB | × plain peak | × Keras peak "
          "| s / 8192 samples | × plain time | × plain@1024 time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        keras_ratio = "—" if r["peak_vs_keras"] is None else f"{r['peak_vs_keras']:.2f}"
        print(f"| {r['config']} | {r['strategy']} | {'yes' if r['jit'] else 'no'} "
              f"| {r['peak_mib']:.0f} | {r['peak_vs_plain']:.3f} | {keras_ratio} "
              f"| {r['seconds_per_global_batch']:.3f} | {r['time_vs_plain']:.2f} "
              f"| {r['time_vs_micro_fit']:.2f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
