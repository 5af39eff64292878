"""Pruning step time: ktm.Pruning vs plain Keras fit vs tfmot's prune_low_magnitude.

One run measures, side by side, the fit step time of an MLP with Adam and
`PolynomialDecay(0.0, 0.8, begin_step=0, end_step=<all steps>, frequency=100)`
(10 when an epoch has fewer than 100 steps):

* `--model digits` (default): 64-256-256-10 on scikit-learn's digits, tiled 4x
  so that an epoch has 224 steps, batch 32 (the issue's MLP);
* `--model large`: 784-2048-2048-10 (6.2M parameters) on random data, batch
  256, 28 steps per epoch: a step dominated by the weights' memory traffic.

Configurations:

* `keras`         plain Keras 3 `fit`, dense;
* `ktm`           Keras 3 `fit` with `ktm.Pruning` (masks applied after every
                  update inside the compiled step);
* `tf_keras`      plain tf_keras `fit`, dense (TF_USE_LEGACY_KERAS=1);
* `tfmot`         tf_keras `fit` of `tfmot.sparsity.keras.prune_low_magnitude(model)`
                  with `UpdatePruningStep` (tfmot refuses Keras 3 models).

Every configuration runs in its own subprocess (tfmot switches the process to
legacy Keras), launched alternately, in a rotated order each repetition, so
that machine noise hits them alike. Each subprocess fits one warm-up epoch
(tracing, compiling), then `--epochs` timed epochs, and reports the median
epoch time per step, both wall-clock and process CPU time (the latter is much
less disturbed by other processes on a shared machine). The tables give medians
over repetitions and the ratios ktm / keras and tfmot / tf_keras (each against
the dense fit of its own Keras), for each setting of steps_per_execution, with
and without jit_compile (XLA, as on TPU).

Run:  python benchmarks/bench_pruning.py [--model digits|large] [--reps 5] [--epochs 3]
                                         [--settings 1,8,8jit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("keras", "ktm", "tf_keras", "tfmot")
# digits: the MLP of the issue; large: weight-heavy (6.2M parameters), where the
# per-step cost is dominated by the weights' memory traffic, not per-op overhead.
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


def worker(mode: str, epochs: int, spe: int, jit: bool, model_name: str) -> dict:
    """Runs one configuration in this process and returns its timings."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    legacy = mode in ("tf_keras", "tfmot")
    if legacy:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        import tf_keras as keras
    else:
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        import keras
    import numpy as np
    import tensorflow as tf

    spec = MODELS[model_name]
    batch = spec["batch"]
    x, y = _data(spec)
    steps_per_epoch = len(x) // batch
    timed_steps = epochs * steps_per_epoch
    # Warm-up epoch + timed epochs; the schedule ends with the last timed step.
    frequency = 100 if steps_per_epoch > 100 else 10
    end_step = (epochs + 1) * steps_per_epoch // frequency * frequency

    keras.utils.set_random_seed(0)
    hidden = spec["hidden"]
    layers = [keras.Input((spec["inputs"],)), keras.layers.Dense(hidden, activation="relu"),
              keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(10)]
    model = keras.Sequential(layers)
    callbacks = []
    if mode == "tfmot":
        import tensorflow_model_optimization as tfmot

        schedule = tfmot.sparsity.keras.PolynomialDecay(0.0, 0.8, begin_step=0,
                                                        end_step=end_step, frequency=frequency)
        model = tfmot.sparsity.keras.prune_low_magnitude(model, pruning_schedule=schedule)
        callbacks.append(tfmot.sparsity.keras.UpdatePruningStep())
    elif mode == "ktm":
        from keras_tpu_mem.pruning import PolynomialDecay, Pruning

        callbacks.append(Pruning(PolynomialDecay(0.0, 0.8, begin_step=0, end_step=end_step,
                                                 frequency=frequency)))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe, jit_compile=jit)

    times, cpu_times = [], []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)
            cpu_times.append(time.process_time() - self.cpu)

    model.fit(x, y, batch_size=batch, epochs=epochs + 1, verbose=0, shuffle=False,
              callbacks=callbacks + [Timer()])
    kernels = [w for w in model.trainable_weights if "kernel" in (w.path if not legacy
                                                                      else w.name)]
    sparsity = float(np.mean([np.mean(np.asarray(w) == 0) for w in kernels]))
    # The first epoch traces (and compiles) the step: not timed.
    return {
        "mode": mode, "model": model_name, "spe": spe, "jit": jit, "steps_timed": timed_steps,
        "ms_per_step": 1000 * statistics.median(times[1:]) / steps_per_epoch,
        "cpu_ms_per_step": 1000 * statistics.median(cpu_times[1:]) / steps_per_epoch,
        "kernel_sparsity": sparsity, "tf": tf.__version__, "keras": keras.__version__,
    }


