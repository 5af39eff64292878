"""What a plan says: `MemoryPlan` (a replica's budget, as a table) and `Recommendation`
(the levers that make it fit, as callbacks for `fit`)."""

from __future__ import annotations

import dataclasses
import textwrap

from keras_tpu_mem import devices
from keras_tpu_mem.planning.budget import DeviceBudget, usable_bytes


def lever_callbacks(accumulation_steps: int, bf16: bool, rematerialize: bool,
                    remat_layers=None) -> list:
    """The feature callbacks that pull the plan's levers (none for `(1, False, False)`).

    `remat_layers` names the layers `Rematerialize` recomputes (None: every layer).

    Example:

    ```python
    lever_callbacks(4, True, False)   # [GradientAccumulation(4), MixedBFloat16()]
    ```
    """
    out = []
    if accumulation_steps > 1:
        from keras_tpu_mem.accumulation import GradientAccumulation

        out.append(GradientAccumulation(accumulation_steps))
    if bf16:
        from keras_tpu_mem.precision import MixedBFloat16

        out.append(MixedBFloat16())
    if rematerialize:
        from keras_tpu_mem.remat import Rematerialize

        out.append(Rematerialize(None if remat_layers is None else list(remat_layers)))
    return out


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """A configuration that fits: the levers to pull and its bytes per replica.

    Attributes:
        accumulation_steps: Micro-batches per update (1: no accumulation).
        micro_batch: Examples per micro-batch.
        total_bytes: The configuration's total per replica (compiled where
            `compiled` is True, else the plan's estimate).
        bf16: Whether it computes in bfloat16 (`ktm.MixedBFloat16`).
        rematerialize: Whether layers' activations are recomputed in the
            backward pass (`ktm.Rematerialize`).
        remat_layers: The layers recomputed, a tuple of names (the search's
            targeted candidates: the largest activation holders of
            `CompiledMemory.by_layer()`); None with `rematerialize`: every layer.
        compiled: Whether `total_bytes` comes from an XLA compile of the
            engine's step for `callbacks()` (the search), not from scaling.
        sharding: The model state the search split over the data-parallel
            devices (JAX): None (as planned), `"optimizer"` (the optimizer's
            slots) or `"all"` (weights and slots); see `distribution()`.
    """

    accumulation_steps: int
    micro_batch: int
    total_bytes: int
    bf16: bool = False
    rematerialize: bool = False
    compiled: bool = False
    sharding: str | None = None
    remat_layers: tuple | None = None
    #: The distribution the candidate was compiled under (None: none active).
    compiled_under: object = dataclasses.field(default=None, compare=False, repr=False)
    #: The TPU slice XLA:TPU compiled it for (`planning.target.CompileTarget`), None:
    #: the host.
    target: object = dataclasses.field(default=None, compare=False, repr=False)

    def callbacks(self) -> list:
        """The feature callbacks that realise this configuration, ready for `fit`.

        Example:

        ```python
        p = ktm.plan(model, 4096, device="v3-8", search=True)
        model.fit(ds, callbacks=p.recommendation.callbacks())
        ```
        """
        return lever_callbacks(self.accumulation_steps, self.bf16, self.rematerialize,
                               self.remat_layers)

    def distribution(self):
        """The `keras.distribution` this configuration was compiled under: a
        `ShardedDataParallel` where the search split the state (`sharding`), else
        the distribution active when planning (None: none was).

        Example:

        ```python
        p = ktm.plan(model, 1024, device="16GiB-8", search=True)
        ktm.reshard(model, p.recommendation.distribution())   # the state, in place
        with p.recommendation.distribution().scope():
            model.fit(x, y, batch_size=1024, callbacks=p.recommendation.callbacks())
        ```

        A recommendation XLA:TPU compiled for a TPU slice (`plan(..., device="v5e-16")`)
        gives that distribution over this process's devices when they are the slice's
        kind and count (run it on the slice), else a ValueError saying which slice it
        is meant for.
        """
        if self.target is not None:
            from keras_tpu_mem.planning.target import on_this_machine

            return on_this_machine(self.compiled_under, self.target)
        return self.compiled_under

    def describe(self) -> str:
        parts = []
        if self.sharding is not None:
            parts.append(f"ShardedDataParallel(shard={self.sharding!r})")
        if self.accumulation_steps > 1:
            parts.append(f"GradientAccumulation({self.accumulation_steps}) "
                         f"(micro-batch {self.micro_batch})")
        if self.bf16:
            parts.append("MixedBFloat16()")
        if self.rematerialize:
            parts.append("Rematerialize()" if self.remat_layers is None else
                         f"Rematerialize(layers={list(self.remat_layers)!r})")
        return " + ".join(parts) or "as it is"


