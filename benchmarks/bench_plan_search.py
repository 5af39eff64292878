"""`plan(search=True)`'s wall time: XLA compiling one candidate while the next is traced.

The search of issue 28's floor: the encoder of `bench_sharding.py` (2 blocks of
multi-head attention and a Dense(1024, gelu) feed-forward, width 256, sequence 64,
Adam) under `keras.distribution.DataParallel` over 8 host CPU devices, global batch
64, a budget of 0.45x its compiled step's total, no headroom, `by_layer=False`.
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

XLA:CPU compiles here; on a TPU target each compile is XLA:TPU's (30 s to minutes
for a large model), which this script does not time.

Run:  python benchmarks/bench_plan_search.py [--rounds 3] [--out results.json]
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
GLOBAL_BATCH = 64
BUDGET_FRACTION = 0.45


def one(way: str) -> dict:
    """One search in this process (`way` in `WAYS`)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_sharding

    bench_sharding._setup(8)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import keras

    import keras_tpu_mem as ktm
    from keras_tpu_mem.planning.budget import DeviceBudget
    from keras_tpu_mem.planning.compiled import Compiler

    if way == "serial":
        Compiler.prepare = lambda self, per_replica, features=(): None
    active = keras.distribution.DataParallel(devices=jax.devices()[:8])
    with active.scope():
        model = bench_sharding._build("encoder")
        plain = ktm.compiled_memory(model, GLOBAL_BATCH, hlo_text=False)
        budget = DeviceBudget("budget", int(BUDGET_FRACTION * plain.total_bytes), 8,
                              "bench_plan_search")
        start = time.perf_counter()
        planned = ktm.plan(model, GLOBAL_BATCH, device=budget, headroom=0.0, search=True,
                           by_layer=False)
        wall = time.perf_counter() - start
    rec = planned.recommendation
    return {"wall_s": wall, "compiled": planned.search.compiled,
            "budget_bytes": budget.capacity_bytes,
            "recommendation": None if rec is None else rec.describe(),
            "recommended_bytes": None if rec is None else rec.total_bytes}


def _run(way: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", way],
                         check=True, capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(rounds: int) -> dict:
    runs = {way: [] for way in WAYS}
    for r in range(rounds):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            runs[way].append(_run(way))
    first = runs[WAYS[0]][0]
    same = all(run["recommendation"] == first["recommendation"]
               and run["recommended_bytes"] == first["recommended_bytes"]
               for way in WAYS for run in runs[way])
    if not same:
        raise SystemExit(f"the searches disagree: {runs}")
    walls = {way: [run["wall_s"] for run in runs[way]] for way in WAYS}
    return {"rounds": rounds, "recommendation": first["recommendation"],
            "recommended_bytes": first["recommended_bytes"],
            "budget_bytes": first["budget_bytes"],
            "compiled": {way: runs[way][0]["compiled"] for way in WAYS},
            "median_wall_s": {way: statistics.median(walls[way]) for way in WAYS},
            "walls_s": walls,
            "ratio": statistics.median(o / s for o, s in zip(walls["overlapped"],
                                                               walls["serial"]))}


def markdown(results: dict) -> str:
    mib = 2 ** 20
    lines = [f"budget {results['budget_bytes'] / mib:.2f} MiB; recommendation "
             f"{results['recommendation']} ({results['recommended_bytes'] / mib:.2f} MiB); "
             f"medians of {results['rounds']} interleaved rounds", "",
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
    parser.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one)))
        return 0
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    results = measure(args.rounds)
    print(markdown(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
