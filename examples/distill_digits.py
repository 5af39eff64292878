"""Distillation where it pays: a teacher that knows more than the student's few labels.

scikit-learn's bundled digits (no download) are split three ways, with the same
shuffle as examples/quickstart.py:

* 500 labelled digits the teacher (a 512-512 MLP) is trained on; the student
  never sees them;
* 937 other digits for the student, of which only `--labels` (default 200)
  are labelled;
* the quickstart's 360 validation digits, for every accuracy printed.

For each of `--seeds` seeds (another labelled subset and another
initialisation each time) one small student (64-32-10, 125x fewer parameters)
is trained twice, from the same initial weights and for the same number of
updates:

* alone: on its labelled digits only;
* distilled: on all 937 with `ktm.Distillation`: the teacher's soft targets at
  temperature T on every digit, plus the label term with the student's own
  label where it has one and the teacher's top class where it has none.

It prints the teacher's validation accuracy and the students' mean ± standard
deviation over the seeds. By default the teacher's logits are cached once with
`ktm.cache_teacher_logits` (the students' training never holds the teacher);
`--live-teacher` runs the teacher inside the student's step instead. About half
a minute on 2 CPU cores.

    python examples/distill_digits.py [--live-teacher] [--cache-dir DIR]
    python examples/distill_digits.py --save-teacher teacher.keras
    python examples/quickstart.py --distill-from teacher.keras
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

TEACHER_DIGITS = 500   # labelled digits only the teacher sees
VALIDATION_FROM = 1437  # the quickstart's split: 80% train, the last 360 for validation


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30,
                        help="student epochs (each a pass over the student's 937 digits)")
    parser.add_argument("--teacher-epochs", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=5,
                        help="students trained per setting; the spread is over these")
    parser.add_argument("--labels", type=int, default=200,
                        help="how many of the student's 937 digits are labelled")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--alpha", type=float, default=0.5,
                        help="weight of the distillation term (1 - alpha: the label term)")
    parser.add_argument("--live-teacher", action="store_true",
                        help="run the teacher inside the student's step instead of caching")
    parser.add_argument("--cache-dir", default=None,
                        help="save the cached logits there (a later run can load them)")
    parser.add_argument("--save-teacher", default=None, metavar="PATH.keras",
                        help="also save the trained teacher there, e.g. for "
                             "`examples/quickstart.py --distill-from PATH.keras`")
    args = parser.parse_args(argv)
    for name in ("epochs", "teacher_epochs", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seeds < 2:
        parser.error(f"--seeds must be >= 2 (the spread needs two runs), got {args.seeds}")
    pool = VALIDATION_FROM - TEACHER_DIGITS
    if not 10 <= args.labels <= pool:
        parser.error(f"--labels must be between 10 and {pool} (the student's digits), "
                     f"got {args.labels}")
    if args.save_teacher is not None:
        if not args.save_teacher.endswith(".keras"):
            parser.error(f"--save-teacher must name a .keras file (Keras' format), "
                         f"got {args.save_teacher!r}")
        folder = os.path.dirname(os.path.abspath(args.save_teacher))
        if not os.path.isdir(folder):
            parser.error(f"--save-teacher: folder {folder!r} does not exist")
    return args


def load_digits_split(seed: int = 0):
    """(teacher's digits), (student's digits), (validation digits), as numpy arrays."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    # The quickstart's permutation: its validation digits are these, and a saved
    # teacher has never seen them.
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return ((x[:TEACHER_DIGITS], y[:TEACHER_DIGITS]),
            (x[TEACHER_DIGITS:VALIDATION_FROM], y[TEACHER_DIGITS:VALIDATION_FROM]),
            (x[VALIDATION_FROM:], y[VALIDATION_FROM:]))


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


def mean_spread(values):
    """Mean and sample standard deviation (ddof=1): the spread a rerun would show."""
    import numpy as np

    values = np.asarray(values, dtype="float64")
    return float(values.mean()), float(values.std(ddof=1))


