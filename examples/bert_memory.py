"""Will BERT-Large fit? XLA's memory plan of its train step, per sample.

Google's BERT README says BERT-Large at sequence length 512 does not fit a
single example on a 12 GB GPU (with Adam), while the paper trained it at
batch 256 on 64 TPU chips. This script answers why with numbers: it builds a
BERT-Large-shaped encoder from plain Keras layers (24 layers, hidden 1024, 16
heads, intermediate 4096, sequence 512, a masked-LM head on 80 positions tied
to the token embedding; no download, random weights), compiles its Adam train
step with XLA on the host at per-replica batches 1 and 4 (nothing is trained),
and plans it in float32 and (estimated) mixed bfloat16 for batch 256 on TPU
slices and on one 12 GiB GPU.

    python examples/bert_memory.py                  # the full model (a few minutes)
    python examples/bert_memory.py --layers 2       # a quick run
    python examples/bert_memory.py --compile-bf16   # also compile a bf16 model
    python examples/bert_memory.py --backend jax --compile-bf16   # the same from JAX

On JAX (`--backend jax`) every column is a compile: `plan(..., callbacks=[])`
compiles Keras' train step and `plan(..., callbacks=[ktm.MixedBFloat16()])`
the engine's bf16 step of the float32 model, each at the requested
per-replica batch up to the largest of `--compile-batches` and extrapolated
per sample from two compiles below it beyond (the GPU's 256). There is no
paper estimate there, and no accumulation search (each candidate of it is two
more BERT compiles): `plan(..., search=True)` answers that for your model.

The plan is also available from the command line:

    keras-tpu-mem plan --model examples/bert_memory.py:build_model \\
        --global-batch 256 --device v3-64 --compile-batches 1,4
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time


def _backend_flag(argv):
    """`--backend NAME` / `--backend=NAME` from argv, or None (read before Keras is imported)."""
    for i, arg in enumerate(argv):
        if arg == "--backend" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--backend="):
            return arg.split("=", 1)[1]
    return None


if __name__ == "__main__" and _backend_flag(sys.argv[1:]) in ("tensorflow", "jax"):
    # Keras reads KERAS_BACKEND once, at import: the flag wins over the environment.
    os.environ["KERAS_BACKEND"] = _backend_flag(sys.argv[1:])
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# LLVM's optimisation level changes the generated machine code, not XLA's
# buffer assignment (checked: identical temp/argument/live-out bytes), and
# halves compile time on the host. Only set when the user has no XLA_FLAGS.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import keras  # noqa: E402

GIB = 1024**3


class PositionEmbedding(keras.layers.Layer):
    """Learned absolute positions, added to the token embeddings."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length, self.dim = length, dim

    def build(self, input_shape):
        self.positions = self.add_weight(shape=(self.length, self.dim), name="positions",
                                         initializer="glorot_uniform")

    def call(self, x):
        return x + keras.ops.cast(self.positions, x.dtype)[None, : keras.ops.shape(x)[1]]


class GatherPositions(keras.layers.Layer):
    """Picks the masked positions out of the sequence, as BERT's MLM head does."""

    def call(self, sequence, positions):
        index = keras.ops.expand_dims(keras.ops.cast(positions, "int32"), -1)
        return keras.ops.take_along_axis(sequence, index, axis=1)


