"""`plan()`: a per-replica memory budget built on XLA compiles.

Without `callbacks` (nor `search`) the plan is the estimate here: Keras' own
step compiled at a few batches, its temporaries extrapolated per sample and
scaled for another precision. With them it is `search.compiled_plan`: the
engine's step for those callbacks, compiled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from keras_tpu_mem import backends
from keras_tpu_mem._utils import check_positive_int
from keras_tpu_mem.backends.step import batches_per_update
from keras_tpu_mem.planning.budget import (
    ActivationModel,
    DeviceBudget,
    _normalise_precision,
    check_headroom,
    divisors,
    largest_batch,
    model_precision,
    resolve_device,
    usable_bytes,
)
from keras_tpu_mem.planning.compiled import Compiler, check_callbacks
from keras_tpu_mem.planning.memory_plan import (
    MemoryPlan,
    Recommendation,
    assemble,
    lever_callbacks,
)
from keras_tpu_mem.planning.search import MAX_COMPILE_BATCH, compiled_plan
from keras_tpu_mem.planning.specs import _spec_bytes, _unique, _variable_bytes
from keras_tpu_mem.planning.target import reserve_note, slice_budget
from keras_tpu_mem.planning.target import resolve as resolve_target

# Per-replica batches planned by compiling them directly: at most this.
_MAX_DIRECT_BATCH = 64
# Batches compiled to extrapolate larger ones. XLA's temp bytes are not
# linear at the smallest batches (a digits MLP's temporaries jump 5x from
# batch 1 to 2 and grow at half their later per-sample rate up to batch 32:
# kernels and fusions change), but grow linearly from a few dozen rows on, so
# the slope comes from two batches there.
_DEFAULT_COMPILE_BATCHES = (32, 64)
_HOST_COPY_NOTE = ("compiled on a host copy of the model (it was built under a "
                   "tf.distribute strategy).")
# A middle point further than this from the line through its neighbours
# gets a note in the plan.
_LINEARITY_TOLERANCE = 0.05


def _recommend(per_replica, budget, fixed_state, trainable, act, data, other):
    for k in divisors(per_replica):
        micro = per_replica // k
        accum = trainable if k > 1 else 0
        total = int(fixed_state + accum + act(micro) + data + other)
        if total <= budget:
            return Recommendation(k, micro, total)
    return None


def _bf16_estimate(act: ActivationModel, trainable_bytes: int) -> ActivationModel:
    """Temporaries under mixed_bfloat16, estimated from a float32 compile.

    Activations (the per-sample part) are stored in bfloat16: half the bytes.
    The batch-independent part (gradients, which stay float32 because the
    variables do, and workspace) is kept, plus a bfloat16 copy of the weights,
    which Keras' autocast makes for the forward and backward pass. This is
    what a TPU computes natively; XLA on the host CPU keeps many bfloat16
    intermediates in float32, so a CPU compile of a bf16 model shows more.
    """
    return act.scaled(0.5, trainable_bytes / 2)


def _validate_plan_args(global_batch_size, headroom, accumulation_steps, compile_batches):
    check_positive_int(global_batch_size, "global_batch_size")
    check_headroom(headroom)
    if accumulation_steps is not None:
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
            raise TypeError(
                "`accumulation_steps` must be None or an int >= 1, got "
                f"{accumulation_steps!r}."
            )
        if accumulation_steps < 1:
            raise ValueError(
                f"`accumulation_steps` must be None or an int >= 1, got {accumulation_steps}."
            )
    if compile_batches is not None:
        if not isinstance(compile_batches, Sequence) or not compile_batches:
            raise TypeError(
                "`compile_batches` must be None or a non-empty sequence of positive ints, "
                f"got {compile_batches!r}."
            )
        for b in compile_batches:
            check_positive_int(b, "compile_batches[i]")


def _device_for(device) -> DeviceBudget:
    """`device` resolved; under an active distribution (JAX: a `keras.distribution` whose
    batch axis spans several devices) its replica count is the distribution's."""
    shards = backends.current("plan").compiled.compile_shards()
    return resolve_device(device, shards if shards > 1 else None)


