"""GradientAccumulation vs plain fit vs Keras' own accumulation, side by side in one run.

For two models at a fixed global batch:

* activation-dominated: input 512, 8 x Dense(512, relu), Dense(10), global batch 8192
* weight-dominated:     input 256, 4 x Dense(4096, relu), Dense(10), global batch 1024

it measures the allocator peak (`tf.config.experimental.get_memory_info('CPU:0')`,
oneDNN on, `reset_memory_stats` before the measured steps, reported above the
bytes held before them) and the median step time, for:

* plain `fit` at the global batch, and at the micro-batch (global / 8);
* `GradientAccumulation(k)` for k = 1, 2, 4, 8 at the global batch;
* Keras' `Adam(gradient_accumulation_steps=8)` fed micro-batches (8 fit steps
  make one update; its time is reported per 8 steps, i.e. per update);

each without and with `jit_compile=True`. Configurations alternate within every
repetition so that machine noise hits all of them alike.

Run:  python benchmarks/bench_accumulation.py [--models act,weight] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_tpu_mem import GradientAccumulation  # noqa: E402
from keras_tpu_mem.devices import read_memory, reset_peak  # noqa: E402

MODELS = {
    "act": {"inputs": 512, "hidden": [512] * 8, "batch": 8192, "steps": 3},
    "weight": {"inputs": 256, "hidden": [4096] * 4, "batch": 1024, "steps": 2},
}
MIB = 1024 * 1024


def build(spec, jit, optimizer=None):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((spec["inputs"],))]
    layers += [keras.layers.Dense(h, activation="relu") for h in spec["hidden"]]
    layers += [keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)
    return model


def dataset(spec, batch, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, spec["inputs"])).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    # One batch repeated: the input pipeline holds one batch, as a cached TPU feed would.
    return tf.data.Dataset.from_tensors((x, y)).repeat(steps).prefetch(1)


class Config:
    """One side of the comparison: a model, its callbacks and how it is fed."""

    def __init__(self, name, spec, jit, batch, callbacks=(), optimizer=None, steps_per_update=1):
        self.name, self.spec, self.jit = name, spec, jit
        self.batch, self.callbacks = batch, list(callbacks)
        self.steps_per_update = steps_per_update
        self.model = build(spec, jit, optimizer)
        self.times, self.peaks = [], []

    def run(self, updates):
        steps = updates * self.steps_per_update
        data = dataset(self.spec, self.batch, steps)
        reset_peak("CPU:0")
        before = read_memory("CPU:0")[0]
        start = time.perf_counter()
        self.model.fit(data, epochs=1, verbose=0, callbacks=self.callbacks)
        elapsed = time.perf_counter() - start
        self.peaks.append(read_memory("CPU:0")[1] - before)
        return elapsed / updates

    def warm_up(self):
        self.run(1)
        self.peaks.clear()

    def measure(self, updates):
        self.times.append(self.run(updates))

    def row(self, global_batch):
        per_update = statistics.median(self.times)
        return {
            "config": self.name,
            "jit": self.jit,
            "peak_mib": max(self.peaks) / MIB,
            "seconds_per_update": per_update,
            "seconds_per_1k_samples": per_update * 1000 / global_batch,
        }


def configs_for(spec, jit):
    batch = spec["batch"]
    micro = batch // 8
    configs = [Config("plain fit @ global", spec, jit, batch),
               Config(f"plain fit @ micro ({micro})", spec, jit, micro)]
    for k in (1, 2, 4, 8):
        configs.append(Config(f"GradientAccumulation({k})", spec, jit, batch,
                              [GradientAccumulation(k)]))
    configs.append(Config("Keras gradient_accumulation_steps=8", spec, jit, micro,
                          optimizer=keras.optimizers.Adam(1e-4, gradient_accumulation_steps=8),
                          steps_per_update=8))
    return configs


def bench(model_name, reps):
    spec = MODELS[model_name]
    rows = []
    for jit in (False, True):
        configs = configs_for(spec, jit)
        for config in configs:
            config.warm_up()
        for _ in range(reps):
            for config in configs:  # alternate: noise hits every config alike
                config.measure(spec["steps"])
        # "plain fit @ micro" processes global/8 samples per fit step: scale its
        # time to the global batch so that every row is per global batch.
        for config in configs:
            row = config.row(spec["batch"])
            if config.name.startswith("plain fit @ micro"):
                row["seconds_per_update"] *= 8
            rows.append(row)
        del configs
    plain = {jit: next(r for r in rows if r["config"] == "plain fit @ global" and r["jit"] == jit)
             for jit in (False, True)}
    for row in rows:
        base = plain[row["jit"]]
        row["peak_vs_plain"] = row["peak_mib"] / base["peak_mib"]
        row["time_vs_plain"] = row["seconds_per_update"] / base["seconds_per_update"]
        micro = next(r for r in rows
                     if r["config"].startswith("plain fit @ micro") and r["jit"] == row["jit"])
        row["peak_vs_micro"] = row["peak_mib"] / micro["peak_mib"]
        row["time_vs_micro"] = row["seconds_per_update"] / micro["seconds_per_update"]
    return rows


def to_markdown(model_name, rows):
    spec = MODELS[model_name]
    lines = [f"**{model_name}** (global batch {spec['batch']}, micro-batch {spec['batch'] // 8})",
             "",
             "| config | XLA | peak MiB | × plain peak | × micro peak | s / update "
             "| × plain time | × micro time |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['config']} | {'yes' if r['jit'] else 'no'} | {r['peak_mib']:.0f} "
            f"| {r['peak_vs_plain']:.2f} | {r['peak_vs_micro']:.2f} "
            f"| {r['seconds_per_update']:.3f} | {r['time_vs_plain']:.2f} "
            f"| {r['time_vs_micro']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="act,weight")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    if read_memory("CPU:0") is None:
        raise SystemExit("The CPU allocator is unreadable: run with oneDNN on "
                         "(unset TF_ENABLE_ONEDNN_OPTS).")
    results = {}
    for name in args.models.split(","):
        results[name] = bench(name, args.reps)
        print(to_markdown(name, results[name]), "\n", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
