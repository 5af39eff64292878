"""`plan(..., callbacks=...)` and `plan(..., search=True)`: plans built on compiles.

A plan for given callbacks compiles the engine's step for exactly those
callbacks (`compiled_memory(..., callbacks=...)`) at the requested per-replica
batch, up to `max_compile_batch`; only beyond it is the step compiled at two
smaller batches (with the same callbacks) and its temporaries extrapolated per
sample. A compile that reports no temporaries at all for a model with
trainable weights is not trusted (JAX's CPU compile did that at some small
batches): the batch is doubled until the compile holds temporaries.

The search recommends, among candidates built from the levers — gradient
accumulation (divisors of the per-replica batch), the model state split over the
data-parallel devices (JAX), bfloat16 compute, rematerialisation — the cheapest
that fits (fewest micro-batches; at equal micro-batches the least communication:
replicated, optimizer-sharded, fully sharded; then no recomputation before
recomputing the largest activation holders alone (`remat_lever`), before
recomputing every layer; float32 before bfloat16, which changes the numerics).
Each candidate is a compile (on XLA:TPU, 30 s to minutes for a large model), so a
candidate is compiled only where no compile already decides it: one whose state
alone exceeds the budget, or that a more aggressive candidate (more micro-batches,
more state split) that did not fit rules out, is skipped (`search_levers`), and
the plan says how many (`SearchNote`). While XLA compiles a candidate on another
thread, the search traces and lowers the one it would compile next were this one not to
fit (`_LeverSearch._prepare_after`; the guess decides nothing).
"""

from __future__ import annotations

import dataclasses

