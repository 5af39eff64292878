"""Fit a model whose state does not fit one device: plan it, shard it, train it (JAX).

On 8 host CPU devices (`--devices`; a stand-in for the 8 chips of a TPU slice),
with scikit-learn's bundled digits (no download):

1. a wide MLP (64-2048-2048-10, Adam: 4.3 M weights, twice as many optimizer
   slots) is built under `keras.distribution.DataParallel`, which puts all of
   its state on every device;
2. `ktm.plan(model, 512, device="<budget>-8", search=True)` with a per-device
   budget (`--budget`, default 40 MiB) below that state: no gradient
   accumulation, bfloat16 or recomputation can fit it, so the search splits the
   state over the devices (`ShardedDataParallel`: the optimizer's slots first,
   then the weights too) and recommends the first configuration that fits, each
   one compiled;
3. `ktm.reshard(model, recommendation.distribution())` moves the model's state
   there in place, and `fit` in that distribution's scope trains it with the
   recommended callbacks.

It prints the plan, each device's compiled step before and after, and the
validation accuracy. About a minute on 2 CPU cores.

    python examples/fit_sharded_state.py [--budget 40MiB] [--epochs 8]
"""

from __future__ import annotations

import argparse
import os
import sys

# This example is JAX's (`keras.distribution`): set before Keras loads.
os.environ["KERAS_BACKEND"] = "jax"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="40MiB",
                        help="memory of one device, e.g. 40MiB (default) or 41943040B")
    parser.add_argument("--epochs", type=int, default=8, help="epochs to train (default 8)")
    parser.add_argument("--devices", type=int, default=8,
                        help="host CPU devices standing in for accelerators (default 8)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs must be >= 1, got {args.epochs}")
    if args.devices < 2:
        parser.error(f"--devices must be >= 2 (state is split over them), got {args.devices}")
    return args


def main(argv=None) -> float:
    args = parse_args(argv)
    # Before JAX starts: the host CPU becomes `--devices` devices.
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import keras
    import numpy as np
    from sklearn.datasets import load_digits

    import keras_tpu_mem as ktm

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.data))
    x = (data.data[order] / 16.0).astype("float32")
    y = data.target[order].astype("int32")
    batch = 64 * args.devices
    n = (len(x) - 360) // batch * batch
    (x_train, y_train), (x_val, y_val) = (x[:n], y[:n]), (x[-360:], y[-360:])

    replicated = keras.distribution.DataParallel()
    with replicated.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(2048, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        before = ktm.compiled_memory(model, batch, hlo_text=False)
        planned = ktm.plan(model, batch, device=f"{args.budget}-{args.devices}", search=True)
    print("Each device's step under DataParallel:")
    print(before)
    print(planned)
    recommendation = planned.recommendation
    if recommendation is None:
        print("Nothing fits this budget: try a larger --budget.")
        return 0.0
    distribution = recommendation.distribution() or replicated
    callbacks = recommendation.callbacks()
    ktm.reshard(model, distribution)
    with distribution.scope():
        after = ktm.compiled_memory(model, batch, callbacks=callbacks or None, hlo_text=False)
        model.fit(x_train, y_train, batch_size=batch, epochs=args.epochs, verbose=0,
                  callbacks=callbacks)
        _, accuracy = model.evaluate(x_val, y_val, batch_size=batch // 8 * 8, verbose=0)
    print(f"Each device's step as recommended ({recommendation.describe()}):")
    print(after)
    mib = 2 ** 20
    print(f"state per device: {before.state_bytes / mib:.2f} MiB -> "
          f"{after.state_bytes / mib:.2f} MiB; total {before.total_bytes / mib:.2f} MiB -> "
          f"{after.total_bytes / mib:.2f} MiB of {planned.usable_bytes / mib:.2f} MiB usable")
    print(f"validation accuracy: {accuracy:.4f}")
    return float(accuracy)


if __name__ == "__main__":
    main(sys.argv[1:])
