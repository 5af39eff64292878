"""XLA:TPU's verdict next to XLA:CPU's, for TPU slices this machine does not have.

Every model is built with `ktm.shapes_only()` (no weight allocated) and planned through
`ktm.compiled_memory` / `ktm.plan` with `device=` a Cloud TPU slice, compiled ahead of
time by XLA:TPU through libtpu (`pip install "keras-tpu-mem[tpu-plan]"`); nothing runs.
Parts (`--parts`, default all):

* `mlp`      the 0.54B MLP (8 x Dense(8192), Adam, global batch 256) planned on v5e-8;
* `mlp7b`    the 6.71B MLP (100 x Dense(8192)) searched on v5e-16 (run it in a process of
             its own for its host-RSS figure);
* `bert`     the README's BERT shapes (Base: 12 layers, width 768; Large: 24 layers,
             width 1024; masked-LM head, Adam, float32) at sequence 128 and 512 on
             v3-8 and v5e-8: XLA:CPU's total at the per-chip batch (one host device)
             and XLA:TPU's per-chip total at the same batch, their ratio, the largest
             power-of-two per-chip batch XLA:TPU fits (from a guess, doubling or halving
             on XLA:TPU's verdicts: `_largest_per_chip`), compile seconds;
* `decoder`  a 7B decoder in plain Keras with Gemma 7B's dimensions (28 blocks, width
             3072, 16 heads of 256, gated feed-forward 24576, vocabulary 256000,
             untied output: about 9.3B parameters), sequence 512, global batch 8
             (one per chip on a larger slice), on v5e-8, v5e-16 and v6e-8, under
             `ShardedDataParallel()` (weights and slots split over the chips): full
             fine-tuning with Adam in float32, and LoRA rank 8 on a bfloat16 backbone,
             each with the largest power-of-two per-chip batch XLA:TPU compiles (as
             for `bert`, from the plan at one sequence per chip);
* `sharded`  the engine's `shard_map` step against Keras' own step on the same
             `ShardedDataParallel` layouts left to XLA:TPU's SPMD partitioner: per-chip
             totals and the collectives each optimized HLO holds;
* `accumulation`  `GradientAccumulation(4)` under `ShardedDataParallel()` as `fit` runs
             it on a TPU mesh, against the engine's `shard_map` loop and Keras' step
             without accumulation (MLPs of 0.13B to 6.71B parameters).

Every XLA:TPU compile reserves the headroom (`--headroom`, 10% as `plan`'s) of each
chip's HBM: XLA:TPU schedules a step to the memory it is given.
Host RSS is read before and after each part (peak resident memory of the process).
What XLA:TPU's compile confirms: the program and its memory on that TPU (layouts,
fusion, buffer assignment, the HBM it counts available). What it does not: speed, a
run, the interconnect.

Run:  python benchmarks/tpu_plans.py [--parts bert,decoder,sharded] [--quick]
                                     [--slices v3-8,v5e-8] [--bert large-512]
                                     [--no-largest] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
import types

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("NPROC", "16")
# A machine without a TPU: JAX runs on the host CPU; libtpu only compiles.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def _rss_gib() -> float:
    """The process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _current_rss_gib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def _gib(n) -> str:
    return "—" if n is None else f"{n / 2**30:.2f}"


