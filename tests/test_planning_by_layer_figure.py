"""`LayerTable.plot()` (planning/by_layer_figure.py): one horizontal bar per row, largest
on top, stacked by kind, in MiB. The table is built by hand, so the expected bar
lengths are the numbers written here."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from keras_tpu_mem.planning.by_layer import LayerTable  # noqa: E402

MIB = 1024**2
KINDS = ("weights", "optimizer", "saved_activations", "other_at_peak")


def table():
    # name: (weights, optimizer, saved_activations, at_peak), bytes.
    rows = {
        "wide": (8 * MIB, 16 * MIB, 32 * MIB, 40 * MIB),     # other at peak 0 (40 < 56)
        "narrow": (8 * MIB, 16 * MIB, 1 * MIB, 40 * MIB),    # other at peak 15
        "inputs": (0, 0, 0, MIB // 2),                       # other at peak 0.5
        "head": (10240, 20480, 86016, 30720),                # other at peak 0
        "optimizer": (0, 8, 0, 12),
    }
    return LayerTable(rows, peak_bytes=sum(v[3] for v in rows.values()),
                      total_bytes=110 * MIB)


# Bar segments in MiB, largest bar first.
EXPECTED = [
    ("wide", [8, 16, 32, 0]),
    ("narrow", [8, 16, 1, 15]),
    ("inputs", [0, 0, 0, 0.5]),
    ("head", [10240 / MIB, 20480 / MIB, 86016 / MIB, 0]),
    ("optimizer", [0, 8 / MIB, 0, 4 / MIB]),
]


def bars(fig):
    """`{kind: [(y, left, width)]}` read back from the axes' rectangles."""
    ax = fig.axes[0]
    out = {}
    for container in ax.containers:
        kind = container.patches[0].get_gid()
        out[kind] = [(p.get_y() + p.get_height() / 2, p.get_x(), p.get_width())
                     for p in container.patches]
    return ax, out


def test_bar_lengths_are_the_tables_numbers(tmp_path):
    path = tmp_path / "by_layer.png"
    fig = table().plot(path)
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    ax, drawn = bars(fig)
    assert set(drawn) == set(KINDS)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == [name for name, _ in EXPECTED]
    for i, (_, segments) in enumerate(EXPECTED):
        left = 0.0
        for kind, expected in zip(KINDS, segments):
            y, x, width = drawn[kind][i]
            assert y == pytest.approx(i)
            assert width == pytest.approx(expected, abs=1e-9)
            assert x == pytest.approx(left, abs=1e-9)  # stacked left to right
            left += expected
    # Largest on top: the y axis runs downwards.
    assert ax.yaxis_inverted()
    assert ax.get_xlabel() == "MiB per device"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["weights", "optimizer slots", "saved activations",
                      "other live at the peak"]


def test_top_keeps_the_largest_bars_and_says_so():
    fig = table().plot(top=2)
    ax, drawn = bars(fig)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["wide", "narrow"]
    assert all(len(v) == 2 for v in drawn.values())
    assert "2 largest of 5 rows" in ax.get_title()
    assert "2 largest" not in table().plot(top=None).axes[0].get_title()


@pytest.mark.parametrize("top", [0, -1, 2.5, True, "3"])
def test_bad_top_names_the_argument(top):
    with pytest.raises(ValueError, match="`top`"):
        table().plot(top=top)
