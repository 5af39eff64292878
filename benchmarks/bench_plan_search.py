"""`plan(search=True)`'s wall time: XLA compiling one candidate while the next is traced.

Two searches (`--case`):

* `encoder`  issue 28's floor: the encoder of `bench_sharding.py` (2 blocks of
             multi-head attention and a Dense(1024, gelu) feed-forward, width 256,
             sequence 64, Adam) under `keras.distribution.DataParallel` over 8 host CPU
             devices, global batch 64, a budget of 0.45x its compiled step's total, no
             headroom, `by_layer=False`: XLA:CPU compiles;
* `mlp7b`    the 6.71B MLP of `tpu_plans.py` (100 x Dense(8192), Adam, global batch
             256) built in `ktm.shapes_only()` and searched on `"v5e-16"` at the default
             10% headroom, `by_layer=False`: every candidate is XLA:TPU's compile
             (libtpu, `pip install "keras-tpu-mem[tpu-plan]"`).

Two ways, side by side:

* `overlapped`  what `plan` does: while XLA compiles a candidate on another thread,
                the search traces and lowers the candidate it would compile next were
                this one not to fit (`Compiler.prepare`);
* `serial`      the same search with nothing prepared ahead (`Compiler.prepare` made
                a no-op here): each candidate traced, lowered, then compiled.

Each run is a fresh process (no compile cached; the model built, its plain step
compiled for the budget, then the search timed alone); the two take turns for
`--rounds` rounds, the first of each round alternating. Reported: the median wall
of each, the median of the per-round ratios, the candidates compiled and the
recommendation (which must be the same: the guess decides nothing).

Run:  python benchmarks/bench_plan_search.py [--case encoder] [--rounds 3]
                                             [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WAYS = ("overlapped", "serial")
CASES = ("encoder", "mlp7b")
GLOBAL_BATCH = 64
BUDGET_FRACTION = 0.45


def _encoder_search(ktm, keras, jax, bench_sharding):
    from keras_tpu_mem.planning.budget import DeviceBudget

    active = keras.distribution.DataParallel(devices=jax.devices()[:8])
    with active.scope():
        model = bench_sharding._build("encoder")
        plain = ktm.compiled_memory(model, GLOBAL_BATCH, hlo_text=False)
        budget = DeviceBudget("budget", int(BUDGET_FRACTION * plain.total_bytes), 8,
                              "bench_plan_search")
        start = time.perf_counter()
        planned = ktm.plan(model, GLOBAL_BATCH, device=budget, headroom=0.0, search=True,
                           by_layer=False)
        return planned, time.perf_counter() - start


def _mlp7b_search(ktm, keras):
    with ktm.shapes_only():
        model = keras.Sequential(
            [keras.Input((8192,))]
            + [keras.layers.Dense(8192, activation="relu") for _ in range(100)]
            + [keras.layers.Dense(16)])
        model.compile(optimizer=keras.optimizers.Adam(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    planned = ktm.plan(model, 256, device="v5e-16", search=True, by_layer=False)
    return planned, time.perf_counter() - start


def one(way: str, case: str) -> dict:
    """One search in this process (`way` in `WAYS`, `case` in `CASES`)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_sharding

    bench_sharding._setup(8)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import keras

    import keras_tpu_mem as ktm
    from keras_tpu_mem.planning.compiled import Compiler

    if way == "serial":
        Compiler.prepare = lambda self, per_replica, features=(): None
    if case == "encoder":
        planned, wall = _encoder_search(ktm, keras, jax, bench_sharding)
    else:
        planned, wall = _mlp7b_search(ktm, keras)
    rec = planned.recommendation
    return {"wall_s": wall, "compiled": planned.search.compiled,
            "budget_bytes": planned.usable_bytes, "compiler": planned.compiler,
            "recommendation": None if rec is None else rec.describe(),
            "recommended_bytes": None if rec is None else rec.total_bytes}


def _run(way: str, case: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", way,
                          "--case", case],
                         check=True, capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(rounds: int, case: str) -> dict:
    runs = {way: [] for way in WAYS}
    for r in range(rounds):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            runs[way].append(_run(way, case))
    first = runs[WAYS[0]][0]
    same = all(run["recommendation"] == first["recommendation"]
               and run["recommended_bytes"] == first["recommended_bytes"]
               for way in WAYS for run in runs[way])
    if not same:
        raise SystemExit(f"the searches disagree: {runs}")
    walls = {way: [run["wall_s"] for run in runs[way]] for way in WAYS}
    return {"case": case, "compiler": first["compiler"], "rounds": rounds,
            "recommendation": first["recommendation"],
            "recommended_bytes": first["recommended_bytes"],
            "budget_bytes": first["budget_bytes"],
            "compiled": {way: runs[way][0]["compiled"] for way in WAYS},
            "median_wall_s": {way: statistics.median(walls[way]) for way in WAYS},
            "walls_s": walls,
            "ratio": statistics.median(o / s for o, s in zip(walls["overlapped"],
                                                               walls["serial"]))}


def markdown(results: dict) -> str:
    mib = 2 ** 20
    rec = results["recommendation"]
    rec = "none fits" if rec is None else f"{rec} ({results['recommended_bytes'] / mib:.2f} MiB)"
    lines = [f"{results['case']}: {results['compiler']}; budget "
             f"{results['budget_bytes'] / mib:.2f} MiB; recommendation {rec}; medians of "
             f"{results['rounds']} interleaved rounds", "",
             "| search | candidates compiled | wall (median) | × serial |",
             "|---|---|---|---|"]
    for way in WAYS:
        ratio = results["ratio"] if way == "overlapped" else 1.0
        lines.append(f"| {way} | {results['compiled'][way]} "
                     f"| {results['median_wall_s'][way]:.1f} s | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--case", choices=CASES, default="encoder")
    parser.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args.case)))
        return 0
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    results = measure(args.rounds, args.case)
    print(markdown(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