def decoder(blocks=28, width=3072, heads=16, head_dim=256, ffn=24576, vocab=256000,
            seq=512, lora_rank=None, dtype=None):
    """A Gemma-7B-shaped decoder in plain Keras layers (causal attention, RMS norms, a
    gated feed-forward, untied output), compiled with Adam."""
    import keras

    policy = keras.config.dtype_policy()
    if dtype is not None:
        keras.config.set_dtype_policy(dtype)
    try:
        tokens = keras.Input((seq,), dtype="int32")
        x = keras.layers.Embedding(vocab, width, name="embed")(tokens)
        for i in range(blocks):
            h = keras.layers.LayerNormalization(rms_scaling=True, name=f"b{i}_norm1")(x)
            h = keras.layers.MultiHeadAttention(heads, head_dim, name=f"b{i}_attention")(
                h, h, use_causal_mask=True)
            x = x + h
            h = keras.layers.LayerNormalization(rms_scaling=True, name=f"b{i}_norm2")(x)
            gate = keras.layers.Dense(ffn, activation="gelu", name=f"b{i}_gate")(h)
            up = keras.layers.Dense(ffn, name=f"b{i}_up")(h)
            x = x + keras.layers.Dense(width, name=f"b{i}_down")(gate * up)
        x = keras.layers.LayerNormalization(rms_scaling=True, name="final_norm")(x)
        logits = keras.layers.Dense(vocab, name="logits", dtype="float32")(x)
        model = keras.Model(tokens, logits)
    finally:
        keras.config.set_dtype_policy(policy)
    if lora_rank:
        for layer in model._flatten_layers(include_self=False):
            if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)) \
                    and layer.name != "logits":
                layer.enable_lora(lora_rank)
        model.get_layer("embed").trainable = False
        model.get_layer("logits").trainable = False
        for layer in model.layers:
            if isinstance(layer, keras.layers.LayerNormalization):
                layer.trainable = False
    model.compile(optimizer=keras.optimizers.Adam(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _bert(size: str, seq: int):
    from bert_memory import build_model

    if size == "base":
        return build_model(layers=12, hidden=768, heads=12, intermediate=3072, seq_len=seq,
                           max_predictions=max(20, seq * 15 // 100))
    return build_model(layers=24, hidden=1024, heads=16, intermediate=4096, seq_len=seq,
                       max_predictions=max(20, seq * 15 // 100))


def _timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


#: The per-chip batch XLA:CPU and XLA:TPU compile side by side.
PER_CHIP = 8
#: `--slices`: the slices the bert and decoder parts plan on (empty: each part's own).
SLICES: tuple = ()
#: The headroom reserved in every XLA:TPU compile (`--headroom`): the plans', and the
#: bert and decoder parts' `compiled_memory(headroom=)`.
HEADROOM = 0.10
#: `--bert`: the (size, sequence) shapes the bert part compiles (empty: the part's own).
BERT_SHAPES: tuple = ()
#: `--no-largest`: the bert and decoder parts skip the search for the largest per-chip
#: batch.
LARGEST = True


def _largest_per_chip(model, name: str, devices: int, at_per_chip,
                      per_chip: int = PER_CHIP) -> tuple:
    """`(the largest power-of-two per-chip batch XLA:TPU compiles for slice `name`,
    the compiles it took)`.

    The first batch tried is a guess from the compile at `per_chip` (`at_per_chip`:
    `state_bytes`, `total_bytes`, `fits_reserve`), its bytes beyond the state taken as linear
    in the batch, against the chip's HBM per
    device (`ktm.tpu_slice`); then the batch doubles while it fits, or halves while it
    does not. Only XLA:TPU's compiles decide (the guess saves compiles, each minutes for
    a transformer): a batch fits where XLA:TPU compiles it within what the headroom
    leaves (`CompiledMemory.fits_reserve`: XLA:TPU compiles a step over its reserve
    without refusing it while it fits the whole chip). None where even one example
    does not fit; the last power of two up to 4096.
    """
    import keras_tpu_mem as ktm

    tpu = ktm.tpu_slice(name)
    hbm = tpu.spec.hbm_bytes_per_chip * tpu.chips / tpu.devices * (1 - HEADROOM)
    state = at_per_chip.state_bytes
    per_sample = max(1.0, (at_per_chip.total_bytes - state) / per_chip)
    guess = max(1, int((hbm - state) // per_sample))
    batch = 1 << (min(guess, 4096).bit_length() - 1)  # a power of two at or below it
    compiles = 0

    def fits(b: int) -> bool:
        nonlocal compiles
        if b == per_chip:
            return at_per_chip.fits_reserve
        compiles += 1
        return ktm.compiled_memory(model, b * devices, device=name, hlo_text=False,
                                   headroom=HEADROOM).fits_reserve

    if fits(batch):
        while batch < 4096 and fits(batch * 2):
            batch *= 2
        return batch, compiles
    while batch > 1:
        batch //= 2
        if fits(batch):
            return batch, compiles
    return None, compiles


def part_bert(quick: bool) -> list[dict]:
    import keras_tpu_mem as ktm

    rows = []
    sizes = ("base",) if quick else ("base", "large")
    seqs = (128,) if quick else (128, 512)
    shapes = BERT_SHAPES or tuple((size, seq) for size in sizes for seq in seqs)
    slices = SLICES or (("v5e-8",) if quick else ("v3-8", "v5e-8"))
    for size, seq in shapes:
        with ktm.shapes_only():
            model = _bert(size, seq)
        per_chip, devices = PER_CHIP, 8  # v3-8 and v5e-8 both show 8 devices
        host, host_s = _timed(lambda m=model: ktm.compiled_memory(
            m, PER_CHIP, hlo_text=False))
        for name in slices:
            tpu, tpu_s = _timed(lambda m=model, n=name: ktm.compiled_memory(
                m, PER_CHIP * 8, device=n, hlo_text=False, headroom=HEADROOM))
            largest, largest_compiles = None, 0
            if LARGEST and not quick:
                largest, largest_compiles = _largest_per_chip(model, name, devices, tpu)
            rows.append(dict(
                part="bert", model=f"BERT-{size}", seq=seq, slice=name,
                per_chip_batch=per_chip, cpu_total=host.total_bytes,
                tpu_total=tpu.total_bytes, ratio=tpu.total_bytes / host.total_bytes,
                largest_per_chip=largest, largest_compiles=largest_compiles,
                cpu_compile_s=host_s, tpu_compile_s=tpu_s,
                compiler=tpu.compiler, rss_gib=_rss_gib()))
            print(rows[-1], flush=True)
    return rows


def part_decoder(quick: bool) -> list[dict]:
    import keras_tpu_mem as ktm
    from keras_tpu_mem.sharding import ShardedDataParallel

    rows = []
    blocks = 2 if quick else 28
    slices = SLICES or (("v5e-8",) if quick else ("v5e-8", "v5e-16", "v6e-8"))
    for mode in ("full, Adam float32", "LoRA 8, bfloat16 backbone"):
        lora = mode.startswith("LoRA")
        for name in slices:
            import jax

            devices = jax.devices()[:8]
            # Both under ShardedDataParallel(): a 9B backbone does not fit one chip
            # replicated even in bfloat16 (18.7 GB), so LoRA shards it too.
            distribution = ShardedDataParallel(devices=devices)
            started = time.perf_counter()
            with distribution.scope(), ktm.shapes_only():
                model = (decoder(blocks=blocks, lora_rank=8, dtype="bfloat16") if lora
                         else decoder(blocks=blocks))
            # Sequences of 512: 8 over the slice, or one per chip where it has more chips.
            batch = max(8, ktm.tpu_slice(name).devices)
            with distribution.scope():
                planned = ktm.plan(model, batch, device=name, by_layer=False)
                seconds = time.perf_counter() - started
                largest, largest_compiles = None, 0
                if LARGEST and not quick:
                    # The guess's state: the weights and slots the plan counts per chip.
                    at = types.SimpleNamespace(
                        state_bytes=planned.weight_bytes + planned.optimizer_bytes,
                        total_bytes=planned.total_bytes, fits_reserve=planned.fits)
                    chips = ktm.tpu_slice(name).devices
                    largest, largest_compiles = _largest_per_chip(
                        model, name, chips, at, per_chip=batch // chips)
            params = sum(int(__import__("math").prod(v.shape)) for v in model.weights)
            rows.append(dict(
                part="decoder", mode=mode, slice=name, params=params, batch=batch,
                total=planned.total_bytes, capacity=planned.capacity_bytes,
                fits=planned.fits, refused=planned.refused, seconds=seconds,
                largest_per_chip=largest, largest_compiles=largest_compiles,
                compiler=planned.compiler, rss_gib=_rss_gib()))
            print(rows[-1], flush=True)
    return rows


_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                "collective-permute")


def _collectives(hlo: str) -> dict:
    return {op: len(re.findall(rf"= [^=]*\b{op}(?:-start)?\(", hlo)) for op in _COLLECTIVES}


def part_sharded(quick: bool) -> list[dict]:
    """The engine's shard_map step (what `fit` runs under ShardedDataParallel) against
    Keras' own train step on the same layouts, partitioned by XLA:TPU's SPMD pass."""
    import jax

    from keras_tpu_mem.sharding import ShardedDataParallel

    rows = []
    width, depth = (1024, 4) if quick else (4096, 8)
    for name in ("v5e-8",):
        distribution = ShardedDataParallel(devices=jax.devices()[:8])
        model = _relu_mlp(width, depth, distribution)
        from keras_tpu_mem.planning.compiled import step_memory

        with distribution.scope():
            engine = step_memory(model, 256, step="engine", device=name)
            keras_step = step_memory(model, 256, step="keras", device=name)
        for label, memory in (("engine shard_map step", engine),
                              ("Keras step, XLA:TPU SPMD", keras_step)):
            rows.append(dict(part="sharded", slice=name, step=label,
                             total=memory.total_bytes, temp=memory.temp_bytes,
                             collectives=_collectives(memory.hlo_text),
                             compiler=memory.compiler))
            print(rows[-1], flush=True)
    return rows


def _relu_mlp(width: int, depth: int, distribution=None):
    """`depth` x Dense(`width`, relu) -> Dense(16), Adam, sparse cross-entropy on logits,
    built shapes-only (no weight allocated), in `distribution`'s scope where given."""
    import contextlib

    import keras

    import keras_tpu_mem as ktm

    with (distribution.scope() if distribution is not None else contextlib.nullcontext()), \
            ktm.shapes_only():
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
            + [keras.layers.Dense(16)])
        model.compile(optimizer=keras.optimizers.Adam(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def part_mlp(quick: bool, big: bool = False) -> list[dict]:
    """The issue's MLPs: 0.54B (8 x Dense(8192), Adam, global batch 256) planned on v5e-8
    (`mlp`), and 6.71B (100 x Dense(8192)) searched on v5e-16 (`mlp7b`: sharding,
    accumulation, bf16, remat, each candidate compiled by XLA:TPU), both built shapes-only.
    Host RSS growth: the process's peak at the end less its resident memory after Keras
    and JAX were imported (libtpu's load and every compile included); run each part in
    its own process for its own peak."""

    import keras_tpu_mem as ktm

    rows = []
    cases = ([("6.71B MLP", 4 if quick else 100, "v5e-16", True)] if big
             else [("0.54B MLP", 8, "v5e-8", False)])
    for label, depth, name, search in cases:
        rss_before = _current_rss_gib()
        started = time.perf_counter()
        model = _relu_mlp(8192, depth)
        planned = ktm.plan(model, 256, device=name, search=search, by_layer=False,
                           headroom=HEADROOM)
        seconds = time.perf_counter() - started
        rec = planned.recommendation
        check = None
        if search and rec is not None:
            # The recommendation compiled once more, as fit would run it on the slice.
            with rec.compiled_under.scope():
                check = ktm.compiled_memory(model, 256, device=name, hlo_text=False,
                                            callbacks=rec.callbacks())
        rows.append(dict(
            part="mlp", model=label, slice=name, search=search,
            params=sum(int(__import__("math").prod(v.shape)) for v in model.weights),
            total=planned.total_bytes, capacity=planned.capacity_bytes, fits=planned.fits,
            recommendation=None if rec is None else rec.describe(),
            recommended_total=None if rec is None else rec.total_bytes,
            check_total=None if check is None else check.total_bytes,
            candidates=len(planned.candidates), seconds=seconds, headroom=HEADROOM,
            tried=[(c.describe(), c.total_bytes) for c in planned.candidates],
            rss_growth_gib=_rss_gib() - rss_before, compiler=planned.compiler))
        print(rows[-1], flush=True)
    return rows


def part_accumulation(quick: bool) -> list[dict]:
    """`GradientAccumulation(4)` under `ShardedDataParallel()` (global batch 256, MLPs built
    shapes-only, compiled against the whole chip): the micro-batch loop as `fit` runs it
    on a TPU mesh (on the global arrays, each micro-batch over every chip, left to
    XLA:TPU's partitioner), the engine's `shard_map` loop (`reducers.in_shard_map()`:
    every weight gathered whole for the step), and Keras' own step without
    accumulation; below the 6.71B MLP also the applying step of pulled micro-batches of
    64 (`dataset_yields="micro_batches"`) both ways. A step XLA:TPU refuses is shown
    with the bytes its refusal names."""
    import contextlib

    import jax

    import keras_tpu_mem as ktm
    from keras_tpu_mem.backends.jax import reducers
    from keras_tpu_mem.sharding import ShardedDataParallel

    cases = ([(1024, 4, "v5e-8")] if quick else
             [(4096, 8, "v5e-8"), (8192, 8, "v5e-8"), (8192, 32, "v5e-8"),
              (8192, 100, "v5e-16")])
    rows = []
    for width, depth, name in cases:
        distribution = ShardedDataParallel(devices=jax.devices()[:8])
        row = dict(part="accumulation", width=width, depth=depth, slice=name)
        for step in ("partitioned", "shard_map", "keras"):
            # A model each: the compile cache keys on the step and layouts, not the loop.
            model = _relu_mlp(width, depth, distribution)
            callbacks = [] if step == "keras" else [ktm.GradientAccumulation(4)]
            started = time.perf_counter()
            with distribution.scope(), (reducers.in_shard_map() if step == "shard_map"
                                        else contextlib.nullcontext()):
                memory = ktm.compiled_memory(model, 256, device=name, hlo_text=False,
                                             callbacks=callbacks)
            row[step] = dict(total=memory.total_bytes, temp=memory.temp_bytes,
                             laid_out=memory.laid_out_bytes, refused=memory.refused,
                             seconds=time.perf_counter() - started)
            if step != "keras" and depth < 100:
                # Pulled micro-batches of 64 (Keras' convention): the applying step.
                pulled = [ktm.GradientAccumulation(4, dataset_yields="micro_batches")]
                with distribution.scope(), (reducers.in_shard_map() if step == "shard_map"
                                            else contextlib.nullcontext()):
                    row[step]["pulled"] = ktm.compiled_memory(
                        model, 64, device=name, hlo_text=False, callbacks=pulled).total_bytes
        row["params"] = sum(int(__import__("math").prod(v.shape)) for v in model.weights)
        row["compiler"] = memory.compiler
        rows.append(row)
        print(row, flush=True)
    return rows


PARTS = {"mlp": part_mlp, "mlp7b": lambda quick: part_mlp(quick, big=True),
         "bert": part_bert, "decoder": part_decoder, "sharded": part_sharded,
         "accumulation": part_accumulation}


def markdown(rows: list[dict]) -> str:
    out = []
    bert = [r for r in rows if r["part"] == "bert"]
    if bert:
        out += ["| model | seq | slice | per-chip batch | XLA:CPU total | XLA:TPU total | "
                "TPU/CPU | largest per-chip batch (XLA:TPU) | compile CPU / TPU (s) |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in bert:
            out.append(f"| {r['model']} | {r['seq']} | {r['slice']} | {r['per_chip_batch']} | "
                       f"{_gib(r['cpu_total'])} GiB | {_gib(r['tpu_total'])} GiB | "
                       f"{r['ratio']:.2f} | {r['largest_per_chip']} | "
                       f"{r['cpu_compile_s']:.0f} / {r['tpu_compile_s']:.0f} |")
        out.append("")
    dec = [r for r in rows if r["part"] == "decoder"]
    if dec:
        out += ["| 7B decoder | slice | parameters | per-chip total (XLA:TPU) | HBM | "
                "verdict | largest per chip (compiles) | plan (s) | host RSS peak |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in dec:
            verdict = "fits" if r["fits"] else ("refused: " + r["refused"][:90]
                                                if r["refused"] else "does not fit")
            largest = ("—" if r.get("largest_per_chip") is None and not r.get("largest_compiles")
                       else f"{r['largest_per_chip']} ({r['largest_compiles']})")
            out.append(f"| {r['mode']} | {r['slice']} | {r['params'] / 1e9:.2f} B | "
                       f"{_gib(r['total'])} GiB | {_gib(r['capacity'])} GiB | {verdict} | "
                       f"{largest} | {r['seconds']:.0f} | {r['rss_gib']:.2f} GiB |")
        out.append("")
    mlp = [r for r in rows if r["part"] == "mlp"]
    if mlp:
        out += ["| MLP (shapes-only) | slice | parameters | plan (headroom) | "
                "per-chip total (XLA:TPU) | recommendation (compiled total) | plan (s) | "
                "host RSS growth |", "|---|---|---|---|---|---|---|---|"]
        for r in mlp:
            rec = "—" if r["recommendation"] is None else (
                f"{r['recommendation']} ({_gib(r['recommended_total'])} GiB; compiled again: "
                f"{_gib(r['check_total'])} GiB)")
            out.append(f"| {r['model']} | {r['slice']} | {r['params'] / 1e9:.2f} B | "
                       f"{'search' if r['search'] else 'as built'} ({r['headroom']:.0%}) | "
                       f"{_gib(r['total'])} GiB "
                       f"of {_gib(r['capacity'])} | {rec} | {r['seconds']:.0f} | "
                       f"{r['rss_growth_gib']:.2f} GiB |")
        out.append("")
    accumulation = [r for r in rows if r["part"] == "accumulation"]
    if accumulation:
        out += ["| MLP (ShardedDataParallel, batch 256) | slice | whole weights | "
                "GradientAccumulation(4), as fit runs it | the same in the engine's shard_map "
                "loop | Keras' step, no accumulation |", "|---|---|---|---|---|---|"]

        def cell(r, step):
            m = r[step]
            if m["refused"]:
                return f"{_gib(m['total'])} GiB: refused by XLA:TPU"
            return f"{_gib(m['total'])} GiB (laid out {_gib(m['laid_out'])})"

        for r in accumulation:
            out.append(f"| {r['depth']} x Dense({r['width']}), {r['params'] / 1e9:.2f}B | "
                       f"{r['slice']} | {_gib(4 * r['params'])} GiB | "
                       f"{cell(r, 'partitioned')} | {cell(r, 'shard_map')} | "
                       f"{cell(r, 'keras')} |")
        out += ["", "| MLP | slice | pulled micro-batch of 64, applying step: as fit runs it "
                "| in the engine's shard_map step |", "|---|---|---|---|"]
        for r in accumulation:
            if "pulled" in r["partitioned"]:
                out.append(f"| {r['depth']} x Dense({r['width']}) | {r['slice']} | "
                           f"{_gib(r['partitioned']['pulled'])} GiB | "
                           f"{_gib(r['shard_map']['pulled'])} GiB |")
        out.append("")
    sharded = [r for r in rows if r["part"] == "sharded"]
    if sharded:
        out += ["| step (ShardedDataParallel) | slice | per-chip total | temporaries | "
                "collectives in the HLO |", "|---|---|---|---|---|"]
        for r in sharded:
            coll = ", ".join(f"{k} {v}" for k, v in r["collectives"].items() if v)
            out.append(f"| {r['step']} | {r['slice']} | {_gib(r['total'])} GiB | "
                       f"{_gib(r['temp'])} GiB | {coll} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="mlp,bert,decoder,sharded",
                        help="comma-separated: mlp, mlp7b, bert, decoder, sharded, "
                             "accumulation")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes (a smoke run, not the docs' table)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--headroom", type=float, default=0.10,
                        help="the headroom reserved in every XLA:TPU compile (default 0.10, "
                             "plan's own)")
    parser.add_argument("--slices", default="",
                        help="comma-separated slices for the bert and decoder parts")
    parser.add_argument("--bert", default="",
                        help="comma-separated BERT shapes for the bert part, SIZE-SEQUENCE "
                             "(base-128, base-512, large-128, large-512; default: all four)")
    parser.add_argument("--no-largest", action="store_true",
                        help="bert and decoder parts: skip the search for the largest "
                             "per-chip batch")
    args = parser.parse_args(argv)
    global SLICES, HEADROOM, BERT_SHAPES, LARGEST
    SLICES = tuple(x.strip() for x in args.slices.split(",") if x.strip())
    HEADROOM = args.headroom
    LARGEST = not args.no_largest
    shapes = []
    for item in (x.strip() for x in args.bert.split(",") if x.strip()):
        size, _, seq = item.partition("-")
        if size not in ("base", "large") or seq not in ("128", "512"):
            parser.error(f"--bert: {item!r} is not one of base-128, base-512, large-128, "
                         "large-512")
        shapes.append((size, int(seq)))
    BERT_SHAPES = tuple(shapes)
    rows = []
    for part in args.parts.split(","):
        rows += PARTS[part.strip()](args.quick)
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
