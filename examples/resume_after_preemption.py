"""Train, get preempted, run the same script again: the fit resumes at the next batch.

Spot and preemptible TPUs are taken back at any moment. This script trains a
digits classifier (scikit-learn's bundled digits, no download) with
`GradientAccumulation` and `ktm.ResumableCheckpoint`, a checkpoint every 5
optimizer updates, its examples shuffled through `distribute(seed=...)` (each
epoch's order a function of the seed and the epoch). With `--kill-at N` it kills
itself (SIGKILL, as a preemption does) after N batches. Run it again without
`--kill-at`: it restores the newest complete checkpoint, starts at the epoch and
batch it holds, and trains to the end on the weights of a run that was never
stopped, bit for bit (tests/test_examples.py compares them). A preemption notice
instead (`kill -TERM <pid>` while it trains: what a spot VM's shutdown sends) is
saved at the next update before the process ends, so the restart loses nothing.

    python examples/resume_after_preemption.py --fresh --kill-at 60   # killed in epoch 2
    keras-tpu-mem checkpoints /tmp/ktm_resume_example                  # what was saved
    python examples/resume_after_preemption.py                        # resumes, ends

Either Keras backend (`KERAS_BACKEND=jax` too); on a TPU the same script runs
under TPUStrategy or the JAX TPU mesh.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal

os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--directory", default="/tmp/ktm_resume_example",
                        help="the checkpoints (a restart resumes from the newest)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=5, help="updates between checkpoints")
    parser.add_argument("--kill-at", type=int, default=None, metavar="N",
                        help="SIGKILL this process at the end of its N-th batch")
    parser.add_argument("--fresh", action="store_true",
                        help="delete the checkpoints first: train from the start")
    parser.add_argument("--save-weights", default=None, metavar="FILE.npz",
                        help="write the final weights and optimizer state (numpy .npz) here")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.fresh:
        shutil.rmtree(args.directory, ignore_errors=True)

    import keras
    import numpy as np
    from sklearn.datasets import load_digits

    import keras_tpu_mem as ktm

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16.0).astype("float32"), y.astype("int32")
    x_train, y_train, x_val, y_val = x[:1500], y[:1500], x[1500:], y[1500:]

    wrapper = ktm.TPUStrategyWrapper()
    # The same weights at every run: a restart builds the model the first run built,
    # then the checkpoint's values replace them.
    keras.utils.set_random_seed(0)
    with wrapper.scope():
        model = keras.Sequential([keras.Input((64,)),
                                  keras.layers.Dense(128, activation="relu"),
                                  keras.layers.Dropout(0.2),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        batches = wrapper.distribute((x_train, y_train), global_batch_size=32, seed=0)
        checkpoint = ktm.ResumableCheckpoint(args.directory, every=args.every)
        callbacks = [ktm.GradientAccumulation(2), checkpoint]
        if args.kill_at is not None:
            callbacks.append(_Preemption(args.kill_at, keras))
        # In the scope: on JAX the distribution lays out the step's batches too.
        model.fit(batches, epochs=args.epochs, shuffle=False, verbose=0,
                  callbacks=callbacks)
    if checkpoint.resumed_from is None:
        print("trained from the start")
    else:
        info = checkpoint.resumed_from
        print(f"resumed from {info.path}: update {info.update}, epoch {info.epoch + 1}, "
              f"batch {info.batch}")
    _, accuracy = model.evaluate(x_val, y_val, verbose=0)
    print(f"{int(np.asarray(model.optimizer.iterations))} updates; "
          f"validation accuracy {accuracy:.3f}")
    if args.save_weights:
        optimizer = [keras.ops.convert_to_numpy(v.value) for v in model.optimizer.variables]
        np.savez(args.save_weights, *model.get_weights(), *optimizer)
        print(f"weights and optimizer state saved to {args.save_weights}")


def _Preemption(at: int, keras):
    """A callback that SIGKILLs this process at the end of its `at`-th batch."""

    class Preemption(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == at:
                print(f"preempted after {at} batches (SIGKILL)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    return Preemption()


if __name__ == "__main__":
    main()