from keras_tpu_mem import backends, devices
from keras_tpu_mem._utils import logger
from keras_tpu_mem.engine.feature import in_step_order
from keras_tpu_mem.planning.budget import (
    ActivationModel,
    divisors,
    largest_batch,
    model_precision,
    usable_bytes,
)
from keras_tpu_mem.planning.by_layer_text import plan_table
from keras_tpu_mem.planning.memory_plan import (
    Recommendation,
    SearchNote,
    assemble,
    lever_callbacks,
)
from keras_tpu_mem.planning.remat_lever import RematLever
from keras_tpu_mem.planning.sharding_lever import (
    active_distribution,
    compiling_under,
    sharding_options,
    state_bytes_under,
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

    def __init__(self, compile_fn, features, per_replica: int, cap: int, progress=None,
                 meanwhile=None):
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
            results.append(self._trusted(compile_fn, batch, cap, divisor, progress, meanwhile))
            meanwhile = None
        self.results = results
        self.batches = tuple(r.batch_size for r in results)
        self.extrapolated = per_replica not in self.batches

    def _trusted(self, compile_fn, batch, cap, divisor, progress, meanwhile=None):
        result = compile_fn(batch, self.features, progress, meanwhile)
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


class SearchOutcome:
    """What `search_levers` found.

    Attributes:
        candidates: The compiled candidates (`Recommendation`s), cheapest first.
        recommendation: The cheapest candidate that fits, None where none does.
        reference: Its reference `CompiledMemory` (None with it).
        note: The `SearchNote` for the plan's notes.
        notes: Further notes for the plan (the remat lever's; a contradiction of the
            pruning rules the compiles showed).
    """

    def __init__(self, candidates, recommendation, reference, note, notes):
        self.candidates = tuple(candidates)
        self.recommendation = recommendation
        self.reference = reference
        self.note = note
        self.notes = list(notes)


class _LeverSearch:
    """The candidates of one search, compiled only where no compile already decides them.

    A candidate is `(ki, mi, ci)`: micro-batches `ks[ki]`, state split `modes[mi]` (least
    split first), levers `combos[ci]` (a remat option and bfloat16 or not, in the search's
    order). The order of the search is that of the tuple: fewest micro-batches, then
    least split, then the combos' order. The rules (see `search_levers`):

    * lower bound: `state(mi) + batch (+ accumulators, k > 1) > usable` rules a
      candidate out, no compile;
    * dominance, within one combo: a compiled candidate `(kj, mj, ci)` with `mj >= mi`
      that does not fit rules out `(ki, mi, ci)` (`_rules_out`): at `kj == ki` always,
      at `kj > ki >= 2 micro-batches` where its total less `_BATCH_COPIES` batches still
      exceeds `usable`; never one micro-batch (no loop: another program).
    """

    def __init__(self, compile_fn, base, per_replica, usable, data_bytes, cap, model,
                 progress, cached, prepare_fn=None):
        self.compile_fn, self.base, self.model = compile_fn, base, model
        self.prepare_fn = prepare_fn
        self.per_replica, self.usable, self.data_bytes = per_replica, usable, data_bytes
        self.cap, self.progress = cap, progress
        self.ks = divisors(per_replica)
        self.active = active_distribution()
        self.modes = sharding_options(self.active)
        self.bf16_options = [False, True] if model_precision(model) == "float32" else [False]
        # Rematerialisation where the backend has it as a lever (JAX: whole layers); its
        # targeted options are read from the by-layer table of the candidate
        # (1, as it is, float32, nothing recomputed) when the first is needed.
        self.remat = RematLever(model, backends.current("plan").compiled.rematerialize_lever())
        self._options = self.remat.options(lambda: self.step((0, 0, 0)))
        self.combos = []
        self._bounds = {}
        # {key: (Recommendation, CompiledStep)}; per combo the compiled keys, for the rules.
        self.results, self._by_combo = {}, {}
        # `_compile_id`s of the compiles the Compiler's cache answered (filled by compile_fn).
        self._cached = cached if cached is not None else set()
        self.reused = 0
        self._probed = set()  # keys a micro-batch probe was compiled for

    # ------------------------------------------------------------- candidates
    def combo(self, ci):
        """`combos[ci]`, reading the remat options as far as needed; None past the end."""
        while len(self.combos) <= ci:
            target = next(self._options, _END)
            if target is _END:
                return None
            self.combos.extend((target, bf16) for bf16 in self.bf16_options)
        return self.combos[ci]

    def lower_bound(self, ki, mi) -> int:
        if mi not in self._bounds:
            self._bounds[mi] = state_bytes_under(self.model, self.modes[mi][1], self.active)
        state, trainable = self._bounds[mi]
        return state + self.data_bytes + (trainable if self.ks[ki] > 1 else 0)

    def ruled_out(self, key):
        """Why `key` cannot fit without compiling it: "bound", "dominance" or None."""
        ki, mi, ci = key
        if self.lower_bound(ki, mi) > self.usable:
            return "bound"
        for kj, mj in self._by_combo.get(ci, ()):
            if mj >= mi and self._rules_out((kj, mj, ci), key):
                return "dominance"
        return None

    def _rules_out(self, other, key) -> bool:
        """Whether the compiled `other` (as much split or more, same combo) rules out the
        candidate `key`."""
        ki = key[0]
        kj = other[0]
        rec, _ = self.results[other]
        total = rec.total_bytes
        if total <= self.usable or kj < ki:
            return False
        if kj > ki and self.ks[ki] == 1:
            # One micro-batch runs no micro-batch loop: another program, which a loop that
            # does not fit says nothing of (the digits MLP of examples/fit_sharded_state.py
            # split over 8 host devices: 43.2 MiB at two micro-batches, 25.3 MiB at one;
            # on a TPU mesh it is Keras' own step: 6.7B MLP on v5e-16, 16.5 GiB at four
            # micro-batches, 15.0 GiB in Keras' step).
            return False
        if kj == ki:
            # More split only moves state off the device.
            return True
        # More micro-batches: smaller micro-batches' activations, but the loop may hold
        # copies of the batch as split (and cast): up to `_BATCH_COPIES` of its bytes
        # (XLA:CPU, a small MLP in bfloat16: 8 micro-batches held one batch more than 4).
        total -= _BATCH_COPIES * self.data_bytes
        return total > self.usable

    def step(self, key):
        """The `CompiledStep` of `key`, compiled once."""
        if key not in self.results:
            self._compile(key)
        return self.results[key][1]

    def _candidate(self, key):
        """`(features, mode, distribution, target, bf16)` of the candidate `key`."""
        ki, mi, ci = key
        mode, distribution = self.modes[mi]
        target, bf16 = self.combo(ci)
        layers = None if target is None else target.layers
        features = self.base + lever_callbacks(self.ks[ki], bf16, target is not None, layers)
        return features, mode, distribution, target, bf16

    def _compile(self, key, meanwhile=None):
        ki, mi, ci = key
        k = self.ks[ki]
        features, mode, distribution, target, bf16 = self._candidate(key)
        layers = None if target is None else target.layers
        with compiling_under(self.model, distribution, self.active):
            step = CompiledStep(self.compile_fn, features, self.per_replica, self.cap,
                                self.progress, meanwhile)
        # The Compiler caches by the step's features and layouts: a candidate whose
        # step was compiled before (the plan's own, an earlier plan's) costs nothing.
        if all(_compile_id(r) in self._cached for r in step.results):
            self.reused += 1
        rec = Recommendation(k, self.per_replica // k, int(step.total_bytes(self.data_bytes)),
                             bf16=bf16, rematerialize=target is not None, compiled=True,
                             sharding=mode, remat_layers=layers, compiled_under=distribution)
        self.results[key] = (rec, step)
        self._by_combo.setdefault(ci, []).append((ki, mi))

    def known(self, key):
        """True / False where compiled or ruled out, else None."""
        if key in self.results:
            return self.results[key][0].total_bytes <= self.usable
        return False if self.ruled_out(key) else None

    # ----------------------------------------------------------------- search
    def run(self) -> tuple:
        """Decides the candidates in order until one fits: each by the rules where they
        can, else by compiling `probe(key)` (a more aggressive candidate whose failure
        would rule it out, or it) until they can."""
        # The first candidate is the plan's own step where the plan was given no lever
        # (the Compiler's cache holds it), and the remat lever reads its table.
        self.step((0, 0, 0))
        while True:
            key, answer = self._next()
            if key is None:
                break
            self._compile(key, meanwhile=lambda key=key: self._prepare_after(key))
        return answer, self._counts(answer), self._contradiction()

    def _next(self):
        """`(the candidate to compile next, None)`, or `(None, the answer)` once the
        candidates are decided in order up to the first that fits (None: none does)."""
        for key in self._order():
            verdict = self.known(key)
            if verdict is None:
                return self.probe(key), None
            if verdict:
                return None, key
        return None, None

    def _prepare_after(self, key):
        """Prepares (traces and lowers: `Compiler.prepare`) the candidate the search
        would compile after `key` were `key` not to fit by far, while XLA compiles `key`
        on another thread: most of a search's compiles do not fit, and where the guess
        is right the next compile starts from its lowering. A wrong guess costs only the
        time this thread would have waited; nothing is decided from it."""
        if self.prepare_fn is None or self.per_replica > self.cap:
            return  # (beyond the cap the step compiles at other batches)
        saved = (dict(self.results), {c: list(v) for c, v in self._by_combo.items()},
                 set(self._probed))
        try:
            self.results[key] = (_NOT_FITTING, None)
            self._by_combo.setdefault(key[2], []).append(key[:2])
            guess, _ = self._next()
        finally:
            self.results, self._by_combo, self._probed = saved
        if guess is None or guess in self.results:
            return
        features, _, distribution, _, _ = self._candidate(guess)
        try:
            with compiling_under(self.model, distribution, self.active):
                self.prepare_fn(self.per_replica, features)
        except Exception:  # the compile of `guess`, if it comes, raises it as its own
            logger.debug("plan search: preparing %s failed", guess, exc_info=True)

    def probe(self, key):
        """The candidate to compile next for an undecided `key`.

        A probe is a more aggressive candidate whose failure would rule `key` out; one
        that the compiles so far predict to fit (`predicts_fit`) would likely decide
        nothing, so it is passed over, and where `key` itself is predicted to fit, `key`
        is compiled. Else, in turn:

        1. Once per key of two or more micro-batches (a loop never rules out one
           micro-batch: another program), more micro-batches at the most split (the same
           combo): where it does not fit by the margins of `_rules_out`, it rules out
           `key` and the combo's candidates in between, at every split. While nothing is
           known to fit, the next micro-batch count up (it fails the most clearly); once
           something fits at some k, the largest below it (where nothing is known to
           fit: it rules out the most).
        2. The most split at the same micro-batches: where it does not fit, it rules out
           `key` and every split in between at once; not at the fewest micro-batches
           known to fit (there it fits, likely: no help).
        3. `key` itself.
        """
        ki, mi, ci = key
        if self.predicts_fit(key):
            return key
        most = len(self.modes) - 1
        fitting = [j for (j, _, _), (rec, _) in self.results.items()
                   if rec.total_bytes <= self.usable]
        fit_k = min(fitting) if fitting else None
        if key not in self._probed and self.ks[ki] > 1:
            self._probed.add(key)
            top = len(self.ks) if fit_k is None else fit_k
            open_ = [j for j in range(ki + 1, top) if (j, most, ci) not in self.results
                     and self.known((j, most, ci)) is None]
            if open_:
                more = (open_[0] if fit_k is None else open_[-1], most, ci)
                if not self.predicts_fit(more):
                    return more
        up = (ki, most, ci)
        if (mi < most and self.known(up) is None and ki != fit_k
                and not self.predicts_fit(up)):
            return up
        return key

    def predicts_fit(self, key) -> bool:
        """Whether the compiles so far put `key` within the budget. Only which compile
        comes next depends on it; verdicts come from compiles and the rules.

        Two estimates, either suffices: the change of combo taken as additive (a compile
        at `key`'s micro-batches and split with another combo, plus what `key`'s combo
        did against that one where both were compiled), and the micro-batches taken as
        dividing what a compile of the same split and combo holds beyond its lower bound
        (`lower_bound`: state, batch, accumulators), among two or more micro-batches."""
        ki, mi, ci = key
        totals = {k: rec.total_bytes for k, (rec, _) in self.results.items()}
        for (kj, mj, cj), total in totals.items():
            # (Scaled only among loops: one micro-batch is another program.)
            if (mj, cj) == (mi, ci) and kj != ki and min(self.ks[kj], self.ks[ki]) > 1:
                rest = (total - self.lower_bound(kj, mi)) * self.ks[kj] / self.ks[ki]
                if self.lower_bound(ki, mi) + rest <= self.usable:
                    return True
            if (kj, mj) != (ki, mi) or cj == ci:
                continue
            for (kk, mk, ck), theirs in totals.items():
                if (self.ks[kk] > 1) != (self.ks[ki] > 1):
                    continue  # a difference seen in the other program
                ours = totals.get((kk, mk, ci)) if ck == cj else None
                if ours is not None and total + ours - theirs <= self.usable:
                    return True
        return False

    def _order(self):
        for ki in range(len(self.ks)):
            for mi in range(len(self.modes)):
                ci = 0
                while self.combo(ci) is not None:
                    yield (ki, mi, ci)
                    ci += 1

    def _counts(self, answer) -> SearchNote:
        exhaustive, reasons = 0, {"bound": 0, "dominance": 0}
        for key in self._order():
            exhaustive += 1
            if key == answer:
                break
            if key not in self.results:
                reasons[self.ruled_out(key)] += 1
        return SearchNote(compiled=len(self.results), reused=self.reused,
                          exhaustive=exhaustive, by_bound=reasons["bound"],
                          by_dominance=reasons["dominance"])

    def _contradiction(self):
        """A note where two compiles contradict the rules at the budget: a more
        aggressive candidate rules out one that fits, so one it ruled out unseen might
        fit too."""
        for (ki, mi, ci), (rec, _) in self.results.items():
            if rec.total_bytes > self.usable:
                continue
            for kj, mj in self._by_combo[ci]:
                if mj >= mi and self._rules_out((kj, mj, ci), (ki, mi, ci)):
                    other = self.results[(kj, mj, ci)][0]
                    fb = devices.format_bytes
                    return (f"search: {rec.describe()} fits ({fb(rec.total_bytes)}) though "
                            f"{other.describe()} does not ({fb(other.total_bytes)}): for "
                            "this model more micro-batches or more state split needed more "
                            "memory than the search allows for, so a candidate it ruled out "
                            "because a more aggressive one did not fit may fit; "
                            "plan(..., callbacks=...) compiles one configuration.")
        return None


_END = object()

#: What `_LeverSearch._prepare_after` assumes a compile in progress will say: far from
#: fitting.
_NOT_FITTING = Recommendation(1, 1, 2**62)

#: Copies of the batch the micro-batch loop may hold beyond one micro-batch's (the batch
#: split into micro-batches, and cast to the compute precision).
_BATCH_COPIES = 2


def _compile_id(result):
    """What identifies one XLA compile among `CompiledMemory`s: the Compiler hands a
    cached compile back as a copy (`dataclasses.replace` to the batch asked), which
    shares its `layer_source`, made once per compile; a refused compile has none (the
    results hold it, so its id stays its own)."""
    source = result.layer_source
    if source is not None:
        return id(source)
    return (result.refused, result.features, result.micro_batches, result.argument_bytes,
            result.temp_bytes, result.weight_bytes, result.optimizer_bytes)


def _cache_size(compiler):
    """Entries the Compiler's cache holds for the model; None where it keeps none (a
    model that cannot be weakly referenced). A compile that leaves it as it was came
    from it."""
    from keras_tpu_mem.planning.compiled import _CACHE

    try:
        cache = _CACHE.get(compiler.user_model)
    except TypeError:
        return None
    return None if cache is None else len(cache)


def search_levers(compile_fn, base_features, per_replica: int, usable: int, data_bytes: int,
                  cap: int, model, progress=None, notes=None, cached=None,
                  prepare=None) -> SearchOutcome:
    """The cheapest candidate that fits, compiling a candidate only where no compile
    already decides it.

    Candidates, in the order of the answer: k in the divisors of `per_replica`
    (ascending); for each, the state as the active distribution lays it out, then
    split over its data-parallel devices (optimizer slots, then weights too: JAX,
    `sharding_lever`); for each, as it is, then (where the backend supports it) the
    largest activation holders rematerialised alone (`remat_lever`: from `by_layer()`
    of the candidate (1, as it is, float32), least recompute first), then every layer;
    each of these in float32, then bfloat16 compute (only when the model computes in
    float32). The recommendation is the first in that order that fits, as a search
    compiling every candidate in turn finds it; a candidate is compiled only when these
    rules leave it undecided:

    * Lower bound: the weights and optimizer slots one device holds under the
      candidate's layout, its batch and, with accumulation, one accumulator per
      trainable weight, are in any compile of it; where they exceed `usable` it is
      ruled out unseen.
    * Dominance, at the same remat option and precision: a compile that does not fit
      rules out the candidates with as many micro-batches and less state split
      (splitting only moves state off the device), and those with fewer micro-batches
      and no more split where it exceeds `usable` by more than two copies of the batch
      (a larger k >= 2 holds the same accumulators and smaller micro-batches'
      activations, but its loop may hold the batch as split into micro-batches and
      cast: on XLA:CPU 8 micro-batches of a small MLP in bfloat16 held one batch more
      than 4). One micro-batch is never ruled out by a loop: it runs none, and the
      loop can hold more than its accumulators beyond it (the MLP of
      examples/fit_sharded_state.py split over 8 devices: 43.2 MiB at two micro-batches,
      less at one; on a TPU mesh it is Keras' own step).
    * Nothing is assumed across remat options or precisions: on XLA:CPU bfloat16 and
      `Rematerialize()` can need more memory than float32 and less recompute (at 4
      micro-batches, fully split, the encoder of benchmarks/bench_sharding.py takes
      19.8 MiB in float32, 23.0 MiB in bfloat16, 26.9 MiB with `Rematerialize()` in
      bfloat16), so each of these combos is decided by its own compiles.

    The candidates are decided in order, each by these rules where they can, else by
    compiling a probe (`_LeverSearch.probe`): once, more micro-batches at the most split
    (the next count up; below the fewest known to fit anything, the largest), then the
    next split up, then the candidate itself. Compiles that contradict the rules at the
    budget are said in a note.

    While XLA compiles a candidate (on another thread, where the backend can: JAX), the
    search prepares the one it would compile next were that one not to fit
    (`prepare`, e.g. `Compiler.prepare`: the trace and lowering), so that a search of
    host compiles costs little more than XLA's compiles; the guess decides nothing.

    Args:
        compile_fn: `(per_replica, features, progress, meanwhile) -> CompiledMemory`.
        prepare: `(per_replica, features) -> None`, or None: nothing prepared.
        cached: A set `compile_fn` adds the `_compile_id` of each result the Compiler's
            cache answered to (`_cache_size`): a candidate all of whose results are in
            it is counted as reused. None: none is.

    Returns:
        A `SearchOutcome`. `notes` (a list) receives what the plan should say about the
        search but the `SearchNote` (the caller places it).
    """
    base = [f for f in base_features if f.name not in _LEVER_NAMES]
    search = _LeverSearch(compile_fn, base, per_replica, usable, data_bytes, cap, model,
                          progress, cached, prepare)
    extra = []
    try:
        answer, note, contradiction = search.run()
        if contradiction is not None:
            extra.append(contradiction)
    finally:
        if notes is not None:
            notes.extend(search.remat.notes)
    candidates = [search.results[key][0] for key in sorted(search.results)]
    if answer is None:
        return SearchOutcome(candidates, None, None, note, extra)
    rec, step = search.results[answer]
    return SearchOutcome(candidates, rec, step.reference, note, extra)


def compiled_plan(compiler, features, *, budget_device, global_batch_size: int,
                  per_replica: int, headroom: float, search: bool, cap: int, progress=None,
                  notes=(), by_layer: bool = True):
    """A `MemoryPlan` from compiles of the engine's step for `features`."""
    calls, cached = [0], set()

    def compile_fn(batch, feats, progress_fn, meanwhile=None):
        if progress_fn is not None:
            progress_fn(calls[0], None, batch)
        calls[0] += 1
        before = _cache_size(compiler)
        result = compiler(batch, feats, False, meanwhile=meanwhile)
        if before is not None and _cache_size(compiler) == before:
            cached.add(_compile_id(result))
        return result

    user_model = compiler.user_model
    step = CompiledStep(compile_fn, features, per_replica, cap, progress)
    ref = step.reference
    data_bytes = _spec_bytes(compiler.specs(per_replica))
    total = step.total_bytes(data_bytes)
    k = ref.micro_batches
    accum = ref.accumulator_bytes
    temps = int(round(step.temp_bytes()))
    activation = temps - ref.temp_accumulator_bytes
    weights, optimizer = ref.weight_bytes, ref.optimizer_bytes
    other = int(total - weights - optimizer - accum - activation - data_bytes)
    usable = usable_bytes(budget_device.capacity_bytes, headroom)
    trainable = _variable_bytes(_unique(user_model.trainable_weights))
    if step.extrapolated:
        act = ActivationModel(tuple((r.batch_size, r.temp_bytes - r.temp_accumulator_bytes)
                                    for r in step.results))
        per_sample, fixed = act.per_sample_bytes, act.fixed_bytes
    else:
        per_sample, fixed = activation / max(per_replica, 1), 0.0
        act = ActivationModel(((per_replica, max(activation, 0)),))
    largest = largest_batch(usable, weights + optimizer, act, data_bytes / per_replica,
                            other) if k == 1 else 0
    candidates, recommendation, recommended, search_notes = (), None, None, []
    if search:
        outcome = search_levers(compile_fn, features, per_replica, usable, data_bytes, cap,
                                user_model, progress, search_notes, cached=cached,
                                prepare=compiler.prepare)
        candidates, recommendation = outcome.candidates, outcome.recommendation
        recommended = outcome.reference
        search_notes += [outcome.note, *outcome.notes]
        if recommendation is not None and compiler.target is not None:
            recommendation = dataclasses.replace(recommendation, target=compiler.target)
    # The by-layer table of the configuration the plan reports, one more compile.
    table, table_of, table_note = None, "", None
    if by_layer:
        table, table_of, table_note = plan_table(user_model, recommended, recommendation, ref,
                                                 active_distribution())
    if progress is not None:
        progress(calls[0], calls[0], None)
    names = tuple(type(f).__name__ for f in in_step_order(features))
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
                    compiler=ref.compiler, refused=ref.refused, pulled=ref.pulled)