def _per_replica_batch(global_batch_size: int, budget_device) -> int:
    """The per-replica batch, or a ValueError when the global batch does not split evenly."""
    replicas = budget_device.replicas
    if global_batch_size % replicas:
        raise ValueError(
            f"`global_batch_size` {global_batch_size} does not split evenly over the "
            f"{replicas} replicas of {budget_device.name}; use a multiple of {replicas}."
        )
    return global_batch_size // replicas


def plan(
    model,
    global_batch_size: int,
    *,
    device="v3-8",
    accumulation_steps: int | None = None,
    precision: str | None = None,
    headroom: float = 0.10,
    compile_batches: Sequence[int] | None = None,
    x_spec=None,
    y_spec=None,
    progress: Callable[[int, int, int | None], None] | None = None,
    callbacks=None,
    search: bool = False,
    max_compile_batch: int = MAX_COMPILE_BATCH,
    sample_batch=None,
    by_layer: bool = True,
    compiler: str = "auto",
    mesh: dict | None = None,
) -> MemoryPlan:
    """Plans one replica's memory for training `model` at `global_batch_size`.

    Weights and optimizer slots are counted from the model's variables (the
    optimizer is built if it is not yet). Activations are XLA's temporaries of
    the compiled train step (see `compiled_memory`) at the per-replica
    micro-batch: compiled directly when that batch is at most 64, else
    extrapolated per sample from compiles at `compile_batches` (default 32 and
    64: XLA's temp bytes are not linear at the smallest batches, which is why
    1 and 2 are not the default). With `accumulation_steps=k` the step
    holds the activations of one micro-batch (per-replica batch / k) plus one
    set of gradient accumulators as large as the trainable weights, as
    `ktm.GradientAccumulation` does.

    Args:
        model: A compiled `keras.Model` (built under any strategy, or none).
        global_batch_size: Examples per step over all replicas.
        device: A TPU type (`"v3-8"`, `"v4-32"`, `"v5litepod-16"`: capacity per
            replica from `ktm.HBM_TABLE`), a size (`"12GiB"`, `"16GB-4"`), or a
            `DeviceBudget`. Under an active distribution (JAX) the replicas are
            its batch-axis devices: a size without a count takes them, a
            device naming another count is a ValueError.
        accumulation_steps: Micro-batches per replica step (None or 1: none).
            Must divide the per-replica batch.
        precision: None (as the model is), `"float32"` or `"mixed_bfloat16"`;
            a precision other than the model's is estimated by scaling the
            per-sample activations (x0.5 to bf16, x2 to float32), weights,
            gradients and slots unchanged (mixed_bfloat16 keeps float32
            variables).
        headroom: Fraction of capacity kept free for what the plan does not
            model (TPU layout padding, fragmentation, runtime buffers).
        compile_batches: Batches to compile for the extrapolation (more
            compile time for big models is spent here; e.g. `(1, 2)` for a
            model whose every example is already a long sequence).
        x_spec, y_spec: Data specs where the model cannot tell (see
            `compiled_memory`).
        sample_batch: Instead of specs, one batch as `fit` takes it (x,
            `(x, y)` or `(x, y, sample_weight)`, any batch size) whose arrays'
            shapes past the batch axis and dtypes define them (see
            `compiled_memory`); for models with unknown sequence lengths.
        progress: Optional callable `progress(done, total, batch_size)`, for
            long compiles: called before each XLA compile with the compiles
            finished so far, the number planned and the batch about to be
            compiled, and once after the last with `done == total` and
            `batch_size=None`. `keras-tpu-mem plan` prints a line from it.
        callbacks: The callbacks you pass to `fit`. Given (even `[]`), the plan
            is built on compiles of **the engine's step for them** (see
            `compiled_memory(..., callbacks=...)`): compiled at the
            per-replica batch up to `max_compile_batch`, extrapolated per
            sample from two compiles below it only beyond. `accumulation_steps`,
            `precision` and `compile_batches` are then refused: the callbacks
            say it (`GradientAccumulation`, `MixedBFloat16`).
        search: Also search the levers: compile gradient accumulation
            (divisors of the per-replica batch), bfloat16 compute and
            rematerialisation (`ktm.Rematerialize`, where the backend supports
            it: first of the layers `by_layer()` names as the largest
            activation holders, then of every layer), cheapest first (fewest
            micro-batches, then least recomputation), and recommend the first
            that fits, with its
            compiled bytes; `plan.recommendation.callbacks()` realises it and
            `plan.candidates` lists what was tried (printed as a table). Other
            feature callbacks (distillation, pruning) stay in every candidate.
        max_compile_batch: The largest per-replica batch compiled directly
            (with `callbacks` or `search`).
        compiler: Which XLA answers. `"auto"` (default): XLA:TPU when `device`
            names a TPU slice (`"v5e-16"`, `"v3-8"`, `"v6e-64"`) and libtpu is
            installed (`pip install "keras-tpu-mem[tpu-plan]"`; no TPU needed: the
            step is compiled ahead of time for that slice, nothing runs), else the
            host's XLA:CPU with a note naming the install. `"tpu"`: XLA:TPU or a
            ValueError saying why not. `"host"`: XLA:CPU. `MemoryPlan.compiler`
            says which answered. On the slice the model's state is laid out as its
            distribution lays it out on the host (none or `DataParallel`: batch over
            every device; `ShardedDataParallel`: the same split; a `ModelParallel`
            LayoutMap: its non-batch axes keep their sizes, the batch axis takes
            the rest), its capacity is the HBM XLA:TPU counts per device, and a step
            XLA:TPU refuses (RESOURCE_EXHAUSTED) is "does not fit" with its figures.
        mesh: Axis sizes of the slice's mesh, e.g. `{"batch": 4, "model": 4}`,
            instead of the rule above (XLA:TPU only).
        by_layer: Where the plan compiles the step, also compile the
            configuration it reports (the recommendation, else the planned
            step) once more for its memory by Keras layer: `MemoryPlan.by_layer`,
            whose five largest rows the plan's text shows. False skips that
            compile (`by_layer` is then None).

    Example:

    ```python
    p = ktm.plan(model, 4096, device="v3-8", search=True)
    print(p)                                   # the plan and the candidates tried
    model.fit(ds, callbacks=p.recommendation.callbacks())
    ```

    Returns:
        A `MemoryPlan`; `print` it for the table and the recommendation (and, for a
        compiled plan, the five largest rows of its memory by layer).

    Raises:
        ValueError / TypeError for bad arguments, naming what is accepted.
    """
    _validate_plan_args(global_batch_size, headroom, accumulation_steps, compile_batches)
    if not isinstance(search, bool):
        raise TypeError(f"`search` must be True or False, got {search!r}.")
    if not isinstance(by_layer, bool):
        raise TypeError(f"`by_layer` must be True or False, got {by_layer!r}.")
    check_positive_int(max_compile_batch, "max_compile_batch")
    if compiler == "tpu" and not backends.current("plan").compiles_for_tpu():
        # TensorFlow: the same Keras model's JAX lowering, compiled by XLA:TPU in a JAX
        # subprocess (`jax_lowering`).
        from keras_tpu_mem.planning.jax_lowering import plan_with_jax

        return plan_with_jax(
            model, global_batch_size, device=device, accumulation_steps=accumulation_steps,
            precision=precision, headroom=headroom, x_spec=x_spec, y_spec=y_spec,
            callbacks=callbacks, search=search, max_compile_batch=max_compile_batch,
            sample_batch=sample_batch, by_layer=by_layer, mesh=mesh)
    target, target_note = resolve_target(device, compiler, "plan", mesh)
    if target is not None and callbacks is None and not search:
        # XLA:TPU answers about the step it compiles: no estimate.
        callbacks = _levers_for(model, accumulation_steps, precision, compile_batches)
        accumulation_steps = precision = None
    if callbacks is None and not search and not backends.current("plan").compiled.estimates():
        # No estimate here (JAX compiles are cheap, and its small-batch compiles
        # do not extrapolate): the step is compiled at the plan's batch, with the
        # levers the arguments name.
        callbacks = _levers_for(model, accumulation_steps, precision, compile_batches)
        accumulation_steps = precision = None
    if callbacks is not None or search:
        return _plan_on_compiles(model, global_batch_size, device, callbacks, search,
                                 accumulation_steps, precision, headroom, compile_batches,
                                 x_spec, y_spec, progress, max_compile_batch, sample_batch,
                                 by_layer, target, target_note)
    budget_device = _device_for(device)
    wanted_precision = _normalise_precision(precision)
    replicas = budget_device.replicas
    per_replica = _per_replica_batch(global_batch_size, budget_device)
    k = accumulation_steps or 1
    if per_replica % k:
        raise ValueError(
            f"`accumulation_steps`={k} must divide the per-replica batch {per_replica} "
            f"(global {global_batch_size} / {replicas} replicas); divisors: "
            f"{', '.join(map(str, divisors(per_replica)))}."
        )
    micro = per_replica // k

    compiler = Compiler(model, x_spec, y_spec, what="plan", sample_batch=sample_batch)
    if compile_batches is not None:
        batches = sorted(set(compile_batches))
    elif micro <= _MAX_DIRECT_BATCH:
        batches = sorted({micro, *_DEFAULT_COMPILE_BATCHES})
    else:
        batches = list(_DEFAULT_COMPILE_BATCHES)
    if progress is not None and not callable(progress):
        raise TypeError(f"`progress` must be None or a callable, got {progress!r}.")
    results = []
    with compiler.targeting():
        for done, batch in enumerate(batches):
            if progress is not None:
                progress(done, len(batches), batch)
            results.append(compiler(batch))
    if progress is not None:
        progress(len(batches), len(batches), None)
    act = ActivationModel(tuple((r.batch_size, r.temp_bytes) for r in results))
    ref = results[-1]
    own_precision = model_precision(compiler.user_model)
    precision_used = wanted_precision or own_precision
    trainable = _variable_bytes(_unique(compiler.user_model.trainable_weights))
    notes = []
    if precision_used != own_precision:
        to_bf16 = precision_used == "mixed_bfloat16"
        act = _bf16_estimate(act, trainable) if to_bf16 else act.scaled(2.0, -trainable / 2)
        notes.append(
            f"{precision_used} estimated from the {own_precision} compile (per-sample "
            f"activations x{0.5 if to_bf16 else 2.0:g}, a bfloat16 copy of the weights "
            f"{'added' if to_bf16 else 'removed'}); compile a {precision_used} model "
            "for XLA's own numbers."
        )
    err = act.linearity_error()
    if err is not None and err > _LINEARITY_TOLERANCE:
        notes.append(
            f"XLA temp bytes are not linear over batches {batches[-3:]} (middle point "
            f"{err:.0%} off the line); the extrapolation is less certain."
        )
    if compiler.copied:
        notes.append(_HOST_COPY_NOTE)

    weights = ref.weight_bytes
    optimizer = ref.optimizer_bytes
    other = (ref.state_bytes - weights - optimizer) + (ref.live_out_bytes - ref.alias_bytes) \
        + ref.constant_bytes
    other = max(0, int(other))
    data_bytes = _spec_bytes(compiler.specs(per_replica))
    accum = trainable if k > 1 else 0
    activation = int(round(act(micro)))
    usable = usable_bytes(budget_device.capacity_bytes, headroom)
    state = weights + optimizer
    recommendation = _recommend(per_replica, usable, state, trainable, act, data_bytes, other)

    per_sample_data = data_bytes / per_replica
    largest = largest_batch(usable, state, act, per_sample_data, other)
    bf16_act = bf16_total = bf16_rec = bf16_largest = None
    if precision_used == "float32":
        bf16_model = _bf16_estimate(act, trainable)
        bf16_act = int(round(bf16_model(micro)))
        bf16_total = state + accum + bf16_act + data_bytes + other
        bf16_rec = _recommend(per_replica, usable, state, trainable, bf16_model,
                              data_bytes, other)
        bf16_largest = largest_batch(usable, state, bf16_model, per_sample_data, other)
    return assemble(budget_device, global_batch_size, per_replica, k, ref,
                    headroom=headroom, precision=precision_used, own_precision=own_precision,
                    trainable=trainable, accumulators=accum, activation=activation,
                    data=data_bytes, other=other,
                    activations=(act.per_sample_bytes, act.fixed_bytes), batches=batches,
                    extrapolated=micro not in batches, recommendation=recommendation,
                    largest=largest, notes=notes,
                    bf16=(bf16_act, bf16_total, bf16_rec, bf16_largest), compiler=ref.compiler)


