"""`CompiledMemory`: XLA's buffer assignment of one compiled train step, in bytes.

How the buffer assignment maps to the numbers (see docs/planning.md):

* arguments   = sum of allocations with `is_entry_computation_parameter`
* live-out    = sum of allocations with `maybe_live_out`
* aliased     = parameter allocations updated in place (variables: counted in
  arguments and live-out, held once): `is_parameter_aliased_with_output`,
  or the module's `input_output_alias` where the proto lacks that flag (TF 2.19)
* temporaries = every other allocation that is neither thread-local (stack)
  nor constant: XLA's preallocated temp buffer(s), packed by its heap
  simulator, holding activations, gradients and workspace
* total       = arguments + temporaries + live-out - aliased + constants
* laid out    = XLA:TPU only (JAX): the HBM its buffer assignment lays out for the
  step, from its memory-usage report (the default memory space's total: parameters,
  results, the temporaries' arena). XLA:TPU's `temp_size_in_bytes` is not that arena:
  on LoRA steps it exceeds it by 16-33% (XLA:TPU compiled one whose
  `temp_size_in_bytes` alone exceeds the chip), on a small MLP it is 0 where 2.31 MiB
  are laid out (docs/planning.md). The verdicts keep the total

On JAX the same quantities come from `compile().memory_analysis()` (see
`keras_tpu_mem/backends/jax/compiled.py`).
"""

from __future__ import annotations

import dataclasses

