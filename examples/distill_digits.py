"""Distil a digits teacher into a student hundreds of times smaller, on an ordinary fit.

Trains a teacher MLP on scikit-learn's bundled digits (no download), then the
same small student twice from the same initial weights: alone, and with
`ktm.Distillation`. By default the teacher's logits are cached once with
`ktm.cache_teacher_logits` (the student's training never holds the teacher);
`--live-teacher` runs the teacher inside the student's step instead. Prints the
three validation accuracies. About a minute on 2 CPU cores.

    python examples/distill_digits.py [--live-teacher] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--alpha", type=float, default=0.7)
    parser.add_argument("--live-teacher", action="store_true",
                        help="run the teacher inside the student's step instead of caching")
    parser.add_argument("--cache-dir", default=None,
                        help="save the cached logits there (a later run can load them)")
    return parser.parse_args(argv)


def load_digits_split(seed: int = 0):
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    # A small training set is where a teacher's soft labels help most.
    return (x[:500], y[:500]), (x[500:], y[500:])


def build_teacher():
    import keras

    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(10),  # logits: no softmax
    ], name="teacher")


def build_student():
    import keras

    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ], name="student")


def compile_model(model, learning_rate=3e-3):
    import keras

    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main(argv=None):
    args = parse_args(argv)
    import keras
    import tensorflow as tf

    import keras_tpu_mem as ktm

    start = time.perf_counter()
    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_val, y_val) = load_digits_split()
    examples = tf.data.Dataset.from_tensor_slices((x_train, y_train))

    def batches(dataset):
        return dataset.shuffle(len(x_train), seed=1).batch(args.batch)

    teacher = compile_model(build_teacher(), 1e-3)
    teacher.fit(batches(examples), epochs=args.epochs, verbose=0)
    teacher_acc = teacher.evaluate(x_val, y_val, verbose=0)[1]

    initial = build_student().get_weights()
    alone = compile_model(build_student())
    alone.set_weights(initial)
    alone.fit(batches(examples), epochs=args.epochs, verbose=0)
    alone_acc = alone.evaluate(x_val, y_val, verbose=0)[1]

    distilled = compile_model(build_student())
    distilled.set_weights(initial)
    if args.live_teacher:
        data = batches(examples)
        callback = ktm.Distillation(teacher, temperature=args.temperature, alpha=args.alpha)
    else:
        cached = ktm.cache_teacher_logits(teacher, examples.batch(256), path=args.cache_dir)
        data = batches(cached)
        callback = ktm.Distillation(temperature=args.temperature, alpha=args.alpha)
    distilled.fit(data, epochs=args.epochs, verbose=0, callbacks=[callback])
    distilled_acc = distilled.evaluate(x_val, y_val, verbose=0)[1]

    ratio = teacher.count_params() / distilled.count_params()
    print(f"teacher:             {teacher.count_params():>8,} parameters, "
          f"validation accuracy {teacher_acc:.4f}")
    print(f"student, distilled:  {distilled.count_params():>8,} parameters ({ratio:.0f}x "
          f"smaller), validation accuracy {distilled_acc:.4f} "
          f"({'live teacher' if args.live_teacher else 'cached logits'}, "
          f"T={args.temperature}, alpha={args.alpha})")
    print(f"student, alone:      {alone.count_params():>8,} parameters, "
          f"validation accuracy {alone_acc:.4f}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return teacher_acc, distilled_acc, alone_acc


if __name__ == "__main__":
    main()
