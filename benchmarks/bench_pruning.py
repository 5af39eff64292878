"""Pruning step time: ktm.Pruning vs plain Keras fit vs tfmot's prune_low_magnitude, on TF and JAX.

One run measures, side by side, the fit step time of an MLP with Adam and
`PolynomialDecay(0.0, 0.8, begin_step=0, end_step=<all steps>, frequency=100)`
(10 when an epoch has fewer than 100 steps):

* `--model digits` (default): 64-256-256-10 on scikit-learn's digits, tiled 4x
  so that an epoch has 224 steps, batch 32 (the issue's MLP);
* `--model large`: 784-2048-2048-10 (6.2M parameters) on random data, batch
  256, 28 steps per epoch: a step dominated by the weights' memory traffic.

Configurations, in pairs, each pair in its own subprocess:

* Keras 3:  `keras`  plain `fit`, dense, and `ktm`  `fit` with `ktm.Pruning`
            (masks applied after every update inside the compiled step);
* tf_keras (TF_USE_LEGACY_KERAS=1; tfmot refuses Keras 3 models): `tf_keras`
            plain `fit`, dense, and `tfmot`  `fit` of
            `tfmot.sparsity.keras.prune_low_magnitude(model)` with
            `UpdatePruningStep`;
* Keras 3 on JAX (KERAS_BACKEND=jax, no distribution): `keras_jax` plain
            `fit`, dense, and `ktm_jax` `fit` with `ktm.Pruning` (the masks
            applied inside the jitted step). JAX always compiles with XLA, so
            `8jit` is the same as `8` there.

Within a subprocess both models of the pair are built, each fits one warm-up
epoch (tracing, compiling), then they take turns, one epoch each (`fit` called
again; the optimizer and the schedule carry on), for `--rounds` rounds, the
first of each round swapping every round. A turn is timed from
`on_epoch_begin` to `on_epoch_end`, wall-clock and process CPU time. The
machines this runs on are shared and noisy over seconds; taking turns every
fraction of a second puts the two models of a pair under the same noise, so
the ratio of each round (pruned / dense) is reported: the median over all
rounds of all repetitions. Each pruning method is compared with the dense fit
of its own Keras (tf_keras' dense step is faster than Keras 3's here).

Run:  python benchmarks/bench_pruning.py [--model digits|large] [--reps 3]
                                         [--rounds 10] [--settings 1,8,8jit]
                                         [--pairs keras3,legacy,jax]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PAIRS = {"keras3": ("keras", "ktm"), "legacy": ("tf_keras", "tfmot"),
         "jax": ("keras_jax", "ktm_jax")}
MODELS = {"digits": {"inputs": 64, "hidden": 256, "batch": 32},
          "large": {"inputs": 784, "hidden": 2048, "batch": 256}}


def _data(spec):
    import numpy as np

    if spec["inputs"] == 64:
        from sklearn.datasets import load_digits

        data = load_digits()
        x = np.tile((data.data / 16.0).astype("float32"), (4, 1))
        y = np.tile(data.target.astype("int32"), 4)
    else:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(7168, spec["inputs"])).astype("float32")
        y = rng.integers(0, 10, len(x)).astype("int32")
    n = len(x) // spec["batch"] * spec["batch"]
    return x[:n], y[:n]


def worker(pair: str, rounds: int, spe: int, jit: bool, model_name: str) -> dict:
    """Runs one pair of configurations in this process, taking turns; returns timings."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    legacy = pair == "legacy"
    if legacy:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        import tf_keras as keras
    else:
        os.environ["KERAS_BACKEND"] = "jax" if pair == "jax" else "tensorflow"
        import keras
    import numpy as np

    if pair == "jax":
        jit = True  # jit_compile=False on JAX runs the step op by op (a debugging mode)
    spec = MODELS[model_name]
    batch = spec["batch"]
    x, y = _data(spec)
    steps_per_epoch = len(x) // batch
    # Warm-up epoch + timed epochs; the schedule ends with the last timed step.
    frequency = 100 if steps_per_epoch > 100 else 10
    end_step = (rounds + 1) * steps_per_epoch // frequency * frequency

    def build(mode):
        keras.utils.set_random_seed(0)
        hidden = spec["hidden"]
        model = keras.Sequential([
            keras.Input((spec["inputs"],)), keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)])
        callbacks = []
        if mode == "tfmot":
            import tensorflow_model_optimization as tfmot

            schedule = tfmot.sparsity.keras.PolynomialDecay(
                0.0, 0.8, begin_step=0, end_step=end_step, frequency=frequency)
            model = tfmot.sparsity.keras.prune_low_magnitude(model, pruning_schedule=schedule)
            callbacks.append(tfmot.sparsity.keras.UpdatePruningStep())
        elif mode in ("ktm", "ktm_jax"):
            from keras_tpu_mem.pruning import PolynomialDecay, Pruning

            callbacks.append(Pruning(PolynomialDecay(0.0, 0.8, begin_step=0,
                                                     end_step=end_step, frequency=frequency)))
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=spe, jit_compile=jit)
        return model, callbacks

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.wall, self.cpu = [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.wall.append(1000 * (time.perf_counter() - self.start) / steps_per_epoch)
            self.cpu.append(1000 * (time.process_time() - self.cpu_start) / steps_per_epoch)

    runs = {}
    for mode in PAIRS[pair]:
        model, callbacks = build(mode)
        timer = Timer()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                  callbacks=callbacks)  # warm-up: traces (and compiles) the step
        runs[mode] = (model, callbacks + [timer], timer)
    order = list(PAIRS[pair])
    for _ in range(rounds):
        for mode in order:
            model, callbacks, _ = runs[mode]
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                      callbacks=callbacks)
        order.reverse()

    row = {"pair": pair, "model": model_name, "spe": spe, "jit": jit, "rounds": rounds,
           "keras": keras.__version__}
    if pair == "jax":
        import jax

        row["jax"] = jax.__version__
    else:
        import tensorflow as tf

        row["tf"] = tf.__version__
    for mode, (model, _, timer) in runs.items():
        kernels = [w for w in model.trainable_weights
                   if "kernel" in (w.name if legacy else w.path)]
        row[mode] = {"wall": timer.wall, "cpu": timer.cpu, "kernel_sparsity": float(
            np.mean([np.mean(np.asarray(w) == 0) for w in kernels]))}
    return row


