"""MixedBFloat16 vs float32 vs Keras' own mixed_bfloat16: memory and step time.

The activation-dominated model of issue 4: input 512, 8 x Dense(512, relu),
Dense(10), batch 8192, Adam, sparse cross-entropy on logits. Variants:

* `float32`       - plain `fit`, float32 everywhere (the reference, 1.00x)
* `keras-bf16`    - the peer: Keras' global `mixed_bfloat16` policy set before
                    building, with the output layer `dtype="float32"` (the
                    pattern the Keras mixed-precision guide recommends)
* `keras-bf16-naive` - the same without the float32 output layer (bf16 logits),
                    what the planning measurement used
* `ktm`           - a float32-built model, `fit(callbacks=[ktm.MixedBFloat16()])`
* `ktm-exact`     - `ktm.MixedBFloat16(exact_output_gradients=True)`

For each variant and `jit_compile` setting, a fresh Python process (the CPU
allocator's peak is per process) runs `fit` on a generated input pipeline
(`tf.data.Dataset.range(n).map(random batch)`, nothing held in memory but the
batch being consumed) for 1 warm-up step plus `--steps` measured steps, and
reports:

* allocator peak   - `tf.config.experimental.get_memory_info("CPU:0")["peak"]`
                     over the measured steps after `reset_memory_stats` (oneDNN
                     on, the default): everything the TF allocator holds then,
                     weights and Adam slots included
* step peak        - that peak minus what was allocated when the measured steps
                     began (weights, optimizer slots): what the steps add
* compiled temp    - XLA's temporaries (activations, gradients, workspace) in
                     the buffer assignment of one `jit_compile=True` train step
                     (`ktm.compiled_memory`), jit rows only
* step time        - median wall time of the measured steps

Repetitions alternate the order of the variants; medians are reported. Run:

    python benchmarks/bench_precision.py            # about 5 minutes on 2 cores
    python benchmarks/bench_precision.py --quick    # batch 1024, for a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("float32", "keras-bf16", "keras-bf16-naive", "ktm", "ktm-exact")
XLA_VARIANTS = ("float32", "keras-bf16", "ktm")
MIB = 1024**2


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run")
    parser.add_argument("--reps", type=int, default=2, help="repetitions without XLA")
    parser.add_argument("--xla-reps", type=int, default=1, help="repetitions with XLA")
    parser.add_argument("--quick", action="store_true", help="batch 1024, one repetition")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--jit", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----------------------------------------------------------------- child
def run_child(variant: str, jit: bool, batch: int, steps: int) -> dict:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    import keras_tpu_mem as ktm
    from keras_tpu_mem.precision import MixedBFloat16

    keras.utils.set_random_seed(0)
    if variant.startswith("keras-bf16"):
        keras.config.set_dtype_policy("mixed_bfloat16")
    head_dtype = "float32" if variant == "keras-bf16" else None
    model = keras.Sequential(
        [keras.Input((512,))]
        + [keras.layers.Dense(512, activation="relu") for _ in range(8)]
        + [keras.layers.Dense(10, dtype=head_dtype)]
    )
    keras.config.set_dtype_policy("float32")
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit)

    def make(i):
        seed = tf.stack([tf.cast(i, tf.int32), 0])
        x = tf.random.stateless_uniform((batch, 512), seed=seed)
        y = tf.random.stateless_uniform((batch,), seed=seed + 1, maxval=10, dtype=tf.int32)
        return x, y

    data = tf.data.Dataset.range(steps + 1).map(make)

    class Meter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.compiled = [], None

        def on_train_batch_begin(self, batch_index, logs=None):
            if batch_index == 1:  # step 0 traced and built the optimizer
                tf.config.experimental.reset_memory_stats("CPU:0")
                self.before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch_index, logs=None):
            if batch_index >= 1:
                self.times.append(time.perf_counter() - self.start)
            if batch_index == steps:
                self.peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
                if jit:  # XLA's plan of the step, with the policies of this fit in place
                    from keras_tpu_mem.planning import compiled_memory

                    self.compiled = compiled_memory(self.model, batch).temp_bytes

    meter = Meter()
    callbacks = []
    if variant == "ktm":
        callbacks.append(MixedBFloat16())
    elif variant == "ktm-exact":
        callbacks.append(MixedBFloat16(exact_output_gradients=True))
    model.fit(data, epochs=1, verbose=0, callbacks=[*callbacks, meter])
    return {
        "variant": variant, "jit": jit, "peak": int(meter.peak),
        "step": int(meter.peak - meter.before), "compiled_temp": meter.compiled,
        "time": statistics.median(meter.times), "version": ktm.__version__,
    }


# ---------------------------------------------------------------- parent
def measure(variant, jit, batch, steps) -> dict:
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, "--jit", str(int(jit)),
         "--batch", str(batch), "--steps", str(steps)],
        capture_output=True, text=True, env=env, check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{variant} (jit={jit}) failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def table(results, jit) -> str:
    rows = [r for r in results if r["jit"] == jit]
    names = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    med = {}
    for name in names:
        mine = [r for r in rows if r["variant"] == name]
        med[name] = {key: statistics.median(r[key] for r in mine)
                     for key in ("peak", "step", "time")}
        temps = [r["compiled_temp"] for r in mine if r["compiled_temp"] is not None]
        med[name]["compiled_temp"] = statistics.median(temps) if temps else None
        med[name]["n"] = len(mine)
    ref = med["float32"]
    title = "jit_compile=True (XLA)" if jit else "jit_compile=False"
    head = (f"| {title} | reps | allocator peak | step peak | compiled temp | step time |\n"
            "|---|---|---|---|---|---|")
    lines = [head]
    for name in names:
        m = med[name]
        temp = m["compiled_temp"]
        temp = "-" if temp is None else (
            f"{temp / MIB:.0f} MiB ({temp / ref['compiled_temp']:.2f}x)")
        lines.append(
            f"| {name} | {m['n']} "
            f"| {m['peak'] / MIB:.0f} MiB ({m['peak'] / ref['peak']:.2f}x) "
            f"| {m['step'] / MIB:.0f} MiB ({m['step'] / ref['step']:.2f}x) "
            f"| {temp} "
            f"| {m['time']:.2f} s ({m['time'] / ref['time']:.2f}x) |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args.child, bool(args.jit), args.batch, args.steps)))
        return None
    batch, reps, xla_reps = args.batch, args.reps, args.xla_reps
    if args.quick:
        batch, reps, xla_reps = 1024, 1, 1
    start = time.perf_counter()
    results = []
    for jit, variants, count in ((False, VARIANTS, reps), (True, XLA_VARIANTS, xla_reps)):
        for rep in range(count):
            order = variants if rep % 2 == 0 else variants[::-1]
            for variant in order:
                result = measure(variant, jit, batch, args.steps)
                results.append(result)
                print(f"  {variant:<17} jit={int(jit)} peak {result['peak'] / MIB:7.1f} MiB "
                      f"step {result['step'] / MIB:7.1f} MiB time {result['time']:.2f} s",
                      flush=True)
    print(f"\ninput 512, 8 x Dense(512, relu), Dense(10), batch {batch}, Adam; "
          f"{args.steps} measured steps; {time.strftime('%Y-%m-%d')}; "
          f"{time.perf_counter() - start:.0f} s\n")
    print(table(results, False))
    print()
    print(table(results, True))
    return results


if __name__ == "__main__":
    main()