class SearchNote(str):
    """The plan's note on what the search compiled, with its counts as attributes.

    A `str` (it is one of `MemoryPlan.notes`), so the plan prints it; the counts are for
    code that reads the plan.

    Attributes:
        compiled: Candidates the search compiled (`MemoryPlan.candidates`), among them
            the ones whose compile the Compiler's cache already held (`reused`).
        reused: Of those, the ones that cost no compile: an earlier compile of the same
            step and layouts (the plan's own step, most often).
        exhaustive: Candidates a search without pruning compiles: every candidate up
            to and including the recommendation, in order (all of them where none fits).
        ruled_out: Of those, the ones ruled out unseen: `by_bound + by_dominance`.
        by_bound: Ruled out because the state one device holds under the candidate's
            layout, with the batch (and the accumulators), already exceeds the budget.
        by_dominance: Ruled out because a more aggressive candidate (as many or more
            micro-batches, as much or more state split, the same remat and precision)
            did not fit.

    Example:

    ```python
    p = ktm.plan(model, 1024, device="16GiB-8", search=True)
    p.search.compiled, p.search.ruled_out      # (17, 56): a ktm.SearchNote
    ```
    """

    compiled: int
    reused: int
    exhaustive: int
    by_bound: int
    by_dominance: int

    def __new__(cls, *, compiled: int, reused: int, exhaustive: int, by_bound: int,
                by_dominance: int):
        text = (f"search: compiled {compiled} candidates ({reused} of them already compiled: "
                f"the cache); of the {exhaustive} up to the recommendation in the search's "
                "order (all, where none fits), "
                f"ruled out {by_bound + by_dominance} unseen ({by_bound} by the lower bound: "
                f"the state as laid out and the batch exceed the budget; {by_dominance} "
                "because a more aggressive candidate, with more micro-batches or more state "
                "split, did not fit).")
        note = super().__new__(cls, text)
        note.compiled, note.reused, note.exhaustive = compiled, reused, exhaustive
        note.by_bound, note.by_dominance = by_bound, by_dominance
        return note

    @property
    def ruled_out(self) -> int:
        return self.by_bound + self.by_dominance


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-replica memory budget of a training configuration.

    All byte counts are per replica. `activation_bytes` are XLA's temporaries
    of the train step at the micro-batch (activations kept for the backward
    pass, the gradients XLA keeps live, workspace). `gradient_bytes` is one
    full set of gradients, the most of them that can be live at once; XLA
    computes them inside its temporaries (often fused into the update), so they
    are reported but not added to the total a second time.
    """

    device: DeviceBudget
    global_batch_size: int
    per_replica_batch: int
    accumulation_steps: int
    micro_batch: int
    precision: str
    model_precision: str
    headroom: float
    weight_bytes: int
    trainable_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    accumulator_bytes: int
    activation_bytes: int
    data_bytes: int
    other_bytes: int
    activations_per_sample: float
    activations_fixed: float
    compiled_batches: tuple[int, ...]
    extrapolated: bool
    recommendation: Recommendation | None
    bf16_activation_bytes: int | None
    bf16_total_bytes: int | None
    bf16_recommendation: Recommendation | None
    largest_batch: int = 0
    bf16_largest_batch: int | None = None
    notes: tuple[str, ...] = ()
    #: Names of the feature callbacks whose engine step was compiled (`callbacks=`).
    features: tuple[str, ...] = ()
    #: Candidates the search compiled, cheapest first (`search=True`).
    candidates: tuple = ()
    #: Whether a recommendation was looked for (the estimate's accumulation
    #: sweep, or `search=True`); False for `plan(..., callbacks=...)` alone.
    searched: bool = True
    #: The `LayerTable` of the configuration the plan reports (the recommendation,
    #: else the planned step) where the plan compiled the step; None for an estimate.
    by_layer: object = dataclasses.field(default=None, compare=False, repr=False)
    #: Which configuration `by_layer` is of, in words.
    by_layer_of: str = ""
    #: Which compiler answered: `"XLA:TPU (TPU v5 lite, v5e:4x4, 16 devices, libtpu
    #: 0.0.42.1)"` for a TPU slice compiled ahead of time, `"XLA:CPU (...)"` on the host.
    compiler: str = ""
    #: XLA's message where it refused the planned step as too large (XLA:TPU), else "".
    refused: str = ""
    #: Whether the dataset yields the micro-batches (`GradientAccumulation(k,
    #: dataset_yields="micro_batches")`): `global_batch_size` is then one micro-batch,
    #: `accumulation_steps` of them make an update.
    pulled: bool = False

    @property
    def search(self):
        """What `search=True` compiled: the `ktm.SearchNote` among `notes` (a `str` with
        counts: `compiled`, `reused`, `exhaustive`, `by_bound`, `by_dominance`,
        `ruled_out`); None for a plan that searched no compiles."""
        return next((n for n in self.notes if isinstance(n, SearchNote)), None)

    @property
    def capacity_bytes(self) -> int:
        return self.device.capacity_bytes

    @property
    def usable_bytes(self) -> int:
        """Capacity minus the headroom kept for what the plan does not model."""
        return usable_bytes(self.device.capacity_bytes, self.headroom)

    @property
    def total_bytes(self) -> int:
        return (self.weight_bytes + self.optimizer_bytes + self.accumulator_bytes
                + self.activation_bytes + self.data_bytes + self.other_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.usable_bytes

    @property
    def bf16_fits(self) -> bool | None:
        if self.bf16_total_bytes is None:
            return None
        return self.bf16_total_bytes <= self.usable_bytes

    def table(self) -> str:
        fb = devices.format_bytes
        k = self.accumulation_steps
        d = self.device
        batch = (f"global batch {self.global_batch_size} = {d.replicas} replica(s) x "
                 f"{self.per_replica_batch}")
        if self.pulled:
            batch += (f", one of {k} micro-batches the dataset yields per update "
                      f"({k * self.global_batch_size} examples)")
        elif k > 1:
            batch += f" = {k} micro-batches of {self.micro_batch}"
        how = ("compiled at this batch" if not self.extrapolated else
               f"extrapolated from XLA compiles at batches "
               f"{', '.join(map(str, self.compiled_batches))}")
        if self.features:
            how = (f"the engine's step for {', '.join(self.features)}, "
                   + ("compiled at this batch" if not self.extrapolated else
                      "extrapolated per sample from its compiles at per-replica batches "
                      + ", ".join(map(str, self.compiled_batches))))
        elif self.precision != self.model_precision:
            how += f"; {self.precision} estimated from the {self.model_precision} compiles"
        lines = [
            f"Memory plan on {d.name} ({fb(d.capacity_bytes)} per replica), {self.precision}",
            *([f"  compiled by {self.compiler}"] if self.compiler else []),
            *([f"  refused by XLA: {self.refused}"] if self.refused else []),
            f"  {batch}",
            f"  {'weights':<24}{fb(self.weight_bytes):>12}",
            f"  {'optimizer slots':<24}{fb(self.optimizer_bytes):>12}",
            f"  {'gradient accumulators':<24}{fb(self.accumulator_bytes):>12}"
            + ("" if k > 1 else "  (no accumulation)"),
            f"  {'activations+workspace':<24}{fb(self.activation_bytes):>12}  "
            f"XLA temporaries at batch {self.micro_batch}: "
            f"{fb(self.activations_per_sample)}/sample + {fb(self.activations_fixed)} fixed "
            f"({how})",
            f"  {'  incl. gradients':<24}{fb(self.gradient_bytes):>12}  at most, "
            "one per trainable weight",
            f"  {'input batch':<24}{fb(self.data_bytes):>12}",
            f"  {'other':<24}{fb(self.other_bytes):>12}  metric state, results, constants",
            f"  {'total':<24}{fb(self.total_bytes):>12}  of {fb(self.usable_bytes)} usable "
            f"({fb(d.capacity_bytes)} - {self.headroom:.0%} headroom)",
            f"  fits: {'yes' if self.fits else 'NO'}; largest per-replica batch that fits "
            f"without accumulation: {self.largest_batch}",
        ]
        rec = self.recommendation
        if self.fits:
            pass
        elif rec is not None and rec.compiled:
            lines.append(f"  -> fits with {rec.describe()}: {fb(rec.total_bytes)} compiled "
                         "(callbacks: plan.recommendation.callbacks())")
            if rec.sharding is not None:
                lines.append("     state: ktm.reshard(model, plan.recommendation.distribution()),"
                             " then fit in its scope (or build the model there)")
        elif rec is not None:
            lines.append(
                f"  -> fits with accumulation_steps={rec.accumulation_steps} "
                f"(micro-batch {rec.micro_batch}): {fb(rec.total_bytes)}"
            )
        elif not self.searched:
            lines.append("  -> not searched: plan(..., search=True) compiles accumulation "
                         "and bf16 (on JAX also remat) candidates and recommends the "
                         "cheapest that fits")
        else:
            lines.append("  -> does not fit even with one example per micro-batch")
        if self.bf16_total_bytes is not None:
            line = (f"  bf16 compute (mixed_bfloat16, estimate): activations "
                    f"{fb(self.bf16_activation_bytes)}, total {fb(self.bf16_total_bytes)}, "
                    f"fits: {'yes' if self.bf16_fits else 'no'}, largest per-replica batch "
                    f"{self.bf16_largest_batch}")
            brec = self.bf16_recommendation
            if not self.bf16_fits and brec is not None:
                line += (f"; with accumulation_steps={brec.accumulation_steps} "
                         f"(micro-batch {brec.micro_batch}): {fb(brec.total_bytes)}")
            lines.append(line)
        if self.candidates:
            lines.append(candidates_table(self.candidates, self.usable_bytes))
        if self.by_layer is not None:
            from keras_tpu_mem.planning.by_layer_text import top_lines

            lines.extend(top_lines(self.by_layer, self.by_layer_of,
                                   whole="; plan.by_layer has every row"))
        for note in self.notes:
            # Unbroken at hyphens: an install line ("keras-tpu-mem[tpu-plan]") stays whole.
            lines.extend(textwrap.wrap(note, width=96, initial_indent="  note: ",
                                       subsequent_indent="        ", break_on_hyphens=False))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


NOT_MODELLED = (
    "XLA's CPU compile is the reference: it does not apply TPU layout padding "
    "(TPU tiles the two minor dimensions to multiples of 8 x 128 for float32, "
    "16 x 128 for bfloat16, so small or odd feature sizes grow), the TPU compiler's "
    "own fusion and scheduling, nor the runtime's reserved HBM and fragmentation; "
    "the headroom covers these. Keep feature sizes multiples of 128."
)


TPU_NOT_MODELLED = (
    "XLA:TPU's ahead-of-time compile for the slice is the reference: its layouts (8 x 128 "
    "tiles), fusion and buffer assignment are the TPU's own, and its capacity is the HBM "
    "it counts available. It confirms memory and the program, not speed, a run, or the "
    "interconnect; the headroom covers what the runtime adds at run time."
)


def layout_note(reference, usable: int) -> str | None:
    """A note where XLA:TPU's own layout of the `reference` compile (`CompiledMemory.
    laid_out_bytes`) fits `usable` bytes but the total the verdicts count does not:
    XLA:TPU reports temporaries beyond the arena it lays out (docs/planning.md); None
    elsewhere."""
    laid_out = reference.laid_out_bytes
    if not laid_out or not laid_out <= usable < reference.total_bytes:
        return None
    fb = devices.format_bytes
    return (f"XLA:TPU's own layout of the step it compiled at batch {reference.batch_size} "
            f"holds {fb(laid_out)} of HBM per device, within the {fb(usable)} usable, but "
            f"its memory_analysis() reports temporaries beyond that arena "
            f"({fb(reference.total_bytes)} in all), and the verdict counts those. Which of "
            "the two the TPU's runtime needs was not measured (docs/planning.md, \"What "
            "each figure counts\").")


def candidates_table(candidates, usable: int) -> str:
    """The candidates a search compiled, as a table."""
    fb = devices.format_bytes
    remat = [_remat_label(c) for c in candidates]
    width = max([5, *map(len, remat)])
    lines = ["  search (compiled, cheapest first):",
             f"    {'micro-batches':>13}  {'micro-batch':>11}  {'bf16':<4}  {'remat':<{width}}  "
             f"{'state split':<11}  {'total':>12}  fits"]
    for c, label in zip(candidates, remat):
        lines.append(
            f"    {c.accumulation_steps:>13}  {c.micro_batch:>11}  "
            f"{'yes' if c.bf16 else 'no':<4}  {label:<{width}}  "
            f"{c.sharding or 'no':<11}  "
            f"{fb(c.total_bytes):>12}  {'yes' if c.total_bytes <= usable else 'no'}")
    return "\n".join(lines)


def _remat_label(candidate) -> str:
    """The remat column: "no", "all" or the layers recomputed."""
    if not candidate.rematerialize:
        return "no"
    layers = getattr(candidate, "remat_layers", None)
    return "all" if layers is None else ",".join(layers)


def assemble(device: DeviceBudget, global_batch_size: int, per_replica: int,
             accumulation_steps: int, reference, *, headroom: float, precision: str,
             own_precision: str, trainable: int, accumulators: int, activation: int,
             data: int, other: int, activations: tuple, batches, extrapolated: bool,
             recommendation, largest: int, notes, bf16=(None, None, None, None),
             **more) -> MemoryPlan:
    """The one place a `MemoryPlan` is put together, by the estimate and by the compiles.

    Args:
        reference: The `CompiledMemory` the weights and optimizer slots are read from.
        activations: `(bytes per sample, fixed bytes)` of the activation model.
        notes: The plan's notes; what the plan does not model is added last.
        bf16: The bfloat16 estimate's `(activation bytes, total bytes,
            recommendation, largest batch)`; None where it was not made.
        **more: The `MemoryPlan` fields only one of the two paths fills.
    """
    per_sample, fixed = activations
    bf16_activation, bf16_total, bf16_recommendation, bf16_largest = bf16
    layout = layout_note(reference, usable_bytes(device.capacity_bytes, headroom))
    notes = (*notes, *([layout] if layout else []))
    return MemoryPlan(
        device=device, global_batch_size=global_batch_size, per_replica_batch=per_replica,
        accumulation_steps=accumulation_steps,
        micro_batch=per_replica if more.get("pulled") else per_replica // accumulation_steps,
        precision=precision, model_precision=own_precision, headroom=float(headroom),
        # The state: read from the reference compile; gradients as large as the
        # trainable weights, at most.
        weight_bytes=reference.weight_bytes, optimizer_bytes=reference.optimizer_bytes,
        trainable_bytes=trainable, gradient_bytes=trainable, accumulator_bytes=accumulators,
        activation_bytes=activation, data_bytes=data, other_bytes=other,
        activations_per_sample=per_sample, activations_fixed=fixed,
        compiled_batches=tuple(batches), extrapolated=extrapolated,
        recommendation=recommendation, largest_batch=largest,
        bf16_activation_bytes=bf16_activation, bf16_total_bytes=bf16_total,
        bf16_recommendation=bf16_recommendation, bf16_largest_batch=bf16_largest,
        notes=(*notes, NOT_MODELLED if not str(more.get("compiler", "")).startswith("XLA:TPU")
               else TPU_NOT_MODELLED), **more)
