"""Distillation: memory of a live teacher vs cached logits, and keras.distillation checks.

Side by side in one run (each configuration in its own process, repetitions
alternating, medians reported):

* ``plain``            - the student's ordinary `fit`, no distillation;
* ``ktm_live``         - `ktm.Distillation(teacher)`: teacher inside the step;
* ``ktm_cache``        - `ktm.Distillation()` on logits cached to disk by
                         `ktm.cache_teacher_logits` (this process never builds
                         the teacher);
* ``keras_distiller``  - Keras' own `keras.distillation.Distiller` (the peer).

Memory is the allocator's peak during `fit` (`tf.config.experimental.
get_memory_info('CPU:0')` after `reset_memory_stats`), which includes every
resident weight; the teacher has >= 10x the student's parameters. Every
configuration reads its examples from disk (`tf.data.Dataset.save/load`) through
the same shuffle and batch, so the data pipeline is the same for all. Time is the
median epoch after the first (tracing) one.

It also measures, in float64 numpy, the loss value of
`keras.distillation.LogitsDistillation` against the textbook T^2 * KL, the
replica scaling of `Distiller` with a string loss under MirroredStrategy(2),
and whether `Distiller` accepts a float32 teacher with a bfloat16 student.

    python benchmarks/bench_distillation.py [--repeats 3] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CONFIGS = ("plain", "ktm_live", "ktm_cache", "keras_distiller")
EXAMPLES, FEATURES, CLASSES, BATCH = 8192, 64, 10, 256
TEMPERATURE, ALPHA = 4.0, 0.5


# ---------------------------------------------------------------- models/data
def build_teacher():
    import keras

    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(2048, activation="relu"),
        keras.layers.Dense(CLASSES),
    ], name="teacher")


def build_student():
    import keras

    keras.utils.set_random_seed(2)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(CLASSES),
    ], name="student")


def make_data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=EXAMPLES).astype("int32")
    return x, y


def student_loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# ---------------------------------------------------------------- workers
def worker_make_cache(path):
    import tensorflow as tf

    import keras_tpu_mem as ktm  # noqa: F401  (registers nothing; keeps imports equal)
    from keras_tpu_mem.distillation import cache_teacher_logits

    x, y = make_data()
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    cache_teacher_logits(build_teacher(), examples.batch(1024), path=path)
    # The same examples without logits, also on disk: every configuration reads
    # its data from disk through the same pipeline, so only the teacher differs.
    examples.save(path + "_plain")
    return {}


def worker_fit(config, cache_path, epochs):
    import keras
    import tensorflow as tf

    from keras_tpu_mem.distillation import Distillation, load_teacher_logits

    student = build_student()
    teacher = None
    callbacks = []
    if config == "ktm_cache":
        data = load_teacher_logits(cache_path).shuffle(EXAMPLES, seed=0).batch(BATCH)
        callbacks.append(Distillation(temperature=TEMPERATURE, alpha=ALPHA))
    else:
        data = tf.data.Dataset.load(cache_path + "_plain").shuffle(EXAMPLES, seed=0).batch(BATCH)
    if config in ("ktm_live", "keras_distiller"):
        teacher = build_teacher()
    if config == "ktm_live":
        callbacks.append(Distillation(teacher, temperature=TEMPERATURE, alpha=ALPHA))
    model = student
    if config == "keras_distiller":
        model = keras.distillation.Distiller(
            teacher=teacher, student=student,
            distillation_losses=keras.distillation.LogitsDistillation(
                temperature=TEMPERATURE, loss=keras.losses.KLDivergence()),
            student_loss_weight=1.0 - ALPHA)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=student_loss())

    times = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    tf.config.experimental.reset_memory_stats("CPU:0")
    resident = tf.config.experimental.get_memory_info("CPU:0")["current"]
    model.fit(data, epochs=epochs, verbose=0, callbacks=[*callbacks, EpochTimer()])
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {
        "peak": peak,
        "resident": resident,
        "epoch_s": statistics.median(times[1:]) if len(times) > 1 else times[0],
        "teacher_params": teacher.count_params() if teacher is not None else None,
        "student_params": student.count_params(),
    }


def worker_replicas():
    """Logged loss of one epoch with lr=0 under 1 and 2 replicas, for three set-ups.

    * keras Distiller, string student loss (student_loss_weight=1, so only that
      loss counts; the student outputs probabilities as the string loss expects);
    * keras Distiller, default LogitsDistillation() (student_loss_weight=0);
    * ktm.Distillation(teacher, alpha=0.5) on an ordinary compiled student.
    """
    from keras_tpu_mem.backends.tensorflow.cluster import configure_logical_cpus

    configure_logical_cpus(2)
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_tpu_mem.distillation import Distillation

    x, y = make_data()
    x, y = x[:512], y[:512]
    results = {}
    for name, strategy in (("1 replica", tf.distribute.get_strategy()),
                           ("2 replicas", tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))):
        row = {}
        for method in ("Distiller string student loss", "Distiller default LogitsDistillation",
                       "ktm.Distillation"):
            with strategy.scope():
                teacher, student = build_teacher(), build_student()
                callbacks = []
                if method == "Distiller string student loss":
                    probs = keras.Sequential([student, keras.layers.Softmax()])
                    model = keras.distillation.Distiller(
                        teacher=teacher, student=probs,
                        distillation_losses=keras.distillation.LogitsDistillation(),
                        student_loss_weight=1.0)
                    loss = "sparse_categorical_crossentropy"
                elif method == "Distiller default LogitsDistillation":
                    model = keras.distillation.Distiller(
                        teacher=teacher, student=student,
                        distillation_losses=keras.distillation.LogitsDistillation(
                            temperature=TEMPERATURE),
                        student_loss_weight=0.0)
                    loss = student_loss()
                else:
                    model, loss = student, student_loss()
                    callbacks = [Distillation(teacher, temperature=TEMPERATURE, alpha=ALPHA)]
                model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
            ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(128)
            history = model.fit(ds, epochs=1, verbose=0, callbacks=callbacks)
            row[method] = float(np.mean(history.history["loss"]))
        results[name] = row
    return results


# ---------------------------------------------------------------- in-process checks
def loss_value_check():
    import keras
    import numpy as np

    from keras_tpu_mem.distillation import distillation_kl

    rng = np.random.default_rng(0)
    teacher = rng.normal(scale=3.0, size=(64, CLASSES)).astype("float32")
    student = rng.normal(scale=3.0, size=(64, CLASSES)).astype("float32")

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    rows = {}
    for temperature in (2.0, 4.0):
        lp = log_softmax(np.float64(teacher) / temperature)
        lq = log_softmax(np.float64(student) / temperature)
        reference = temperature**2 * float(np.mean((np.exp(lp) * (lp - lq)).sum(-1)))
        default = keras.distillation.LogitsDistillation(temperature=temperature)
        instance = keras.distillation.LogitsDistillation(
            temperature=temperature, loss=keras.losses.KLDivergence())
        ours = temperature**2 * float(np.mean(distillation_kl(student, temperature, teacher)))
        rows[temperature] = {
            "numpy float64 T^2*KL": reference,
            "ktm (distillation_kl)": ours,
            "keras LogitsDistillation() default": float(default.compute_loss(teacher, student)),
            "keras LogitsDistillation(loss=KLDivergence())": float(
                instance.compute_loss(teacher, student)),
        }
    return rows


def dtype_check():
    import keras

    teacher = build_teacher()
    student = keras.Sequential([keras.Input((FEATURES,)),
                                keras.layers.Dense(256, activation="relu",
                                                   dtype="mixed_bfloat16"),
                                keras.layers.Dense(CLASSES, dtype="mixed_bfloat16")])
    try:
        keras.distillation.Distiller(teacher=teacher, student=student,
                                     distillation_losses=keras.distillation.LogitsDistillation())
    except Exception as err:  # noqa: BLE001 - we report whatever it raises
        return f"refused: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return "accepted"


# ---------------------------------------------------------------- driver
def run_worker(args):
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(value):
    return value / 2**20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        if args.worker == "make_cache":
            result = worker_make_cache(args.cache)
        elif args.worker == "replicas":
            result = worker_replicas()
        else:
            result = worker_fit(args.worker, args.cache, args.epochs)
        print(json.dumps(result))
        return

    print("== loss value: keras.distillation.LogitsDistillation vs T^2*KL (64 x 10 logits)")
    for temperature, row in loss_value_check().items():
        print(f"T={temperature}")
        for name, value in row.items():
            print(f"  {name:<48s} {value:10.4f}")
    print("\n== float32 teacher + bfloat16 student in keras.distillation.Distiller:",
          dtype_check())
    print("\n== logged loss of 1 epoch with lr=0: 1 vs 2 replicas (MirroredStrategy)")
    rows = run_worker(["--worker", "replicas"])
    one, two = rows["1 replica"], rows["2 replicas"]
    print(f"  {'set-up':<40s} {'1 replica':>10s} {'2 replicas':>11s} {'ratio':>6s}")
    for method in one:
        print(f"  {method:<40s} {one[method]:10.4f} {two[method]:11.4f} "
              f"{two[method] / one[method]:6.2f}")

    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "logits")
        run_worker(["--worker", "make_cache", "--cache", cache])
        results = {c: [] for c in CONFIGS}
        for rep in range(args.repeats):
            for config in CONFIGS:  # alternating
                results[config].append(run_worker(
                    ["--worker", config, "--cache", cache, "--epochs", str(args.epochs)]))
            print(f"repetition {rep + 1}/{args.repeats} done", flush=True)

    med = {c: {k: statistics.median(r[k] for r in rows) for k in ("peak", "resident", "epoch_s")}
           for c, rows in results.items()}
    live = results["ktm_live"][0]
    print(f"\nteacher {live['teacher_params']:,} parameters, student "
          f"{live['student_params']:,} ({live['teacher_params'] / live['student_params']:.0f}x); "
          f"{EXAMPLES} examples, batch {BATCH}, {args.epochs} epochs, "
          f"median of {args.repeats}")
    base = med["plain"]
    print(f"| {'configuration':<16s} | {'peak MiB':>9s} | {'x plain':>8s} | "
          f"{'resident MiB':>12s} | {'s/epoch':>8s} | {'x plain':>8s} |")
    print(f"|{'-' * 18}|{'-' * 11}:|{'-' * 10}:|{'-' * 14}:|{'-' * 10}:|{'-' * 10}:|")
    for config in CONFIGS:
        m = med[config]
        print(f"| {config:<16s} | {mib(m['peak']):9.2f} | {m['peak'] / base['peak']:8.2f} | "
              f"{mib(m['resident']):12.2f} | {m['epoch_s']:8.3f} | "
              f"{m['epoch_s'] / base['epoch_s']:8.2f} |")


if __name__ == "__main__":
    main()
