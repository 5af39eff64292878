"""`precision_report`: which layer computes in which dtype, with the risky spots flagged."""

from __future__ import annotations

import dataclasses

import keras

from keras_tpu_mem.precision.output import Float32Forward
from keras_tpu_mem.precision.policies import (
    LOW_PRECISION,
    all_layers,
    is_graph_container,
    output_layers,
    policy_name,
)

__all__ = ["PrecisionReport", "PrecisionRow", "precision_report"]


@dataclasses.dataclass(frozen=True)
class PrecisionRow:
    """One layer of a `PrecisionReport`.

    Attributes:
        path: The layer's path in the model (`layer.path`, or its name).
        class_name: The layer's class.
        policy: Its dtype policy's name.
        compute_dtype: The dtype it computes in.
        variable_dtype: The dtypes of its own weights (`"-"` if it has none).
        role: `"output"` (produces a model output), `"container"` (a Functional
            or Sequential model) or `"hidden"`.
        flags: Risky spots, as sentences (empty when none).
    """

    path: str
    class_name: str
    policy: str
    compute_dtype: str
    variable_dtype: str
    role: str
    flags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What `precision_report` returns: rows, model-level notes and a printable table."""

    model_name: str
    global_policy: str
    rows: tuple[PrecisionRow, ...]
    notes: tuple[str, ...] = ()

    @property
    def flagged(self) -> list[PrecisionRow]:
        """The rows with at least one flag."""
        return [row for row in self.rows if row.flags]

    def to_string(self) -> str:
        header = ("layer", "class", "policy", "compute", "variables", "role")
        table = [header] + [(r.path, r.class_name, r.policy, r.compute_dtype,
                             r.variable_dtype, r.role) for r in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        lines = [f"Precision report for {self.model_name!r} "
                 f"(global policy: {self.global_policy})"]
        for index, line in enumerate(table):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
            if index and self.rows[index - 1].flags:
                lines.extend(f"    ! {flag}" for flag in self.rows[index - 1].flags)
        counts: dict[str, int] = {}
        for row in self.rows:
            if row.role != "container":
                counts[row.compute_dtype] = counts.get(row.compute_dtype, 0) + 1
        summary = ", ".join(f"{n} {dtype}" for dtype, n in sorted(counts.items()))
        lines.append(f"compute dtypes: {summary}; "
                     f"{sum(len(r.flags) for r in self.rows)} flag(s).")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_string()


def _is_softmax(layer) -> bool:
    if isinstance(layer, keras.layers.Softmax):
        return True
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", None) in ("softmax", "log_softmax")


def precision_report(model) -> PrecisionReport:
    """Every layer's compute and variable dtype, with the risky spots flagged.

    Flags:

    * bfloat16/float16 logits feeding the loss: an output layer (see
      `MixedBFloat16`) computing in low precision;
    * a softmax computing in bfloat16/float16;
    * float16 compute without a `LossScaleOptimizer`;
    * a policy that differs from the global one (`keras.config.dtype_policy()`),
      which layers built later would not share.

    Args:
        model: A Keras model.

    Returns:
        A `PrecisionReport`: `.rows` (one `PrecisionRow` per layer), `.flagged`,
        `.notes`, and `str(report)` a printable table.

    Example:

    ```python
    import keras
    import keras_tpu_mem as ktm

    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(3)])
    print(ktm.precision_report(ktm.to_mixed_bfloat16(model)))
    ```
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"Expected a keras.Model, got {type(model).__name__}.")
    global_policy = keras.config.dtype_policy().name
    outputs = output_layers(model)
    heads = list(outputs or ())
    optimizer = getattr(model, "optimizer", None)
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    rows = []
    for layer in all_layers(model):
        container = is_graph_container(layer)
        compute = layer.compute_dtype
        forward_only = isinstance(layer.__dict__.get("call"), Float32Forward)
        flags = []
        is_head = any(layer is h for h in heads)
        if is_head and compute in LOW_PRECISION:
            flags.append(f"{compute} logits feed the loss: give this layer dtype='float32'")
        if not container and compute in LOW_PRECISION and _is_softmax(layer):
            flags.append(f"softmax in {compute}: compute it in float32")
        if not container and compute == "float16" and not scaled:
            flags.append("float16 compute without a LossScaleOptimizer (gradients may "
                         "underflow)")
        if not container and policy_name(layer) != global_policy:
            flags.append(f"policy differs from the global {global_policy!r}")
        weights = sorted({keras.backend.standardize_dtype(w.dtype) for w in layer.weights})
        role = "container" if container else ("output" if is_head else "hidden")
        if forward_only:
            role = "output (bfloat16 backward)"
        rows.append(PrecisionRow(
            path=getattr(layer, "path", None) or layer.name,
            class_name=type(layer).__name__,
            policy=policy_name(layer),
            compute_dtype=compute,
            variable_dtype=",".join(weights) or "-",
            role=role,
            flags=tuple(flags),
        ))
    notes = []
    if outputs is None:
        notes.append(f"{type(model).__name__} is a subclassed model: its output layers "
                     "cannot be read from a graph, so bfloat16 logits are not checked.")
    return PrecisionReport(model.name, global_policy, tuple(rows), tuple(notes))