from keras_tpu_mem import backends, devices


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's buffer assignment of one compiled train step, in bytes.

    Attributes:
        batch_size: The batch the step was compiled for: from `compiled_memory`
            the global batch, split over `replicas`.
        argument_bytes: Entry parameters: weights, optimizer slots, metric
            state and the batch itself.
        data_bytes: The part of `argument_bytes` that is the batch (x, y).
        temp_bytes: XLA's temporaries: activations kept for the backward pass,
            gradients and fusion workspace, packed by liveness.
        live_out_bytes: Results that outlive the step (updated variables,
            metric values).
        alias_bytes: Parameters updated in place (in both arguments and live-out).
        constant_bytes: Constants baked into the program.
        weight_bytes: Bytes of `model.weights` (for reference).
        optimizer_bytes: Bytes of the optimizer's variables (for reference).
        module_name: The HLO module's name.
        platform: Where the compile ran, e.g. `"CPU"`.
        features: Names of the feature callbacks whose engine step was
            compiled (empty: Keras' own `train_step`).
        micro_batches: Micro-batches per update in that step (1: none).
        accumulator_bytes: The gradient accumulators of the micro-batch loop
            (one per trainable weight, in the weights' dtype), 0 without
            accumulation. They are loop state, so XLA counts them inside
            `temp_bytes`; reported apart so that a plan can name them. With
            micro-batches pulled from the dataset (`pulled`) they are carried from
            step to step, so XLA counts them inside `argument_bytes` instead.
        pulled: Whether the step is the applying step of micro-batches pulled from
            the dataset (`GradientAccumulation(k, dataset_yields="micro_batches")`):
            `batch_size` is then one micro-batch, `micro_batches` of them make an
            update, and the accumulators are arguments.
        hlo_text: The optimized HLO text of the compiled step (which
            collectives, inside which loop), `""` where the reader has none.
        backend: `"tensorflow"` or `"jax"`.
        devices: Devices the step was compiled for (JAX under a
            `keras.distribution`; 1 on TensorFlow, whose compile is one
            replica's); every byte count is one device's.
        replicas: Replicas `batch_size` is split over (the active
            distribution's batch-axis devices on JAX, the model's strategy's
            replicas on TensorFlow); each compiles `batch_size / replicas`.
        compiler: Which compiler answered, e.g. `"XLA:TPU (TPU v5 lite, v5e:4x4, 16
            devices, libtpu 0.0.42.1)"` (a TPU slice compiled ahead of time) or
            `"XLA:CPU (1 device)"` (the host).
        refused: XLA's own message where it refused to compile the step because it
            does not fit the device (XLA:TPU's RESOURCE_EXHAUSTED), else `""`. The
            byte counts are then the state and batch as laid out and, as
            temporaries, the rest of the total XLA said the step required.
        reserved_bytes: HBM per device XLA:TPU's compile left free (a headroom:
            `compiled_memory(headroom=)`, a plan's); 0 for the whole chip or the host.
        capacity_bytes: One device's HBM as XLA:TPU counts it, for a TPU target; 0
            for the host. XLA:TPU schedules a step to fit `capacity_bytes -
            reserved_bytes` where it can, and compiles one that cannot all the same
            while it fits the whole chip: `fits_reserve` tells.
        laid_out_bytes: The HBM per device XLA:TPU's buffer assignment lays out for
            the step (arguments, results and its temporaries' arena, from its
            memory-usage report): the layout XLA:TPU schedules to fit; 0 where the
            compile was not XLA:TPU's. It differs from `total_bytes`, whose
            temporaries are `memory_analysis()`'s; `fits_reserve` uses `total_bytes`.
    """

    batch_size: int
    argument_bytes: int
    data_bytes: int
    temp_bytes: int
    live_out_bytes: int
    alias_bytes: int
    constant_bytes: int
    weight_bytes: int
    optimizer_bytes: int
    module_name: str = ""
    platform: str = "CPU"
    features: tuple[str, ...] = ()
    micro_batches: int = 1
    accumulator_bytes: int = 0
    pulled: bool = False
    hlo_text: str = dataclasses.field(default="", repr=False)
    backend: str = "tensorflow"
    devices: int = 1
    replicas: int = 1
    compiler: str = ""
    refused: str = ""
    reserved_bytes: int = 0
    capacity_bytes: int = 0
    laid_out_bytes: int = 0
    # Recompiles the same step with XLA's buffer assignment written out (set by the
    # Compiler; None on a CompiledMemory built by hand).
    layer_source: object = dataclasses.field(default=None, repr=False, compare=False)

    def by_layer(self):
        """Where this step's memory goes, one row per Keras layer (a `LayerTable`).

        Recompiles the step with XLA's buffer assignment and live ranges written out
        (so `compiled_memory` itself stays one compile) and attributes every buffer to
        the layer whose weights, optimizer slots or activations it holds (JAX: XLA's
        dumped buffer assignment and live ranges; TensorFlow: the `HloProto`'s buffer
        assignment and heap simulator trace).

        Returns:
            A `keras_tpu_mem.planning.by_layer.LayerTable`; `print` it.

        Raises:
            ValueError: this `CompiledMemory` was not made by `compiled_memory`.

        Example:

        ```python
        table = ktm.compiled_memory(model, 512).by_layer()
        print(table.top(5))
        ```
        """
        if self.refused:
            raise ValueError(f"by_layer(): {self.compiler} refused this step "
                             f"({self.refused}); there is no buffer assignment to read.")
        if self.layer_source is None:
            raise ValueError("by_layer() needs a CompiledMemory made by compiled_memory() "
                             "(or plan()), which knows the model and the step.")
        return self.layer_source()

    @property
    def total_bytes(self) -> int:
        """Everything the step holds at once: arguments, temporaries, results."""
        return (
            self.argument_bytes
            + self.temp_bytes
            + self.live_out_bytes
            - self.alias_bytes
            + self.constant_bytes
        )

    @property
    def fits_reserve(self) -> bool:
        """Whether the step fits what its compile left usable (`capacity_bytes -
        reserved_bytes`): not refused, and within it where HBM was reserved."""
        if self.refused:
            return False
        return not self.reserved_bytes or (
            self.total_bytes <= self.capacity_bytes - self.reserved_bytes)

    @property
    def state_bytes(self) -> int:
        """Arguments that are not the batch: weights, optimizer and metric state (and
        the accumulators of pulled micro-batches)."""
        return self.argument_bytes - self.data_bytes

    @property
    def temp_accumulator_bytes(self) -> int:
        """The accumulators among the temporaries: a micro-batch loop's; none for pulled
        micro-batches, whose accumulators are arguments. The rest of the temporaries
        are activations, gradients and workspace."""
        return 0 if self.pulled else self.accumulator_bytes

    def table(self) -> str:
        fb = devices.format_bytes
        accumulators = (f"accumulators {fb(self.accumulator_bytes)} ({self.micro_batches} "
                        f"micro-batches{' pulled' if self.pulled else ''})"
                        if self.accumulator_bytes else "")
        carried = self.accumulator_bytes - self.temp_accumulator_bytes  # arguments
        rows = [
            ("arguments", self.argument_bytes,
             f"weights {fb(self.weight_bytes)}, optimizer {fb(self.optimizer_bytes)}, "
             + (f"{accumulators}, " if self.pulled else "")
             + f"batch {fb(self.data_bytes)}, other state "
             f"{fb(self.state_bytes - self.weight_bytes - self.optimizer_bytes - carried)}"),
            ("temporaries", self.temp_bytes,
             "activations, gradients, workspace"
             + (f"; incl. {accumulators}" if accumulators and not self.pulled else "")),
            ("live-out", self.live_out_bytes,
             f"{fb(self.alias_bytes)} of it aliases arguments (in-place updates)"),
            ("constants", self.constant_bytes, ""),
            ("total", self.total_bytes, "arguments + temporaries + live-out - aliased"),
        ]
        if self.laid_out_bytes:
            rows.append(("laid out", self.laid_out_bytes,
                         "HBM XLA:TPU's buffer assignment lays out (its memory-usage report)"))
        step = (f"the engine's step for {', '.join(self.features)}" if self.features
                else "one train step")
        if self.pulled:
            step += (f" at the last of {self.micro_batches} micro-batches pulled per update "
                     "(the one that applies it)")
        # How the backend that compiled it names one compile's share ("per-replica").
        compiled = backends.get(self.backend).compiled
        if self.replicas > 1:
            batch = (f"global batch {self.batch_size}, {self.batch_size // self.replicas} "
                     f"per {compiled.unit()}")
        elif self.devices > 1:  # a plan's compile at one device's share of the batch
            batch = f"{compiled.table_scope()} batch {self.batch_size}"
        else:
            batch = f"batch {self.batch_size}"
        reserved = (f"; {fb(self.reserved_bytes)} of each device's HBM reserved"
                    if self.reserved_bytes else "")
        head = (f"XLA buffer assignment of {step}, {batch} "
                f"({self.compiler or self.platform + ' compile'}{reserved})")
        lines = [head]
        if self.refused:
            lines.append(f"  refused by XLA: {self.refused}")
        for name, value, note in rows:
            lines.append(f"  {name:<12}{fb(value):>12}  {note}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
