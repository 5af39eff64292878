"""What one real training step takes on the device, beside what the planner says.

For a small transformer encoder at three batch sizes and four configurations
(plain, `GradientAccumulation(4)`, `MixedBFloat16()`, `Rematerialize()`), each
configuration runs in a fresh subprocess so that device peaks do not mix:

1. `fit` on one batch (one real training step, compiled and run on
   `jax.devices()[0]`), then the device's
   `memory_stats()["peak_bytes_in_use"]`;
2. `ktm.compiled_memory(model, batch, callbacks=...)`: its `total_bytes` and
   `by_layer().peak_bytes` (the buffers live at XLA's peak);
3. `ktm.plan(model, batch, callbacks=..., device=...)`: its `total_bytes`.

Writes `device_memory_check.json` and `device_memory_check.md` to `--out`.

On a CPU, `memory_stats()` is None: the table then shows the rise of the
process's peak resident memory (`ru_maxrss`) over the fit instead, marked as a
host figure. It includes XLA's compilation and the host runtime, so it is no
check of the planner; only a GPU or TPU measures the device column. `--quick`
(a tiny encoder at one batch size, all rows in one process, for a smoke test
on CPU) has no per-row peak at all: its measured column is "n/a".

Needs only Keras, JAX, numpy and keras_tpu_mem (no TensorFlow, nothing from
tests/): carry the wheels of Keras (`pip download keras --only-binary=:all:`
with its dependencies) and of this package (`python -m build`) to the
accelerator machine, `pip install keras-*.whl keras_tpu_mem-*.whl` beside its
JAX, and run:

    python benchmarks/device_memory_check.py --out results/          # < 8 min on one chip
    python benchmarks/device_memory_check.py --quick --out /tmp/dmc  # CPU, < 60 s
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

CONFIGS = ("plain", "accumulation_4", "mixed_bfloat16", "rematerialize")
# (sequence, width, heads, feed-forward, vocabulary, batches)
FULL = dict(seq=512, dim=256, heads=8, ffn=1024, vocab=8000, batches=(32, 64, 128))
# --quick: one batch size, all rows in one process (each row compiles three steps).
QUICK = dict(seq=16, dim=32, heads=2, ffn=64, vocab=100, batches=(16,))


def _encoder(seq, dim, heads, ffn, vocab):
    """A one-block transformer encoder (embedding, attention, feed-forward, 4-way head)."""
    import keras

    keras.utils.set_random_seed(0)
    tokens = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim, name="embedding")(tokens)
    attn = keras.layers.MultiHeadAttention(heads, dim // heads, name="attention")(x, x)
    x = keras.layers.LayerNormalization(name="norm_1")(x + attn)
    ff = keras.layers.Dense(ffn, activation="gelu", name="ffn_up")(x)
    down = keras.layers.Dense(dim, name="ffn_down")(ff)
    x = keras.layers.LayerNormalization(name="norm_2")(x + down)
    out = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling1D()(x))
    model = keras.Model(tokens, out)
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _callbacks(config):
    import keras_tpu_mem as ktm

    return {"plain": lambda: [],
            "accumulation_4": lambda: [ktm.GradientAccumulation(4)],
            "mixed_bfloat16": lambda: [ktm.MixedBFloat16()],
            "rematerialize": lambda: [ktm.Rematerialize()]}[config]()


def _max_rss_bytes():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _row(config, batch, shape, fresh):
    """Fits one batch of `config` at `batch`, then asks the planner: one table row."""
    import jax
    import numpy as np

    import keras_tpu_mem as ktm

    device = jax.devices()[0]
    model = _encoder(shape["seq"], shape["dim"], shape["heads"], shape["ffn"], shape["vocab"])
    rng = np.random.default_rng(0)
    x = rng.integers(0, shape["vocab"], (batch, shape["seq"])).astype("int32")
    y = rng.integers(0, 4, (batch,)).astype("int32")
    rss_before = _max_rss_bytes()
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=_callbacks(config))
    fit_seconds = time.perf_counter() - start
    stats = device.memory_stats()
    peak = None if not stats else stats.get("peak_bytes_in_use")
    limit = None if not stats else stats.get("bytes_limit")
    # The planner's figures for the same step (nothing runs: compiles only).
    compiled = ktm.compiled_memory(model, batch, callbacks=_callbacks(config), hlo_text=False)
    table = compiled.by_layer()
    budget = f"{limit}B" if limit else "64GiB"
    memory_plan = ktm.plan(model, batch, device=budget, callbacks=_callbacks(config))
    return {
        "config": config,
        "batch": batch,
        # A process's peaks only mean this row's when the row had the process alone.
        "device_peak_bytes": peak if fresh else None,
        "host_max_rss_rise_bytes": _max_rss_bytes() - rss_before if fresh else None,
        "compiled_total_bytes": int(compiled.total_bytes),
        "by_layer_peak_bytes": int(table.peak_bytes),
        "plan_total_bytes": int(memory_plan.total_bytes),
        "largest_at_peak": [r.name for r in table.top(3)],
        "fit_seconds": round(fit_seconds, 2),
        "fresh_process": fresh,
    }


def _child(args):
    """The rows `args.rows` names, in this process: prints one JSON line per row."""
    rows = json.loads(args.rows)
    shape = json.loads(args.shape)
    print("DMC_HEADER " + json.dumps(_header(shape, fresh=len(rows) == 1)), flush=True)
    for config, batch in rows:
        row = _row(config, batch, shape, fresh=len(rows) == 1)
        print("DMC_ROW " + json.dumps(row), flush=True)


def _header(shape, fresh):
    import jax
    import keras

    import keras_tpu_mem

    device = jax.devices()[0]
    try:
        has_stats = bool(device.memory_stats())
    except Exception:  # some platforms raise instead of returning None
        has_stats = False
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_figure": (
            "n/a: all rows ran in one process, whose peaks mix (--quick / --one-process)"
            if not fresh else "memory_stats()['peak_bytes_in_use']" if has_stats else
            "host: rise of the process's peak RSS over the fit (memory_stats() is None; "
            "includes compilation), not device memory"),
        "jax": jax.__version__,
        "keras": keras.__version__,
        "keras_tpu_mem": getattr(keras_tpu_mem, "__version__", "unknown"),
        "python": sys.version.split()[0],
        "model": shape,
        "fresh_process_per_row": fresh,
    }


def _mib(n):
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def _markdown(result):
    h = result["header"]
    device_col = ("device peak (MiB)" if h["device_figure"].startswith("memory_stats")
                  else "host RSS rise (MiB, not device)" if h["device_figure"].startswith("host")
                  else "measured (MiB)")
    m = h["model"]
    lines = [
        f"Device memory check, {h['date']}: {h['device_kind']} ({h['platform']}), "
        f"jax {h['jax']}, keras {h['keras']}, keras_tpu_mem {h['keras_tpu_mem']}.",
        f"Encoder: sequence {m['seq']}, width {m['dim']}, {m['heads']} heads, "
        f"feed-forward {m['ffn']}, vocabulary {m['vocab']}, Adam; one fit step per row, "
        + ("each in a fresh process." if h["fresh_process_per_row"] else
           "all in one process."),
        f"Device column: {h['device_figure']}.",
        "",
        f"| config | batch | {device_col} | compiled total (MiB) | by_layer peak (MiB) "
        "| plan total (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        measured = (r["device_peak_bytes"] if device_col.startswith("device")
                    else r["host_max_rss_rise_bytes"])
        lines.append(f"| {r['config']} | {r['batch']} | {_mib(measured)} | "
                     f"{_mib(r['compiled_total_bytes'])} | {_mib(r['by_layer_peak_bytes'])} | "
                     f"{_mib(r['plan_total_bytes'])} |")
    return "\n".join(lines) + "\n"


def _run(rows, shape, timeout):
    """The table rows for `rows` ([config, batch] pairs), computed in one new process."""
    env = dict(os.environ, KERAS_BACKEND="jax", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rows", json.dumps(rows),
           "--shape", json.dumps(shape)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.splitlines()
    header = [json.loads(x[len("DMC_HEADER "):]) for x in lines if x.startswith("DMC_HEADER ")]
    out = [json.loads(x[len("DMC_ROW "):]) for x in lines if x.startswith("DMC_ROW ")]
    if done.returncode or len(out) != len(rows) or not header:
        raise RuntimeError(f"{rows} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return header[0], out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a tiny encoder at one batch size, all rows in one process: "
                             "a CPU smoke test (< 60 s)")
    parser.add_argument("--out", default="device_memory_check",
                        help="folder for device_memory_check.json and .md")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds allowed to one configuration's process")
    parser.add_argument("--one-process", action="store_true",
                        help="all rows in one process (the default with --quick): faster, but "
                             "no per-row device or RSS peak")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose among {', '.join(CONFIGS)}")
    spec = dict(QUICK if args.quick else FULL)
    batches = spec.pop("batches")
    pairs = [[config, batch] for batch in batches for config in configs]
    # The parent never imports JAX: on a GPU that would take the device's memory
    # away from the processes that measure it.
    groups = [pairs] if (args.quick or args.one_process) else [[p] for p in pairs]
    result = {"header": None, "rows": []}
    start = time.perf_counter()
    for group in groups:
        header, rows = _run(group, spec, args.timeout)
        result["header"] = result["header"] or header
        result["rows"].extend(rows)
        for row in rows:
            print(f"{row['config']:>15} batch {row['batch']:>4}: device "
                  f"{_mib(row['device_peak_bytes'])} MiB, compiled "
                  f"{_mib(row['compiled_total_bytes'])} MiB, by_layer peak "
                  f"{_mib(row['by_layer_peak_bytes'])} MiB, plan "
                  f"{_mib(row['plan_total_bytes'])} MiB", flush=True)
    result["header"]["seconds"] = round(time.perf_counter() - start, 1)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "device_memory_check.json"), "w") as f:
        json.dump(result, f, indent=2)
    markdown = _markdown(result)
    with open(os.path.join(args.out, "device_memory_check.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
