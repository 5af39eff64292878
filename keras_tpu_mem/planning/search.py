"""`plan(..., callbacks=...)` and `plan(..., search=True)`: plans built on compiles.

A plan for given callbacks compiles the engine's step for exactly those
callbacks (`compiled_memory(..., callbacks=...)`) at the requested per-replica
batch, up to `max_compile_batch`; only beyond it is the step compiled at two
smaller batches (with the same callbacks) and its temporaries extrapolated per
sample. A compile that reports no temporaries at all for a model with
trainable weights is not trusted (JAX's CPU compile did that at some small
batches): the batch is doubled until the compile holds temporaries.

The search compiles candidates built from the levers — gradient accumulation
(divisors of the per-replica batch), the model state split over the
data-parallel devices (JAX), bfloat16 compute, rematerialisation — cheapest
first (fewest micro-batches; at equal micro-batches the least communication:
replicated, optimizer-sharded, fully sharded; then no recomputation before
recomputing the largest activation holders alone (`remat_lever`), before
recomputing every layer; float32 before bfloat16, which changes the numerics),
and stops at the first that fits.
"""

from __future__ import annotations

import dataclasses

from keras_tpu_mem import backends
from keras_tpu_mem.planning.budget import (
    ActivationModel,
    divisors,
    largest_batch,
    model_precision,
)
from keras_tpu_mem.planning.by_layer_text import plan_table
from keras_tpu_mem.planning.memory_plan import Recommendation, assemble, lever_callbacks
from keras_tpu_mem.planning.remat_lever import RematLever
from keras_tpu_mem.planning.sharding_lever import (
    active_distribution,
    compiling_under,
    sharding_options,
)
from keras_tpu_mem.planning.specs import _spec_bytes, _unique, _variable_bytes

#: Per-replica batches compiled directly by a plan with callbacks: at most this.
MAX_COMPILE_BATCH = 8192

# Feature kinds the search sets itself (engine `Feature.name`s).
_LEVER_NAMES = ("micro_batching", "compute_policy", "rematerialize")


def _has(features, name: str) -> bool:
    return any(f.name == name for f in features)


