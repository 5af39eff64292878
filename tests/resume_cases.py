"""The run `ResumableCheckpoint`'s tests stop and resume: every training feature on.

A student MLP with Dropout (random state to restore), its examples shuffled through
`TPUStrategyWrapper.distribute(seed=...)` (each epoch in its own order), trained with
`GradientAccumulation(2)`, `MixedBFloat16`, `Pruning` (masks recomputed every 4
updates) and `Distillation` from a live teacher, 10 updates per epoch, under one
of the cases of the resume matrix: JAX `DataParallel(8)` ("dp8") or
`ShardedDataParallel()` ("fsdp8"), TensorFlow `MirroredStrategy` over 2 logical
CPUs ("mirrored") or the default strategy with `jit_compile=True` ("jit").

Run as a script (`python tests/resume_cases.py CASE DIR OUT [--kill-at N | --notice-at
N]`), it is the process a preemption kills: with `--kill-at N` it SIGKILLs itself at
the end of the N-th batch of the fit (a save falls at the start of a batch), with
`--notice-at N` it sends itself SIGTERM there (a preemption notice; the periodic saves
then every 1000 updates: none mid-epoch); otherwise it trains to the end and writes
the final state to OUT (`state_arrays`).
"""

from __future__ import annotations

import os
import sys
import time

EPOCHS, BATCH, EXAMPLES, EVERY, DATA_SEED = 3, 32, 320, 5, 11
JAX_CASES = ("dp8", "fsdp8")
#: The cases fit under a `keras.distribution` (JAX), also `cluster`: `DataParallel` over
#: a `jax.distributed` job's devices, and `cluster_fsdp`: `ShardedDataParallel` over them
#: (the state split over the processes; tests/multiprocess_worker_jax.py).
#: `fsdp4`: `ShardedDataParallel` over 4 of the 8 devices (a restart on another device
#: count).
_KERAS_DISTRIBUTION_CASES = (*JAX_CASES, "fsdp4", "cluster", "cluster_fsdp")
TENSORFLOW_CASES = ("mirrored", "jit")


def _distribution(case):
    if case == "dp8":
        import jax
        import keras

        return keras.distribution.DataParallel(devices=jax.devices()[:8]).scope()
    if case == "cluster":  # every device of a jax.distributed job, each process its share
        import jax
        import keras

        return keras.distribution.DataParallel(devices=jax.devices(),
                                               auto_shard_dataset=False).scope()
    if case in ("fsdp8", "fsdp4", "cluster_fsdp"):
        import jax

        from keras_tpu_mem.sharding import ShardedDataParallel

        if case == "cluster_fsdp":  # every device of a jax.distributed job, as `cluster`
            return ShardedDataParallel(devices=jax.devices(), auto_shard_dataset=False).scope()
        return ShardedDataParallel(devices=jax.devices()[:4 if case == "fsdp4" else 8]).scope()
    if case == "mirrored":
        from keras_tpu_mem import TPUStrategyWrapper

        return TPUStrategyWrapper(logical_cpus=2).scope()
    if case == "jit":
        import contextlib

        return contextlib.nullcontext()
    raise ValueError(f"unknown case {case!r}")


def _mlp(hidden, seed, dropout):
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((16,)), keras.layers.Dense(hidden, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(0.2))
    layers += [keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(8)]
    return keras.Sequential(layers)


def data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 16)).astype("float32")
    y = (np.abs(x[:, :8]).argmax(axis=1)).astype("int32")
    return x, y


def batches(case):
    """The examples shuffled through `TPUStrategyWrapper.distribute(seed=...)`: each
    epoch in an order of its own, a function of the seed and the epoch."""
    from keras_tpu_mem import TPUStrategyWrapper

    wrapper = TPUStrategyWrapper(logical_cpus=2) if case == "mirrored" else TPUStrategyWrapper()
    return wrapper.distribute(data(), BATCH, seed=DATA_SEED)


#: How `StopAt` stops a run: the fit by an exception, the process by SIGKILL (as a
#: preemption does), or a preemption notice (SIGTERM to the process; what follows is
#: up to the handlers).
STOPS = ("raise", "kill", "notice")
#: The seconds each batch takes after a notice (`StopAt(at, "notice")`).
NOTICE_PACE_S = 0.25


