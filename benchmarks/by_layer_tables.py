"""The by-layer tables and figures of docs/planning.md ("Memory by layer").

Compiles one Adam train step (nothing runs) of the transformer encoder of
tests/planning_models.py or of the BERT shape of examples/bert_memory.py with XLA
on the host, prints `compiled_memory(...).by_layer()` and writes its figure
(`LayerTable.plot`) as a PNG:

    python benchmarks/by_layer_tables.py --model encoder --batch 64
    python benchmarks/by_layer_tables.py --model bert --layers 2 --batch 4
    python benchmarks/by_layer_tables.py --model bert --layers 2 --batch 4 --backend jax

Writes `<out>/by_layer_<model>[<layers>]_<backend>.png` and prints the table with the
compile's wall time. One device, no distribution: the bytes are one replica's.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("encoder", "bert"), default="encoder")
    parser.add_argument("--layers", type=int, default=2, help="BERT layers (default 2)")
    parser.add_argument("--batch", type=int, default=64, help="batch compiled (default 64)")
    parser.add_argument("--seq", type=int, default=None,
                        help="sequence length (default: encoder 64, BERT 512)")
    parser.add_argument("--backend", choices=("tensorflow", "jax"), default=None)
    parser.add_argument("--top", type=int, default=12, help="bars in the figure")
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"))
    return parser.parse_args(argv)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    args = _args(argv)
    if args.backend:
        os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # LLVM's optimisation level changes the machine code, not XLA's buffer
    # assignment; level 0 halves the host's compile time (as examples/bert_memory.py).
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
    import keras

    from keras_tpu_mem.planning import compiled_memory

    if args.model == "encoder":
        sys.path.insert(0, str(ROOT / "tests"))
        from planning_models import encoder

        model = encoder(seq=args.seq or 64)
        name = "encoder"
    else:
        bert = _load(ROOT / "examples" / "bert_memory.py", "bert_memory")
        keras.utils.set_random_seed(0)
        model = bert.build_model(layers=args.layers, seq_len=args.seq or 512)
        name = f"bert{args.layers}"
    backend = keras.backend.backend()
    started = time.perf_counter()
    result = compiled_memory(model, args.batch, hlo_text=False)
    compiled = time.perf_counter() - started
    table = result.by_layer()
    dumped = time.perf_counter() - started - compiled
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"by_layer_{name}_{backend}.png"
    title = (f"{name} ({backend}), batch {args.batch}: peak "
             f"{table.peak_bytes / 1024**2:.1f} MiB of {table.total_bytes / 1024**2:.1f} MiB "
             f"compiled; {min(args.top, len(table))} largest of {len(table)} rows")
    table.plot(path, top=args.top, title=title)
    print(f"# {name}, {backend}, batch {args.batch}, keras {keras.__version__}; compile "
          f"{compiled:.1f} s, by_layer {dumped:.1f} s; figure: {path.relative_to(ROOT)}")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