def _levers_for(model, accumulation_steps, precision, compile_batches) -> list:
    """The callbacks that realise an estimate's arguments, for a compiled plan."""
    if compile_batches is not None:
        raise ValueError(
            "plan: `compile_batches` picks the batches the TensorFlow estimate extrapolates "
            f"from; on {backends.current('plan').label} the plan compiles the step at its "
            "own batch: leave `compile_batches` out.")
    own = model_precision(model)
    wanted = _normalise_precision(precision) or own
    if wanted != own and wanted != "mixed_bfloat16":
        raise ValueError(
            f"plan: `precision`={precision!r} for a model that computes in {own}: on "
            f"{backends.current('plan').label} the plan compiles the model as it is built; "
            "build it in float32 to plan float32.")
    return lever_callbacks(accumulation_steps or 1, wanted != own, False)


def _plan_on_compiles(model, global_batch_size, device, callbacks, search, accumulation_steps,
                      precision, headroom, compile_batches, x_spec, y_spec, progress, cap,
                      sample_batch=None, by_layer=True, target=None, target_note=None):
    """`plan(..., callbacks=...)` / `plan(..., search=True)`: see `search.compiled_plan`."""
    for name, value in (("accumulation_steps", accumulation_steps), ("precision", precision),
                        ("compile_batches", compile_batches)):
        if value is not None:
            raise ValueError(
                f"plan: `{name}` is for the estimate without callbacks; with `callbacks` "
                "(or `search=True`) the compiled step says it: pass "
                "ktm.GradientAccumulation(k) / ktm.MixedBFloat16() in `callbacks`.")
    if progress is not None and not callable(progress):
        raise TypeError(f"`progress` must be None or a callable, got {progress!r}.")
    features = check_callbacks(callbacks, "plan")
    if search and batches_per_update(features) > 1:
        raise ValueError(
            "plan: search=True varies how the global batch is split into micro-batches, "
            "and with GradientAccumulation(dataset_yields='micro_batches') the dataset "
            "splits it. Plan the pulled step without search, or search with "
            "GradientAccumulation(k) (dataset_yields='global_batches') at the batch of "
            "one update.")
    notes = [] if target_note is None else [target_note]
    # On JAX per replica = per data-parallel shard of the active distribution,
    # and every byte count is one device's (see `Compiler.__call__`).
    if target is not None:
        # XLA:TPU schedules to the HBM it is given: the headroom is reserved in its
        # compiles, so that what it compiles fits the usable part (`tpu_topology`).
        target = target.with_headroom(headroom)
        if target.reserved_bytes:
            notes.append(reserve_note(target, headroom, "plan"))
    compiler = Compiler(model, x_spec, y_spec, what="plan", sample_batch=sample_batch,
                        target=target)
    if compiler.copied:
        notes.append(_HOST_COPY_NOTE)
    wrapped = None
    if progress is not None:
        def wrapped(done, total, batch):
            progress(done, done + (batch is not None), batch)
    with compiler.targeting():
        budget_device = (_device_for(device) if target is None
                         else slice_budget(target, compiler.replicas))
        per_replica = _per_replica_batch(global_batch_size, budget_device)
        return compiled_plan(compiler, features, budget_device=budget_device,
                             global_batch_size=global_batch_size, per_replica=per_replica,
                             headroom=headroom, search=search, cap=cap, progress=wrapped,
                             notes=notes, by_layer=by_layer)