class StopAt:
    """A callback stopping the run at the end of its `at`-th batch, `how` (`STOPS`)."""

    def __new__(cls, at, how):
        import signal

        import keras

        class _Stop(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seen = 0

            def on_train_batch_end(self, batch, logs=None):
                self.seen += 1
                if how == "notice" and self.seen > at:
                    # Steps long enough for JAX's preemption service to tell every
                    # process of a job (it takes up to about a second here).
                    time.sleep(NOTICE_PACE_S)
                if self.seen == at:
                    if how == "notice":
                        os.kill(os.getpid(), signal.SIGTERM)
                        return
                    if how == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    raise RuntimeError(f"preempted after {at} batches")

        return _Stop()


def train(case, directory=None, *, stop_at=None, stop="raise", asynchronous=True, seed=2,
          orbax=None, every=EVERY):
    """Builds the student and its teacher under `case` and fits them; returns the
    student, the callbacks (`ResumableCheckpoint(directory, every=, asynchronous=,
    orbax=)` last when `directory` is given, then `StopAt(stop_at, stop)`)."""
    import keras

    import keras_tpu_mem as ktm

    examples = batches(case)
    # tf.distribute: models are made under the strategy's scope and fit outside it;
    # keras.distribution: fit runs under the distribution too.
    with _distribution(case):
        teacher = _mlp(48, seed=1, dropout=False)
        student = _mlp(32, seed=seed, dropout=True)
        student.compile(optimizer=keras.optimizers.Adam(1e-2),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        metrics=["accuracy"], jit_compile=case == "jit" or "auto")
        callbacks = [ktm.GradientAccumulation(2), ktm.MixedBFloat16(),
                     ktm.Pruning(ktm.ConstantSparsity(0.5, begin_step=3, frequency=4)),
                     ktm.Distillation(teacher, temperature=2.0, alpha=0.5)]
        if directory is not None:
            callbacks.append(ktm.ResumableCheckpoint(directory, every=every,
                                                     asynchronous=asynchronous, orbax=orbax))
        if stop_at is not None:
            callbacks.append(StopAt(stop_at, stop))
        if case in _KERAS_DISTRIBUTION_CASES:
            history = student.fit(examples, epochs=EPOCHS, shuffle=False, verbose=0,
                                  callbacks=callbacks)
    if case not in _KERAS_DISTRIBUTION_CASES:
        history = student.fit(examples, epochs=EPOCHS, shuffle=False, verbose=0,
                              callbacks=callbacks)
    return student, callbacks, history


def state_arrays(model, callbacks, to_numpy=None) -> dict:
    """Weights, optimizer variables and pruning masks as numpy arrays, by position
    (`to_numpy`: how an array is read whole; Keras' `convert_to_numpy` by default)."""
    import keras

    import keras_tpu_mem as ktm

    to_numpy = to_numpy or keras.ops.convert_to_numpy
    arrays = {f"weight/{i}": to_numpy(v.value) for i, v in enumerate(model.weights)}
    arrays.update({f"optimizer/{i}": to_numpy(v.value)
                   for i, v in enumerate(model.optimizer.variables)})
    from keras_tpu_mem.engine import Engine

    pruning = next(c for c in callbacks if isinstance(c, ktm.Pruning))
    # The masks as the engine holds them (their dtype too: float without XLA).
    masks = Engine.of(model).feature_state(pruning).masks
    arrays.update({f"mask/{i}": to_numpy(mask) for i, mask in enumerate(masks)})
    return arrays


def main(argv):
    import numpy as np

    case, directory, out = argv[:3]
    stop_at, stop, every = None, "raise", EVERY
    for flag, how in (("--kill-at", "kill"), ("--notice-at", "notice")):
        if flag in argv:
            stop_at, stop = int(argv[argv.index(flag) + 1]), how
    if stop == "notice":
        every = 1000
    model, callbacks, _ = train(case, directory, stop_at=stop_at, stop=stop, every=every)
    np.savez(out, **state_arrays(model, callbacks))


if __name__ == "__main__":
    main(sys.argv[1:])