def main(argv=None):
    args = parse_args(argv)
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_tpu_mem as ktm

    start = time.perf_counter()
    (x_teacher, y_teacher), (x_pool, y_pool), (x_val, y_val) = load_digits_split()

    keras.utils.set_random_seed(0)
    teacher = compile_model(build_teacher(), 1e-3)
    teacher.fit(tf.data.Dataset.from_tensor_slices((x_teacher, y_teacher))
                .shuffle(len(x_teacher), seed=1).batch(args.batch),
                epochs=args.teacher_epochs, shuffle=False, verbose=0)  # shuffled above
    teacher_acc = teacher.evaluate(x_val, y_val, verbose=0)[1]
    if args.save_teacher:
        teacher.save(args.save_teacher)

    # The teacher's logits on the student's digits, computed once for all seeds.
    if args.live_teacher:
        cached = None
        teacher_logits = teacher.predict(x_pool, batch_size=256, verbose=0)
    else:
        # Elements (x, {"ktm_teacher_logits": ...}), in the order of x_pool.
        cached = ktm.cache_teacher_logits(
            teacher, tf.data.Dataset.from_tensor_slices(x_pool).batch(256),
            path=args.cache_dir)
        teacher_logits = np.concatenate(
            [logits["ktm_teacher_logits"] for _, logits in cached.batch(1024).as_numpy_iterator()])
    teacher_top = teacher_logits.argmax(axis=-1).astype("int32")

    updates_per_epoch = math.ceil(len(x_pool) / args.batch)  # the same for both students
    alone_accs, distilled_accs = [], []
    for seed in range(args.seeds):
        labelled = np.random.default_rng(seed).choice(len(x_pool), args.labels, replace=False)
        keras.utils.set_random_seed(seed)
        initial = build_student().get_weights()

        alone = compile_model(build_student())
        alone.set_weights(initial)
        own = (tf.data.Dataset.from_tensor_slices((x_pool[labelled], y_pool[labelled]))
               .shuffle(args.labels, seed=seed).repeat().batch(args.batch))
        alone.fit(own, epochs=args.epochs, steps_per_epoch=updates_per_epoch, shuffle=False,
                  verbose=0)
        alone_accs.append(alone.evaluate(x_val, y_val, verbose=0)[1])

        # The label term needs a label for every digit: the student's own where it
        # has one, the teacher's top class where it has none.
        labels = teacher_top.copy()
        labels[labelled] = y_pool[labelled]
        distilled = compile_model(build_student())
        distilled.set_weights(initial)
        if cached is None:
            data = tf.data.Dataset.from_tensor_slices((x_pool, labels))
            callback = ktm.Distillation(teacher, temperature=args.temperature,
                                        alpha=args.alpha)
        else:
            # Put the labels next to each cached x: elements ((x, y), logits).
            data = tf.data.Dataset.zip((cached, tf.data.Dataset.from_tensor_slices(labels)))
            data = data.map(lambda element, label: ((element[0], label), element[1]))
            callback = ktm.Distillation(temperature=args.temperature, alpha=args.alpha)
        distilled.fit(data.shuffle(len(x_pool), seed=seed).batch(args.batch),
                      epochs=args.epochs, shuffle=False, verbose=0, callbacks=[callback])
        distilled_accs.append(distilled.evaluate(x_val, y_val, verbose=0)[1])

    d_mean, d_spread = mean_spread(distilled_accs)
    a_mean, a_spread = mean_spread(alone_accs)
    ratio = teacher.count_params() / distilled.count_params()
    how = "live teacher" if args.live_teacher else "cached logits"
    print(f"teacher ({teacher.count_params():,} parameters, {len(x_teacher)} labelled digits "
          f"of its own): validation accuracy {teacher_acc:.4f}")
    print(f"validation accuracy of the student ({distilled.count_params():,} parameters, "
          f"{ratio:.0f}x smaller), mean ± standard deviation over {args.seeds} seeds:")
    print(f"distilled student: {d_mean:.4f} ± {d_spread:.4f}  ({args.labels} labels + the "
          f"teacher's soft targets on all {len(x_pool)} digits; {how}, "
          f"T={args.temperature:g}, alpha={args.alpha:g})")
    print(f"student alone:     {a_mean:.4f} ± {a_spread:.4f}  ({args.labels} labelled digits, "
          "the same initial weights and number of updates)")
    if args.save_teacher:
        print(f"teacher saved to {args.save_teacher}: python examples/quickstart.py "
              f"--distill-from {args.save_teacher}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return teacher_acc, (d_mean, d_spread), (a_mean, a_spread)


if __name__ == "__main__":
    main()
