"""Quickstart: train a digits classifier under TPUStrategyWrapper.

Runs anywhere: on a TPU (Colab, TPU VM) it uses TPUStrategy, on a GPU machine
MirroredStrategy, on a laptop or CI the CPU. The data is scikit-learn's bundled
digits (no download). Features are switched on with flags, e.g.

    python examples/quickstart.py --logical-cpus 2 --accumulation-steps 4
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
                        help="distil from this saved teacher (logits output) with "
                             "ktm.Distillation; examples/distill_digits.py makes one")
    return parser.parse_args(argv)


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
        ]
    )


def main(argv=None) -> float:
    args = parse_args(argv)
    import keras

    import keras_tpu_mem as ktm

    tpu = ktm.TPUStrategyWrapper(logical_cpus=args.logical_cpus)
    print(tpu.describe())
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_val, y_val) = load_digits_split()

    with tpu.scope():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=args.steps_per_execution,
        )
        teacher = keras.models.load_model(args.distill_from) if args.distill_from else None

    import tensorflow as tf

    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(2048, seed=0)
    train_ds = tpu.distribute(train, args.global_batch)
    log_dir = os.path.join(args.log_dir, "quickstart")
    # Memory of every replica device and samples/s, into logs, History and
    # TensorBoard; `keras-tpu-mem report LOG_DIR` draws them.
    callbacks = [ktm.HBMMonitor(log_dir),
                 ktm.ThroughputMonitor(log_dir, dataset=train_ds)]
    if args.accumulation_steps > 1:
        # The dataset yields the global batch; each replica splits its share into
        # micro-batches and the optimizer steps once per global batch.
        callbacks.append(ktm.GradientAccumulation(steps=args.accumulation_steps))
    if args.bf16:
        callbacks.append(ktm.MixedBFloat16())
    if args.prune:
        # Reach the final sparsity two thirds into training, then fine-tune.
        updates = args.epochs * (len(x_train) // args.global_batch)
        end_step = max(10, updates * 2 // 3 // 10 * 10)
        callbacks.append(ktm.Pruning(ktm.PolynomialDecay(0.0, args.prune, begin_step=0,
                                                         end_step=end_step, frequency=10)))
    if teacher is not None:
        callbacks.append(ktm.Distillation(teacher, temperature=2.0, alpha=0.5))
    start = time.perf_counter()
    model.fit(
        train_ds,
        validation_data=tpu.distribute((x_val, y_val), args.global_batch,
                                       drop_remainder=False),
        epochs=args.epochs,
        callbacks=callbacks,
        verbose=2,
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
