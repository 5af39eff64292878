"""Quickstart: train a digits classifier under TPUStrategyWrapper.

Runs anywhere: on a TPU (Colab, TPU VM) it uses TPUStrategy, on a GPU machine
MirroredStrategy, on a laptop or CI the CPU. The data is scikit-learn's bundled
digits (no download). Features are switched on with flags, e.g.

    python examples/quickstart.py --logical-cpus 2 --accumulation-steps 4 --bf16
    python examples/distill_digits.py --save-teacher teacher.keras
    python examples/quickstart.py --distill-from teacher.keras
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Before training it prints the model, the data and one line per feature on.")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--log-dir", default="logs", help="where the monitors write")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--logical-cpus", type=int, default=None,
                        help="without TPU/GPU, mirror over N logical CPUs (replica stand-in)")
    parser.add_argument("--steps-per-execution", type=int, default=4)
    parser.add_argument("--accumulation-steps", type=int, default=4,
                        help="micro-batches per update (GradientAccumulation); 1 turns it off")
    parser.add_argument("--bf16", action="store_true",
                        help="bfloat16 compute, float32 weights and output (ktm.MixedBFloat16)")
    parser.add_argument("--prune", type=float, default=0.0, metavar="SPARSITY",
                        help="prune kernels to this final sparsity, e.g. 0.8 (ktm.Pruning); "
                             "0 turns it off")
    parser.add_argument("--distill-from", default=None, metavar="TEACHER.keras",
                        help="distil from this saved teacher (64 inputs, 10 logits) with "
                             "ktm.Distillation; `python examples/distill_digits.py "
                             "--save-teacher TEACHER.keras` makes one")
    args = parser.parse_args(argv)
    for name in ("epochs", "global_batch", "steps_per_execution", "accumulation_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.prune < 1.0:
        parser.error(f"--prune must be a sparsity in [0, 1), got {args.prune}")
    if args.distill_from is not None and not os.path.isfile(args.distill_from):
        parser.error(f"--distill-from: no such file {args.distill_from!r}; make a teacher "
                     f"with `python examples/distill_digits.py --save-teacher "
                     f"{args.distill_from}`")
    return args


def load_digits_split(seed: int = 0):
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def build_model():
    import keras

    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="digits_mlp",
    )


def _rounded(value) -> str:
    """About three significant figures, thousands separated: what a reader compares by eye."""
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def epoch_printer(epochs: int):
    """One rounded line per epoch (Keras' own line prints every value to 4 decimals).

    `first_step_s` is the same number at every epoch (the fit's first execution:
    trace + XLA compile + its steps), so it is shown once, on the first line.
    """
    import keras

    class EpochLine(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs = dict(logs or {})
            first = logs.pop("first_step_s", None)
            parts = [f"{key}: {_rounded(value)}" for key, value in logs.items()]
            if epoch == 0 and first is not None and math.isfinite(first):
                parts.append(f"first step (trace + compile): {first:.2f} s")
            print(f"epoch {epoch + 1}/{epochs} - " + " - ".join(parts), flush=True)

    return EpochLine()


def main(argv=None) -> float:
    args = parse_args(argv)
    import keras
    import tensorflow as tf

    import keras_tpu_mem as ktm

    tpu = ktm.TPUStrategyWrapper(logical_cpus=args.logical_cpus)
    print(tpu.describe())
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_val, y_val) = load_digits_split()
    per_replica = tpu.per_replica_batch_size(args.global_batch)

    with tpu.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=args.steps_per_execution,
        )
        # The teacher's variables must live where the student's replicas run.
        teacher = keras.models.load_model(args.distill_from) if args.distill_from else None

    # The dataset shuffles (again every epoch), so fit gets shuffle=False below:
    # fit cannot shuffle a tf.data pipeline and would only warn that it ignores it.
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2048, seed=0)
    train_ds = tpu.distribute(train, args.global_batch)
    log_dir = os.path.join(args.log_dir, "quickstart")
    # Each feature with the line that says what it does and with which setting.
    features = [
        (ktm.HBMMonitor(log_dir), f"memory of every replica device, into {log_dir}"),
        (ktm.ThroughputMonitor(log_dir, dataset=train_ds),
         f"samples/s, step time, compile time, input-pipeline check, into {log_dir}"),
    ]
    if args.accumulation_steps > 1:
        # The dataset yields the global batch; each replica splits its share into
        # micro-batches and the optimizer steps once per global batch.
        features.append((
            ktm.GradientAccumulation(steps=args.accumulation_steps),
            f"{args.accumulation_steps} micro-batches of "
            f"{per_replica // args.accumulation_steps} per replica, one optimizer update "
            f"per global batch of {args.global_batch}"))
    if args.bf16:
        features.append((ktm.MixedBFloat16(),
                         "bfloat16 compute, float32 weights and float32 logits"))
    if args.prune:
        # Reach the final sparsity two thirds into training, then fine-tune.
        updates = args.epochs * (len(x_train) // args.global_batch)
        end_step = max(10, updates * 2 // 3 // 10 * 10)
        features.append((
            ktm.Pruning(ktm.PolynomialDecay(0.0, args.prune, begin_step=0,
                                            end_step=end_step, frequency=10)),
            f"kernels pruned by magnitude to {args.prune:.0%} sparsity by update {end_step} "
            "(PolynomialDecay, masks updated every 10 updates)"))
    if teacher is not None:
        features.append((
            ktm.Distillation(teacher, temperature=2.0, alpha=0.5),
            f"live teacher {args.distill_from} ({teacher.count_params():,} parameters), "
            "temperature 2.0, alpha 0.5 (half the loss from the teacher's soft targets)"))

    print(f"model: {model.name}, an MLP 64-256-256-10 with {model.count_params():,} "
          f"parameters; Adam(1e-3), steps_per_execution={args.steps_per_execution}")
    print(f"data:  scikit-learn digits (8x8 images as 64 features, 10 classes): "
          f"{len(x_train)} training and {len(x_val)} validation examples; global batch "
          f"{args.global_batch} = {tpu.num_replicas} replica(s) x {per_replica}")
    print("features on:")
    for callback, what in features:
        print(f"  {type(callback).__name__:<22}{what}")

    start = time.perf_counter()
    model.fit(
        train_ds,
        validation_data=tpu.distribute((x_val, y_val), args.global_batch,
                                       drop_remainder=False),
        epochs=args.epochs,
        shuffle=False,
        callbacks=[callback for callback, _ in features] + [epoch_printer(args.epochs)],
        verbose=0,
    )
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x_val, y_val, verbose=0)
    print(f"final validation accuracy: {accuracy:.4f} ({seconds:.1f} s of training)")
    print(f"memory and throughput charts: keras-tpu-mem report {log_dir}")
    if args.prune:
        print(ktm.sparsity_report(model))
    return accuracy


if __name__ == "__main__":
    main()