class TiedLogits(keras.layers.Layer):
    """Vocabulary logits through the transposed token embedding, plus a bias."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self._embedding = [embedding]  # a reference, not a second copy of its weights

    def build(self, input_shape):
        vocab = self._embedding[0].input_dim
        self.bias = self.add_weight(shape=(vocab,), name="bias", initializer="zeros")

    def call(self, x):
        table = keras.ops.cast(self._embedding[0].embeddings, x.dtype)
        return keras.ops.matmul(x, keras.ops.transpose(table)) + keras.ops.cast(self.bias,
                                                                                x.dtype)


def build_model(layers=24, hidden=1024, heads=16, intermediate=4096, seq_len=512,
                vocab=30522, max_predictions=80, dropout=0.1, dtype_policy=None):
    """A BERT-Large-shaped masked-LM model, compiled with Adam (no weights loaded)."""
    if dtype_policy is not None:
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy(dtype_policy)
    try:
        token_ids = keras.Input((seq_len,), dtype="int32", name="token_ids")
        segment_ids = keras.Input((seq_len,), dtype="int32", name="segment_ids")
        masked_positions = keras.Input((max_predictions,), dtype="int32",
                                       name="masked_positions")
        token_embedding = keras.layers.Embedding(vocab, hidden, name="token_embedding")
        x = token_embedding(token_ids)
        x = x + keras.layers.Embedding(2, hidden, name="segment_embedding")(segment_ids)
        x = PositionEmbedding(seq_len, hidden, name="position_embedding")(x)
        x = keras.layers.LayerNormalization(epsilon=1e-12)(x)
        x = keras.layers.Dropout(dropout)(x)
        for i in range(layers):
            attention = keras.layers.MultiHeadAttention(
                heads, hidden // heads, dropout=dropout, name=f"layer{i}_attention")(x, x)
            attention = keras.layers.Dropout(dropout)(attention)
            x = keras.layers.LayerNormalization(epsilon=1e-12)(x + attention)
            ff = keras.layers.Dense(intermediate, activation="gelu", name=f"layer{i}_ff_in")(x)
            ff = keras.layers.Dense(hidden, name=f"layer{i}_ff_out")(ff)
            ff = keras.layers.Dropout(dropout)(ff)
            x = keras.layers.LayerNormalization(epsilon=1e-12)(x + ff)
        h = GatherPositions(name="gather_masked")(x, masked_positions)
        h = keras.layers.Dense(hidden, activation="gelu", name="mlm_transform")(h)
        h = keras.layers.LayerNormalization(epsilon=1e-12)(h)
        logits = TiedLogits(token_embedding, name="mlm_logits", dtype="float32")(h)
        model = keras.Model(
            {"token_ids": token_ids, "segment_ids": segment_ids,
             "masked_positions": masked_positions},
            logits, name=f"bert_{layers}l")
        model.compile(optimizer=keras.optimizers.Adam(1e-4),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    finally:
        if dtype_policy is not None:
            keras.config.set_dtype_policy(previous)
    return model


# (label, device, global batch): the v3-64, 64 chips of each
# generation the paper's "16 Cloud TPUs (64 TPU chips)" could mean, and the
# README's 12 GB GPU.
TARGETS = (
    ("batch 256 on v3-64 (32 chips, 64 cores)", "v3-64", 256),
    ("batch 256 on v3-128 (64 chips)", "v3-128", 256),
    ("batch 256 on v2-128 (64 chips)", "v2-128", 256),
    ("batch 256 on one 12 GiB GPU", "12GiB", 256),
)


def plan_all(model, compile_batches, callbacks=None):
    """Plans every target: the estimate path, or (`callbacks` given) the compiled engine step.

    `callbacks` is a function returning the list to plan (fresh callbacks per
    plan); with it the step is compiled at each per-replica batch up to
    `max(compile_batches)` and extrapolated from two compiles below it beyond.
    """
    import keras_tpu_mem.planning as planning

    if callbacks is None:
        return {device: planning.plan(model, batch, device=device,
                                      compile_batches=compile_batches)
                for _, device, batch in TARGETS}
    return {device: planning.plan(model, batch, device=device, callbacks=callbacks(),
                                  max_compile_batch=max(compile_batches))
            for _, device, batch in TARGETS}


def gib(n):
    return f"{n / GIB:.2f} GiB"


def _verdict(total, fits, largest, recommendation):
    text = f"{gib(total)}, {'fits' if fits else '**does not fit**'} (max {largest})"
    if not fits and recommendation is not None:
        text += (f"; fits as {recommendation.accumulation_steps} x "
                 f"{recommendation.micro_batch} accumulated")
    return text


def table(f32, bf16=None, estimate=True, backend="tensorflow") -> str:
    """Markdown table: float32, plan's bf16 estimate (`estimate`) and (optionally) a bf16 compile.

    The per-sample rows come from the plan that separates per-sample and fixed
    temporaries: v3-64's on the estimate path (compiled at several batches),
    the GPU's (extrapolated from two compiles) on the compiled path.
    """
    where = "v3-64" if estimate else "12GiB"
    ref = f32[where]
    b = bf16[where] if bf16 else None
    on = "JAX" if backend == "jax" else "TF"
    cols = [f"float32 ({on}, compiled)"] + (["bf16 (plan's estimate)"] if estimate else [])
    if bf16:
        cols.append(f"bf16 ({on}, compiled on CPU)")
    lines = ["| per replica | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]

    def add(label, f32_value, estimate_value, bf16_value):
        values = [f32_value] + ([estimate_value] if estimate else []) + (
            [bf16_value] if bf16 else [])
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    states = ref.weight_bytes + ref.optimizer_bytes
    add("weights + Adam slots", gib(states), gib(states),
        gib(b.weight_bytes + b.optimizer_bytes) if b else "")
    add("activations per sample", gib(ref.activations_per_sample),
        gib(0.5 * ref.activations_per_sample), gib(b.activations_per_sample) if b else "")
    add("batch-independent temporaries", gib(ref.activations_fixed),
        gib(ref.activations_fixed + ref.trainable_bytes / 2),
        gib(b.activations_fixed) if b else "")
    for label, device, _ in TARGETS:
        p = f32[device]
        q = bf16[device] if bf16 else None
        add(f"{label}: {p.per_replica_batch} per replica, {gib(p.usable_bytes)} usable",
            _verdict(p.total_bytes, p.fits, p.largest_batch, p.recommendation),
            _verdict(p.bf16_total_bytes, p.bf16_fits, p.bf16_largest_batch,
                     p.bf16_recommendation) if estimate else "",
            _verdict(q.total_bytes, q.fits, q.largest_batch, q.recommendation) if q else "")
    lines.append("")
    lines.append("max N: the largest per-replica batch that fits in one step; 10% of each "
                 "device kept as headroom.")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="encoder layers (24 = Large)")
    parser.add_argument("--compile-batches", default="1,4",
                        help="per-replica batches to compile (default 1,4: exact at the GPU's "
                             "batch 1 and v3-64's 4 per replica, interpolated between)")
    parser.add_argument("--compile-bf16", action="store_true",
                        help="also build and compile a mixed_bfloat16 model (doubles the run "
                             "time; XLA on the CPU keeps many bf16 intermediates in float32, "
                             "so this overstates what a TPU needs)")
    parser.add_argument("--backend", choices=("tensorflow", "jax"), default=None,
                        help="Keras backend to compile with (default: KERAS_BACKEND, else "
                             "tensorflow); read before Keras is imported")
    args = parser.parse_args(argv)
    compile_batches = [int(b) for b in args.compile_batches.split(",")]
    backend = keras.backend.backend()
    if args.backend is not None and args.backend != backend:
        parser.error(f"--backend {args.backend}: Keras was already imported with the "
                     f"{backend} backend; run the script itself, or set KERAS_BACKEND.")
    jax = backend == "jax"

    results = {}
    for policy in (["float32", "mixed_bfloat16"] if args.compile_bf16 else ["float32"]):
        t0 = time.perf_counter()
        if jax:
            # The engine's steps of one float32 model: Keras' own, and MixedBFloat16's.
            import keras_tpu_mem as ktm

            model = build_model(layers=args.layers)
            callbacks = (lambda: []) if policy == "float32" else (
                lambda: [ktm.MixedBFloat16()])
        else:
            model = build_model(layers=args.layers, dtype_policy=policy)
            callbacks = None
        params = model.count_params()
        plans = plan_all(model, compile_batches, callbacks)
        results[policy] = (params, plans, time.perf_counter() - t0)
        print(f"{policy}: built and compiled at batches {compile_batches} in "
              f"{time.perf_counter() - t0:.0f} s")
        del model
        keras.backend.clear_session()
        gc.collect()

    params, f32, _ = results["float32"]
    bf16 = results.get("mixed_bfloat16", (None, None, None))[1]
    print()
    print(f"BERT-Large-shaped encoder: {args.layers} layers x hidden 1024, 16 heads, "
          f"FFN 4096, seq 512, MLM head on 80 positions; {params / 1e6:.1f} M parameters, "
          "Adam.")
    if jax:
        print("Per device, from XLA's memory analysis of the JAX train step "
              "(jit(...).lower(...).compile().memory_analysis()) compiled on the host at "
              f"per-replica batches up to {max(compile_batches)}, extrapolated beyond:")
    else:
        print("Per replica, from XLA's buffer assignment of the train step compiled on the "
              f"host at batches {', '.join(map(str, compile_batches))}:")
    print(table(f32, bf16, estimate=not jax, backend=backend))
    print()
    print(f32["v3-64"])
    print()
    print(f32["12GiB"])
    return results


if __name__ == "__main__":
    main()
