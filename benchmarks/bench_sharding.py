"""Sharded model state on JAX: DataParallel vs optimizer-sharded vs fully sharded.

One run measures, side by side on 8 host CPU devices (`--devices`), for two
models — the MLP of issue 21 (512 inputs, 4 x Dense(1024, relu), a 16-way
head; global batch 1024) and a small transformer encoder (2 blocks of
multi-head attention + a Dense(1024, gelu) feed-forward, width 256,
sequence 64; global batch 64) — each with Adam:

* `dp`         `keras.distribution.DataParallel` (every device holds all the
               weights and optimizer slots);
* `optimizer`  `ktm.ShardedDataParallel(shard="optimizer")` (ZeRO-1: the
               slots split over the devices, the weights replicated);
* `all`        `ktm.ShardedDataParallel()` (FSDP / ZeRO-3: weights and slots
               split);

each without and with `ktm.GradientAccumulation(4)`. Per configuration it
reports the compiled step's per-device bytes (`ktm.compiled_memory` under the
distribution's scope: arguments, the state among them — arguments less the
batch — temporaries, total) and the ratios to `dp` of the same model and
accumulation; and the time per step: every configuration fits one warm-up
epoch, then they take turns, one short epoch each, for `--rounds` rounds (the
first of each round rotating), and each round's time is divided by the `dp`
time of the same round, so that all configurations share the machine's noise;
the medians over rounds are reported.

Host CPU devices share one machine's memory and cores: the bytes are XLA's
buffer assignment for each device, which is what a TPU's HBM would hold under
XLA:CPU's schedule; times measure the extra collectives' cost on CPU only.
XLA:TPU schedules and overlaps collectives differently, over ICI: only a TPU
can say what sharding costs in time there.

Run:  python benchmarks/bench_sharding.py [--models mlp,encoder] [--rounds 7]
                                          [--devices 8] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

CONFIGS = [(shard, k) for k in (1, 4) for shard in ("dp", "optimizer", "all")]
MODELS = {"mlp": {"batch": 1024, "rows": 8192}, "encoder": {"batch": 64, "rows": 512}}


def _setup(devices: int) -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    flag = f"--xla_force_host_platform_device_count={devices}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _build(name: str):
    import keras

    keras.utils.set_random_seed(0)
    if name == "mlp":
        layers = [keras.Input((512,))]
        layers += [keras.layers.Dense(1024, activation="relu") for _ in range(4)]
        model = keras.Sequential(layers + [keras.layers.Dense(16)])
    else:
        inputs = keras.Input((64, 256))
        h = inputs
        for _ in range(2):
            attended = keras.layers.MultiHeadAttention(num_heads=8, key_dim=32)(h, h)
            h = keras.layers.LayerNormalization()(h + attended)
            ff = keras.layers.Dense(1024, activation="gelu")(h)
            h = keras.layers.LayerNormalization()(h + keras.layers.Dense(256)(ff))
        outputs = keras.layers.Dense(16)(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(name: str):
    import numpy as np

    rng = np.random.default_rng(0)
    rows = MODELS[name]["rows"]
    shape = (rows, 512) if name == "mlp" else (rows, 64, 256)
    return rng.standard_normal(shape).astype("float32"), rng.integers(0, 16, rows)


def _distribution(shard: str):
    import keras

    from keras_tpu_mem import ShardedDataParallel

    if shard == "dp":
        return keras.distribution.DataParallel()
    return ShardedDataParallel(shard=shard)


def measure(name: str, rounds: int) -> dict:
    from keras_tpu_mem import GradientAccumulation, compiled_memory

    batch = MODELS[name]["batch"]
    x, y = _data(name)
    runs, results = {}, {}
    for shard, k in CONFIGS:
        key = f"{shard}/k{k}"
        distribution = _distribution(shard)
        with distribution.scope():
            model = _build(name)
            callbacks = [GradientAccumulation(k)] if k > 1 else []
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                      callbacks=callbacks)  # warm-up: builds the slots, compiles
            memory = compiled_memory(model, batch, callbacks=callbacks or None,
                                     hlo_text=False)
        results[key] = {"arguments": memory.argument_bytes, "state": memory.state_bytes,
                        "temporaries": memory.temp_bytes, "total": memory.total_bytes,
                        "times": []}
        runs[key] = (distribution, model, callbacks)
    keys = list(runs)
    steps = len(x) // batch
    for r in range(rounds):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for key in order:
            distribution, model, callbacks = runs[key]
            with distribution.scope():
                start = time.perf_counter()
                model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                          callbacks=callbacks)
                results[key]["times"].append(1000 * (time.perf_counter() - start) / steps)
    for key, row in results.items():
        base = results[f"dp/k{key.split('/k')[1]}"]
        for field in ("state", "temporaries", "total"):
            row[f"{field}_ratio"] = row[field] / base[field]
        row["ms_per_step"] = statistics.median(row["times"])
        row["time_ratio"] = statistics.median(
            t / b for t, b in zip(row["times"], base["times"]))
    return results


def markdown(name: str, results: dict) -> str:
    mib = 2 ** 20
    lines = [f"**{name}** (per device, MiB; ratios to `DataParallel` with the same "
             "accumulation)", "",
             "| state sharded | accumulation | state | temporaries | total | state × | "
             "total × | ms/step | time × |", "|---|---|---|---|---|---|---|---|---|"]
    for key, row in results.items():
        shard, k = key.split("/k")
        label = {"dp": "none (`DataParallel`)", "optimizer": "optimizer slots",
                 "all": "weights + slots"}[shard]
        lines.append(
            f"| {label} | {'GradientAccumulation(4)' if k == '4' else '—'} "
            f"| {row['state'] / mib:.2f} | {row['temporaries'] / mib:.2f} "
            f"| {row['total'] / mib:.2f} | {row['state_ratio']:.2f} "
            f"| {row['total_ratio']:.2f} | {row['ms_per_step']:.1f} "
            f"| {row['time_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,encoder")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    _setup(args.devices)
    import jax

    everything = {"devices": len(jax.devices()), "jax": jax.__version__}
    for name in names:
        everything[name] = measure(name, args.rounds)
        print(markdown(name, everything[name]), "\n", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(everything, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
