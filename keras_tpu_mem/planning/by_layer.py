"""`LayerTable`: where the compiled step's memory goes, one row per Keras layer.

`CompiledMemory.by_layer()` recompiles the step it describes with XLA's buffer
assignment and live ranges written out, and attributes every buffer to a row (the
backend's `compiled_layers`): the layer whose weights, optimizer slots or
activations it holds, "optimizer" (the optimizer's own state: iteration count,
learning rate), "inputs" (the batch) or "unattributed".
"""

from __future__ import annotations

import collections

from keras_tpu_mem import devices

LayerMemory = collections.namedtuple(
    "LayerMemory", ["name", "weights", "optimizer", "saved_activations", "at_peak"])
LayerMemory.__doc__ = """One row of `LayerTable`, bytes per device.

Attributes:
    name: The layer's path inside the model (`"block/attention"`), or "optimizer",
        "inputs", "unattributed".
    weights: The layer's weights at rest.
    optimizer: The optimizer slots of those weights at rest (the "optimizer" row:
        the optimizer's other state).
    saved_activations: The layer's forward buffers still live when the backward
        pass starts: what the forward pass keeps for the gradient.
    at_peak: The row's buffers of any kind live at XLA's peak.
"""


class LayerTable:
    """The memory of one compiled train step by Keras layer, bytes per device.

    Rows are sorted largest first by `at_peak`; the `at_peak` column sums to
    `peak_bytes`, and `peak_bytes + slack_bytes` is the compiled total
    (`CompiledMemory.total_bytes`).

    Attributes:
        rows: `LayerMemory` rows, largest first by `at_peak`.
        peak_bytes: All buffers live at XLA's peak.
        slack_bytes: What the compiled total holds beyond the peak (the packing of
            the temporaries' arena).
        total_bytes: The compiled total.

    Example:

    ```python
    table = ktm.compiled_memory(model, 512).by_layer()
    print(table)                       # one line per layer
    table.top(3)                       # the three largest rows at the peak
    table["wide"].saved_activations    # a row by name
    ```
    """

    def __init__(self, rows, peak_bytes: int, total_bytes: int):
        self.rows = sorted((LayerMemory(name, *values) for name, values in rows.items()),
                           key=lambda r: (-r.at_peak, -r.saved_activations, r.name))
        self.peak_bytes = int(peak_bytes)
        self.total_bytes = int(total_bytes)
        self.slack_bytes = self.total_bytes - self.peak_bytes

    def top(self, n: int) -> list:
        """The `n` largest rows at the peak."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"`n` must be a non-negative int, got {n!r}.")
        return self.rows[:n]

    def __getitem__(self, name: str) -> LayerMemory:
        for row in self.rows:
            if row.name == name:
                return row
        raise KeyError(f"no row {name!r}; rows: {', '.join(r.name for r in self.rows)}")

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def names(self) -> list:
        return [row.name for row in self.rows]

    def table(self, n: int | None = None) -> str:
        fb = devices.format_bytes
        rows = self.rows if n is None else self.top(n)
        width = max([len(r.name) for r in rows] + [5])
        head = (f"{'layer':<{width}}  {'weights':>11}  {'optimizer':>11}  "
                f"{'saved act.':>11}  {'at peak':>11}")
        lines = [f"Memory by layer (per device): peak {fb(self.peak_bytes)} + slack "
                 f"{fb(self.slack_bytes)} = compiled total {fb(self.total_bytes)}", head]
        for r in rows:
            lines.append(f"{r.name:<{width}}  {fb(r.weights):>11}  {fb(r.optimizer):>11}  "
                         f"{fb(r.saved_activations):>11}  {fb(r.at_peak):>11}")
        if n is not None and len(self.rows) > n:
            lines.append(f"... {len(self.rows) - n} more rows")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path=None, top: int | None = 20, title: str | None = None):
        """A horizontal bar chart, one bar per row (largest on top), stacked by kind:
        weights, optimizer slots, saved activations, and what else the row holds at
        the peak. Bytes in MiB per device; needs matplotlib.

        Args:
            path: Where to save it as a PNG (None: not saved).
            top: The most rows drawn, the largest (None: all).
            title: The figure's title (default: the peak and the compiled total).

        Returns:
            The `matplotlib.figure.Figure`.

        Example:

        ```python
        ktm.compiled_memory(model, 512).by_layer().plot("by_layer.png", top=10)
        ```
        """
        from keras_tpu_mem.planning.by_layer_figure import plot

        return plot(self, path, top, title)

    def __repr__(self) -> str:
        return (f"LayerTable({len(self.rows)} rows, peak_bytes={self.peak_bytes}, "
                f"slack_bytes={self.slack_bytes})")
