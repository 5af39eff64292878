"""Plain `fit` vs `fit` with HBMMonitor + ThroughputMonitor (every_n_steps=1), side by side.

One process, two identical models (same architecture, seed and data), warmed up
(traced and compiled) before timing. Each repetition runs one epoch of
`--steps` steps plain and one with the monitors, alternating which goes first
and, every other pair, which of the two models is monitored, so that machine
noise and any difference between the model instances hit both sides alike. Reported per
`steps_per_execution` setting:

* **step time**: a one-line clock callback, last in the list on *both* sides,
  stamps every `on_train_batch_end`; the time between two stamps is one full
  execution including every callback hook in between (the monitors' too). The
  median over all executions of all repetitions, per step, is the step time of
  each side, and their ratio is the headline (the issue's floor: <= 1.02x).
  Medians of per-execution times shrug off the moments when another process
  takes the CPU, which on a shared machine swamp whole-fit totals;
* **fit wall time** per step (median over repetitions) and its ratio, for
  reference; noisy on a shared machine;
* **hook time**: every monitor hook call is timed directly; the time inside
  the monitors per execution, and as a share of the plain step time.

The monitored side writes everything the monitors write in real use: batch and
epoch logs, TensorBoard events and the JSON-lines timelines, in a temporary
`log_dir`. Data is one cached batch repeated, so the input pipeline is not what
is measured.

Run:  python benchmarks/bench_monitoring.py [--steps 40] [--reps 9] [--spe 1,8]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_tpu_mem.monitoring import HBMMonitor, ThroughputMonitor  # noqa: E402

HOOKS = ("on_train_begin", "on_epoch_begin", "on_train_batch_begin", "on_train_batch_end",
         "on_epoch_end", "on_train_end")


def build(inputs, units, depth, spe):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((inputs,))]
    layers += [keras.layers.Dense(units, activation="relu") for _ in range(depth)]
    layers += [keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe)
    return model


def dataset(inputs, batch, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, inputs)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    return tf.data.Dataset.from_tensors((x, y)).repeat(steps).prefetch(1)


def timed_hooks(callback, totals):
    """Wraps the callback's hooks to add the seconds spent in them to `totals`."""
    for name in HOOKS:
        method = getattr(callback, name)

        @functools.wraps(method)
        def wrapper(*args, _method=method, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                totals[_name] = totals.get(_name, 0.0) + time.perf_counter() - start

        setattr(callback, name, wrapper)
    return callback


class StepClock(keras.callbacks.Callback):
    """Stamps every on_train_batch_end; the same on both sides of the comparison."""

    def __init__(self):
        super().__init__()
        self.stamps = []

    def on_train_batch_end(self, batch, logs=None):
        self.stamps.append(time.perf_counter())

    def durations(self):
        # The first stamp closes an interval that began before the epoch: dropped.
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def run_pair(args, spe, log_root):
    data = dataset(args.inputs, args.batch, args.steps)
    models = [build(args.inputs, args.units, args.depth, spe) for _ in range(2)]
    executions = -(-args.steps // spe)

    def monitors(totals, tag):
        log_dir = os.path.join(log_root, f"spe{spe}_{tag}")
        return [timed_hooks(HBMMonitor(log_dir, every_n_steps=1), totals),
                timed_hooks(ThroughputMonitor(log_dir, every_n_steps=1), totals)]

    # Warm-up: trace and compile both, and start the monitors once (imports, writers).
    for index, model in enumerate(models):
        model.fit(data, epochs=1, verbose=0, callbacks=[StepClock()])
        model.fit(data, epochs=1, verbose=0, callbacks=monitors({}, f"warm{index}") + [StepClock()])

    walls = {"plain": [], "monitored": []}
    executions_s = {"plain": [], "monitored": []}
    hook_seconds = []
    for rep in range(args.reps):
        # Alternate which side runs first and, every other pair, which model is which.
        order = ("plain", "monitored") if rep % 2 == 0 else ("monitored", "plain")
        swap = (rep // 2) % 2
        for side in order:
            totals = {}
            clock = StepClock()
            callbacks = monitors(totals, f"rep{rep}") if side == "monitored" else []
            model = models[(side == "monitored") ^ swap]
            start = time.perf_counter()
            model.fit(data, epochs=1, verbose=0, callbacks=callbacks + [clock])
            walls[side].append((time.perf_counter() - start) / args.steps)
            # Whole executions only (the last one of an epoch may be shorter).
            executions_s[side] += clock.durations()[: args.steps // spe - 1]
            if side == "monitored":
                per_step = sum(v for k, v in totals.items() if "batch" in k)
                hook_seconds.append(per_step / executions)
    step = {side: statistics.median(values) / spe for side, values in executions_s.items()}
    wall = {side: statistics.median(values) for side, values in walls.items()}
    hooks = statistics.median(hook_seconds)
    return {
        "steps_per_execution": spe,
        "plain_ms_per_step": 1000 * step["plain"],
        "monitored_ms_per_step": 1000 * step["monitored"],
        "ratio": step["monitored"] / step["plain"],
        "executions_timed_per_side": len(executions_s["plain"]),
        "plain_fit_ms_per_step": 1000 * wall["plain"],
        "monitored_fit_ms_per_step": 1000 * wall["monitored"],
        "fit_ratio": wall["monitored"] / wall["plain"],
        "hook_us_per_execution": 1e6 * hooks,
        "hook_share_of_step": hooks / (step["plain"] * spe),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--units", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--spe", default="1,8", help="steps_per_execution values, comma-separated")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), "
          f"TF {tf.__version__}, Keras {keras.__version__}")
    print(f"model: {args.depth} x Dense({args.units}) on {args.inputs} inputs, global batch "
          f"{args.batch}, {args.steps} steps per fit, {args.reps} alternating repetitions")
    rows = []
    with tempfile.TemporaryDirectory() as log_root:
        for spe in (int(s) for s in args.spe.split(",")):
            rows.append(run_pair(args, spe, log_root))
    header = ("steps_per_execution", "plain ms/step", "monitored ms/step", "ratio",
              "fit-time ratio", "monitor hooks us/execution", "hooks / step time")
    print(" | ".join(header))
    for r in rows:
        print(" | ".join([
            str(r["steps_per_execution"]), f"{r['plain_ms_per_step']:.2f}",
            f"{r['monitored_ms_per_step']:.2f}", f"{r['ratio']:.3f}", f"{r['fit_ratio']:.3f}",
            f"{r['hook_us_per_execution']:.0f}", f"{100 * r['hook_share_of_step']:.2f}%",
        ]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