def run_worker(pair: str, rounds: int, setting: str, model_name: str) -> dict:
    env = dict(os.environ)
    env.pop("TF_USE_LEGACY_KERAS", None)
    env["KERAS_BACKEND"] = "jax" if pair == "jax" else "tensorflow"
    env.setdefault("NPROC", "16")  # XLA:CPU's pool size (see tests/conftest.py)
    command = [sys.executable, __file__, "--worker", pair, "--rounds", str(rounds),
               "--settings", setting, "--model", model_name]
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        tail = out.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"pair": pair, "error": tail[0][:200]}
    return json.loads(lines[-1][len("RESULT "):])


def _parse_setting(setting: str):
    """'8' -> (8, False); '8jit' -> (8, True)."""
    jit = setting.endswith("jit")
    return int(setting[:-3] if jit else setting), jit


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="subprocesses per pair and setting")
    parser.add_argument("--rounds", type=int, default=10, help="turns per subprocess")
    parser.add_argument("--settings", default="1,8,8jit",
                        help="steps_per_execution values; suffix 'jit' for jit_compile=True")
    parser.add_argument("--model", choices=sorted(MODELS), default="digits")
    parser.add_argument("--pairs", default="keras3,legacy,jax",
                        help="which pairs to run, of " + ",".join(PAIRS))
    parser.add_argument("--worker", choices=sorted(PAIRS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = str(args.settings).split(",")
    if args.worker:
        spe, jit = _parse_setting(settings[0])
        row = worker(args.worker, args.rounds, spe, jit, args.model)
        print("RESULT " + json.dumps(row), flush=True)
        return

    pairs = str(args.pairs).split(",")
    unknown = sorted(set(pairs) - set(PAIRS))
    if unknown:
        parser.error(f"--pairs: unknown {unknown}; choose among {','.join(PAIRS)}")
    rows = {(setting, pair): [] for setting in settings for pair in pairs}
    for rep in range(args.reps):
        for setting in settings:
            for pair in (sorted(pairs) if rep % 2 == 0 else sorted(pairs, reverse=True)):
                row = run_worker(pair, args.rounds, setting, args.model)
                rows[(setting, pair)].append(row)
                if "error" in row:
                    print(f"rep {rep} {setting:>5} {pair:>7}: FAILED {row['error']}", flush=True)
                    continue
                dense, pruned = PAIRS[pair]
                ratios = [p / d for d, p in zip(row[dense]["wall"], row[pruned]["wall"])]
                print(f"rep {rep} {setting:>5} {pair:>7}: {dense} "
                      f"{statistics.median(row[dense]['wall']):.3f} ms/step, {pruned} "
                      f"{statistics.median(row[pruned]['wall']):.3f}, round ratios "
                      f"{min(ratios):.2f}..{max(ratios):.2f} (median "
                      f"{statistics.median(ratios):.3f}); kernel sparsity "
                      f"{row[pruned]['kernel_sparsity']:.3f}", flush=True)

    def pooled(setting, mode, key):
        pair = next(p for p, modes in PAIRS.items() if mode in modes)
        return [t for row in rows[(setting, pair)] if mode in row for t in row[mode][key]]

    def ratio(setting, pair, key):
        dense, pruned = PAIRS[pair]
        values = [p / d for row in rows[(setting, pair)] if dense in row
                  for d, p in zip(row[dense][key], row[pruned][key])]
        return statistics.median(values) if values else float("nan")

    def median(values):
        return statistics.median(values) if values else float("nan")

    rounds = args.reps * args.rounds
    print(f"\n{args.model}: ms per step, medians of {rounds} turns per configuration "
          f"({args.reps} processes x {args.rounds} rounds); ratios: median of the rounds' "
          "ratios")
    header = " | ".join(f"{d} | {p} | **{p} / {d}**" for d, p in (PAIRS[q] for q in pairs))
    print(f"| ms per step | {header} |")
    print("|---|" + "---|" * (3 * len(pairs)))
    for key, what in (("wall", "wall"), ("cpu", "CPU")):
        for setting in settings:
            spe, jit = _parse_setting(setting)
            label = f"{what}, steps_per_execution={spe}" + (", jit_compile" if jit else "")
            cells = []
            for pair in pairs:
                dense, pruned = PAIRS[pair]
                cells.append(f"{median(pooled(setting, dense, key)):.3f} | "
                             f"{median(pooled(setting, pruned, key)):.3f} | "
                             f"**{ratio(setting, pair, key):.2f}**")
            print(f"| {label} | " + " | ".join(cells) + " |")
    sparsity = {mode: median([row[mode]["kernel_sparsity"] for row in rows[(settings[0], pair)]
                              if mode in row])
                for pair in pairs for mode in PAIRS[pair]}
    print("\nfinal kernel sparsity:", ", ".join(f"{m} {v:.3f}" for m, v in sparsity.items()))


if __name__ == "__main__":
    main()
