"""`LayerTable.plot()`: the memory by layer as a horizontal bar chart, stacked by kind.

matplotlib is imported here only, lazily, through its object API (the Agg canvas,
no pyplot): drawing changes nothing in the user's matplotlib state.
"""

from __future__ import annotations

from keras_tpu_mem import devices

MIB = 1024**2

#: The kinds a bar is stacked from, left to right, with their colours.
KINDS = (
    ("weights", "weights", "tab:blue"),
    ("optimizer", "optimizer slots", "tab:orange"),
    ("saved_activations", "saved activations", "tab:green"),
    ("other_at_peak", "other live at the peak", "tab:gray"),
)


def segments(row) -> dict:
    """A row's bar, bytes by kind: its weights, optimizer slots, saved activations, and
    what else it holds at the peak (`at_peak` beyond those three, never below 0).

    The bar is then the larger of the row's state plus its saved activations (what it
    holds when the backward pass starts) and its `at_peak`.
    """
    other = row.at_peak - row.weights - row.optimizer - row.saved_activations
    return {"weights": row.weights, "optimizer": row.optimizer,
            "saved_activations": row.saved_activations, "other_at_peak": max(0, other)}


def plot(table, path=None, top: int | None = 20, title: str | None = None):
    """Draws `table` (a `LayerTable`): one bar per row, largest on top.

    Args:
        table: The `LayerTable`.
        path: Where to save the figure as a PNG (None: not saved).
        top: The most rows drawn, the largest bars (None: all).
        title: The figure's title (default: the table's peak and compiled total).

    Returns:
        The `matplotlib.figure.Figure`.

    Raises:
        ImportError: matplotlib is not installed (`pip install matplotlib`).
    """
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
        raise ValueError(f"`top` must be None or an int >= 1, got {top!r}.")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("LayerTable.plot() draws with matplotlib: "
                          "`pip install matplotlib`.") from err
    bars = sorted(((row, segments(row)) for row in table.rows),
                  key=lambda item: (-sum(item[1].values()), item[0].name))
    if top is not None:
        bars = bars[:top]
    fig = Figure(figsize=(9, 1.4 + 0.38 * max(len(bars), 1)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    names = [row.name for row, _ in bars]
    positions = list(range(len(bars)))
    left = [0.0] * len(bars)
    for key, label, colour in KINDS:
        widths = [parts[key] / MIB for _, parts in bars]
        ax.barh(positions, widths, left=left, color=colour, label=label, height=0.7,
                gid=key)
        left = [a + b for a, b in zip(left, widths)]
    # Each bar's length at its end, so the numbers read without the grid.
    for y, length in zip(positions, left):
        ax.text(length, y, f" {length:.1f}", va="center", fontsize=8)
    ax.margins(x=0.08)
    ax.set_yticks(positions, names)
    ax.invert_yaxis()  # the largest bar on top
    ax.set_xlabel("MiB per device")
    fb = devices.format_bytes
    shown = "" if top is None or len(table.rows) <= top else \
        f" ({len(bars)} largest of {len(table.rows)} rows)"
    ax.set_title(title or (f"Memory by layer: peak {fb(table.peak_bytes)} of compiled total "
                           f"{fb(table.total_bytes)}{shown}"), fontsize=10)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    if path is not None:
        fig.savefig(str(path))
    return fig