class CompiledStep:
    """Compiles of one configuration: direct where affordable, else extrapolated.

    Attributes:
        batches: Per-replica batches compiled.
        results: Their `CompiledMemory`s.
        extrapolated: Whether the requested batch was beyond the cap.
    """

    def __init__(self, compile_fn, features, per_replica: int, cap: int, progress=None):
        self.features = tuple(features)
        self.per_replica = per_replica
        divisor = _divisor_for(self.features, per_replica)
        if per_replica <= cap:
            batches = [per_replica]
        else:
            # Two batches below the cap that every feature can split like the
            # requested one (multiples of its divisor), a factor 2 apart.
            fitting = [b for b in divisors(per_replica) if b <= cap and b % divisor == 0]
            if len(fitting) < 2:
                raise ValueError(
                    f"plan: cannot extrapolate the per-replica batch {per_replica}: no two "
                    f"batches up to max_compile_batch={cap} divide it and split into the "
                    "same micro-batches; raise max_compile_batch.")
            top = fitting[-1]
            low = max((b for b in fitting if b <= top // 2), default=fitting[-2])
            batches = [low, top]
        results = []
        for batch in batches:
            results.append(self._trusted(compile_fn, batch, cap, divisor, progress))
        self.results = results
        self.batches = tuple(r.batch_size for r in results)
        self.extrapolated = per_replica not in self.batches

    def _trusted(self, compile_fn, batch, cap, divisor, progress):
        result = compile_fn(batch, self.features, progress)
        # XLA keeps the gradients of every trainable weight somewhere: a step
        # with none in its temporaries is not a plan (seen on JAX's CPU compile
        # at small batches). Double the batch until it holds some.
        tries = 0
        host = not result.compiler.startswith("XLA:TPU")  # XLA:TPU's are the verdict
        while host and result.temp_bytes == 0 and result.weight_bytes > 0 and tries < 4:
            batch *= 2
            tries += 1
            result = compile_fn(batch, self.features, progress)
        return result

    @property
    def reference(self):
        return self.results[-1]

    def temp_bytes(self) -> float:
        """Temporaries at the requested batch (compiled, or along the line of two compiles)."""
        if not self.extrapolated:
            return float(self.reference.temp_bytes)
        model = ActivationModel(tuple((r.batch_size, r.temp_bytes) for r in self.results))
        return model(self.per_replica)

    def total_bytes(self, data_bytes: int) -> int:
        """The step's total at the requested batch (its data at that batch)."""
        ref = self.reference
        if not self.extrapolated:
            return ref.total_bytes
        return int(ref.total_bytes - ref.temp_bytes - ref.data_bytes
                   + self.temp_bytes() + data_bytes)


def _divisor_for(features, per_replica: int) -> int:
    """What the batch must be a multiple of for these features (1: anything)."""
    for feature in features:
        requirement = getattr(feature, "_requirement", None)
        if requirement is not None and feature.name == "micro_batching":
            return int(requirement()[1])
    return 1


def search_levers(compile_fn, base_features, per_replica: int, usable: int, data_bytes: int,
                  cap: int, model, progress=None, notes=None):
    """Compiles candidates cheapest first; returns `(candidates, first that fits or None,
    its reference `CompiledMemory` or None)`.

    Each candidate is a `Recommendation` with `compiled=True` and its compiled
    total. Candidates: k in the divisors of `per_replica` (ascending); for each,
    the state as the active distribution lays it out, then split over its
    data-parallel devices (optimizer slots, then weights too: JAX,
    `sharding_lever`); for each, as it is, then (where the backend supports
    it) the largest activation holders rematerialised alone (`remat_lever`:
    from `by_layer()` of the first compile, least recompute first; one that
    freed nothing more is not compiled again), then every layer; each of
    these in float32, then bfloat16 compute (only when the model computes in
    float32). `notes` (a list) receives what the plan should say about the
    search.
    """
    base = [f for f in base_features if f.name not in _LEVER_NAMES]
    bf16_options = [False, True] if model_precision(model) == "float32" else [False]
    # Rematerialisation where the backend has it as a lever (JAX: whole layers).
    remat = RematLever(model, backends.current("plan").compiled.REMATERIALIZE_LEVER)
    active = active_distribution()
    shardings = sharding_options(active)
    candidates, first = [], []
    try:
        for k in divisors(per_replica):
            for mode, distribution in shardings:
                # The targeted options are read from the search's very first compile
                # (one micro-batch, the state as it is, float32 or as built, nothing
                # recomputed): the ranking of the holders, not their bytes, is used.
                for target in remat.options(lambda: first[0]):
                    layers = None if target is None else target.layers
                    worth = True  # bfloat16 too, unless float32 showed it frees nothing
                    for bf16 in bf16_options:
                        if bf16 and not worth:
                            break
                        features = base + lever_callbacks(k, bf16, target is not None, layers)
                        with compiling_under(model, distribution, active):
                            step = CompiledStep(compile_fn, features, per_replica, cap,
                                                progress)
                        if not first:
                            first.append(step)
                        total = step.total_bytes(data_bytes)
                        if not bf16:
                            worth = remat.record(target, total)
                        rec = Recommendation(k, per_replica // k, int(total), bf16=bf16,
                                             rematerialize=target is not None,
                                             compiled=True, sharding=mode,
                                             remat_layers=layers, compiled_under=distribution)
                        candidates.append(rec)
                        if total <= usable:
                            return tuple(candidates), rec, step.reference
        return tuple(candidates), None, None
    finally:
        if notes is not None:
            notes.extend(remat.notes)


def compiled_plan(compiler, features, *, budget_device, global_batch_size: int,
                  per_replica: int, headroom: float, search: bool, cap: int, progress=None,
                  notes=(), by_layer: bool = True):
    """A `MemoryPlan` from compiles of the engine's step for `features`."""
    calls = [0]

    def compile_fn(batch, feats, progress_fn):
        if progress_fn is not None:
            progress_fn(calls[0], None, batch)
        calls[0] += 1
        return compiler(batch, feats, False)

    user_model = compiler.user_model
    step = CompiledStep(compile_fn, features, per_replica, cap, progress)
    ref = step.reference
    data_bytes = _spec_bytes(compiler.specs(per_replica))
    total = step.total_bytes(data_bytes)
    k = ref.micro_batches
    accum = ref.accumulator_bytes
    temps = int(round(step.temp_bytes()))
    activation = temps - accum
    weights, optimizer = ref.weight_bytes, ref.optimizer_bytes
    other = int(total - weights - optimizer - accum - activation - data_bytes)
    usable = int(budget_device.capacity_bytes * (1.0 - float(headroom)))
    trainable = _variable_bytes(_unique(user_model.trainable_weights))
    if step.extrapolated:
        act = ActivationModel(tuple((r.batch_size, r.temp_bytes - r.accumulator_bytes)
                                    for r in step.results))
        per_sample, fixed = act.per_sample_bytes, act.fixed_bytes
    else:
        per_sample, fixed = activation / max(per_replica, 1), 0.0
        act = ActivationModel(((per_replica, max(activation, 0)),))
    largest = largest_batch(usable, weights + optimizer, act, data_bytes / per_replica,
                            other) if k == 1 else 0
    candidates, recommendation, recommended, search_notes = (), None, None, []
    if search:
        candidates, recommendation, recommended = search_levers(
            compile_fn, features, per_replica, usable, data_bytes, cap, user_model, progress,
            search_notes)
        if recommendation is not None and compiler.target is not None:
            recommendation = dataclasses.replace(recommendation, target=compiler.target)
    # The by-layer table of the configuration the plan reports, one more compile.
    table, table_of, table_note = None, "", None
    if by_layer:
        table, table_of, table_note = plan_table(user_model, recommended, recommendation, ref,
                                                 active_distribution())
    if progress is not None:
        progress(calls[0], calls[0], None)
    names = tuple(type(f).__name__ for f in sorted(features, key=lambda f: (f.order, f.name)))
    bf16 = _has(features, "compute_policy")
    notes = list(notes) + search_notes
    own_precision = model_precision(user_model)
    if not step.extrapolated:
        notes.append("activations per sample: the compiled temporaries divided by the "
                     "batch (one compile; the fixed part is not separated).")
    if search and recommendation is None:
        notes.append("no candidate of the search fits: a smaller global batch, more "
                     "replicas or a larger device.")
    if table_note is not None:
        notes.append(table_note)
    return assemble(budget_device, global_batch_size, per_replica, k, ref,
                    headroom=headroom, precision="mixed_bfloat16" if bf16 else own_precision,
                    own_precision=own_precision, trainable=trainable, accumulators=accum,
                    activation=activation, data=data_bytes, other=other,
                    activations=(per_sample, fixed), batches=step.batches,
                    extrapolated=step.extrapolated, recommendation=recommendation,
                    largest=largest, notes=notes, features=names, candidates=candidates,
                    searched=bool(search), by_layer=table, by_layer_of=table_of,
                    compiler=ref.compiler, refused=ref.refused)
