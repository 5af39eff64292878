"""Gradient accumulation on the JAX backend, side by side (not run by the test suite).

    python benchmarks/bench_accumulation_jax.py            # one device
    python benchmarks/bench_accumulation_jax.py --dp 8     # DataParallel over 8 host devices

Three ways to train the 8 x Dense(512) MLP on the same samples, global batch 8192:

* `plain`: Keras' own `fit` at batch 8192;
* `keras_ga8`: Keras' `Adam(gradient_accumulation_steps=8)` fed micro-batches of 1024
  (Keras' convention: 8 dataset batches per update);
* `ktm_ga8`: `ktm.GradientAccumulation(8)` at batch 8192 (8 micro-batches of 1024
  inside one compiled step).

Reported per configuration: XLA's compiled temporaries of one train step
(`jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes`; per
device under `--dp`), and time per global batch, the median over interleaved
repetitions of one-epoch fits (each configuration compiled before timing),
with ratios to `plain`. Floors (issue 14): `ktm_ga8` temporaries <= 0.20x plain,
time <= 1.15x plain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=0,
                        help="DataParallel over this many host CPU devices (0: no distribution)")
    parser.add_argument("--batches", type=int, default=3, help="global batches per epoch")
    parser.add_argument("--reps", type=int, default=5, help="timed epochs per configuration")
    parser.add_argument("--global-batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8, help="micro-batches per update")
    return parser.parse_args(argv)


ARGS = parse_args()
# Before JAX starts (see tests/conftest.py for NPROC).
os.environ["KERAS_BACKEND"] = "jax"
if ARGS.dp:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.dp}"
os.environ.setdefault("NPROC", "16")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_tpu_mem._compat import jax as jax_compat  # noqa: E402
from keras_tpu_mem.accumulation import GradientAccumulation  # noqa: E402

MIB = 2**20


def build(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((512,))]
                             + [keras.layers.Dense(512, activation="relu") for _ in range(8)]
                             + [keras.layers.Dense(10)])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def temp_bytes(step, model, batch):
    compiled = step.lower(jax_compat.jax_state(model), jax_compat.distribute_data(batch)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


class Config:
    def __init__(self, name, x, y):
        self.name = name
        self.x, self.y = x, y
        global_batch, steps = ARGS.global_batch, ARGS.steps
        micro = global_batch // steps
        if name == "plain":
            self.model = build(keras.optimizers.Adam(1e-4))
            self.batch, self.callbacks = global_batch, []
        elif name == "keras_ga8":
            self.model = build(keras.optimizers.Adam(1e-4, gradient_accumulation_steps=steps))
            self.batch, self.callbacks = micro, []
        else:
            self.model = build(keras.optimizers.Adam(1e-4))
            self.batch, self.callbacks = global_batch, [GradientAccumulation(steps)]
        self.times = []

    def fit(self):
        start = time.perf_counter()
        self.model.fit(self.x, self.y, batch_size=self.batch, epochs=1, shuffle=False,
                       verbose=0, callbacks=list(self.callbacks))
        jax.block_until_ready(self.model.trainable_variables[0].value)
        return time.perf_counter() - start

    def temporaries(self):
        model, sample = self.model, (self.x[:self.batch], self.y[:self.batch])
        if self.name == "ktm_ga8":
            return temp_bytes(model.train_function.jitted_step, model, sample)
        # Keras' own step, jitted as Keras' make_train_function jits it.
        return temp_bytes(jax.jit(model.train_step, donate_argnums=0), model, sample)


def main():
    distribution = (keras.distribution.DataParallel(devices=jax.devices()) if ARGS.dp
                    else None)
    if distribution is not None:
        keras.distribution.set_distribution(distribution)
    rng = np.random.default_rng(0)
    n = ARGS.batches * ARGS.global_batch
    x = rng.normal(size=(n, 512)).astype("float32")
    y = rng.integers(0, 10, n).astype("int32")
    configs = [Config(name, x, y) for name in ("plain", "keras_ga8", "ktm_ga8")]
    for config in configs:  # compile (and warm up) outside the timing
        config.fit()
    for _ in range(ARGS.reps):
        for config in configs:
            config.times.append(config.fit())
    where = f"DataParallel({ARGS.dp})" if ARGS.dp else "one device"
    print(f"JAX {jax.__version__}, Keras {keras.__version__}, {where}, "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPU cores; 8 x Dense(512), "
          f"global batch {ARGS.global_batch}, {ARGS.batches} global batches per epoch, "
          f"median of {ARGS.reps} interleaved epochs")
    rows = []
    for config in configs:
        per_batch = statistics.median(config.times) / ARGS.batches
        rows.append((config.name, config.temporaries() / MIB, per_batch))
    base_temp, base_time = rows[0][1], rows[0][2]
    print(f"{'config':<10} {'temp MiB':>9} {'x plain':>8} {'s / global batch':>17} "
          f"{'x plain':>8}")
    for name, temp, per_batch in rows:
        print(f"{name:<10} {temp:>9.1f} {temp / base_temp:>8.3f} {per_batch:>17.3f} "
              f"{per_batch / base_time:>8.3f}")
    ours = rows[2]
    print(f"floors: temporaries {ours[1] / base_temp:.3f}x <= 0.20x: "
          f"{ours[1] / base_temp <= 0.20}; time {ours[2] / base_time:.3f}x <= 1.15x: "
          f"{ours[2] / base_time <= 1.15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