def run_worker(mode: str, epochs: int, setting: str, model_name: str) -> dict:
    spe, jit = _parse_setting(setting)
    env = dict(os.environ)
    env.pop("TF_USE_LEGACY_KERAS", None)
    env["KERAS_BACKEND"] = "tensorflow"
    command = [sys.executable, __file__, "--worker", mode, "--epochs", str(epochs),
               "--settings", setting, "--model", model_name]
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        tail = out.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return {"mode": mode, "spe": spe, "jit": jit, "error": tail[0][:200]}
    return json.loads(lines[-1][len("RESULT "):])


def _parse_setting(setting: str):
    """'8' -> (8, False); '8jit' -> (8, True)."""
    jit = setting.endswith("jit")
    return int(setting[:-3] if jit else setting), jit


def _median(rows, key):
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--settings", default="1,8,8jit",
                        help="steps_per_execution values; suffix 'jit' for jit_compile=True")
    parser.add_argument("--model", choices=sorted(MODELS), default="digits")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = str(args.settings).split(",")
    if args.worker:
        spe, jit = _parse_setting(settings[0])
        row = worker(args.worker, args.epochs, spe, jit, args.model)
        print("RESULT " + json.dumps(row), flush=True)
        return

    results = {(setting, mode): [] for setting in settings for mode in MODES}
    for rep in range(args.reps):
        for setting in settings:
            order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
            for mode in order:
                row = run_worker(mode, args.epochs, setting, args.model)
                results[(setting, mode)].append(row)
                if "error" in row:
                    print(f"rep {rep} {setting:>5} {mode:>8}: FAILED {row['error']}", flush=True)
                else:
                    print(f"rep {rep} {setting:>5} {mode:>8}: {row['ms_per_step']:.3f} ms/step "
                          f"wall, {row['cpu_ms_per_step']:.3f} CPU "
                          f"(kernel sparsity {row['kernel_sparsity']:.3f})", flush=True)

    for key, what in (("ms_per_step", "wall-clock"), ("cpu_ms_per_step", "process CPU")):
        print(f"\n{args.model}: ms per step ({what}), medians of {args.reps} alternating "
              "repetitions")
        print("| steps_per_execution | keras | ktm | ktm / keras | tf_keras | tfmot "
              "| tfmot / tf_keras |")
        print("|---|---|---|---|---|---|---|")
        for setting in settings:
            med = {mode: _median(results[(setting, mode)], key) for mode in MODES}
            label = setting.replace("jit", ", jit_compile")
            print(f"| {label} | {med['keras']:.3f} | {med['ktm']:.3f} | "
                  f"{med['ktm'] / med['keras']:.2f} | {med['tf_keras']:.3f} | "
                  f"{med['tfmot']:.3f} | {med['tfmot'] / med['tf_keras']:.2f} |")
    sparsity = {mode: _median(results[(settings[0], mode)], "kernel_sparsity") for mode in MODES}
    print("\nfinal kernel sparsity:", ", ".join(f"{m} {v:.3f}" for m, v in sparsity.items()))


if __name__ == "__main__":
    main()
