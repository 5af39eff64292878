"""Helpers for the memory by layer as plans and out-of-memory errors print it (issue 22,
item 2): the small model they plan, a budget its plain step does not fit, the rows read
back from the printed table, and a counter of the by-layer compiles. Imports Keras and
the package only (test_planning_by_layer_text.py and test_planning_oom.py, both
backends)."""

from __future__ import annotations

import re

from planning_models import wide_mlp

from keras_tpu_mem import backends
from keras_tpu_mem.planning import compiled_memory

MIB = 1024**2
BATCH = 1024


def small_model():
    # 128 inputs -> 2 x Dense(256, relu) -> Dense(10): compiles in about a second.
    return wide_mlp(width=256, depth=2, inputs=128)


def budget_for(model) -> str:
    """A capacity the plain step does not fit (60% of its compiled total)."""
    plain = compiled_memory(model, BATCH, hlo_text=False)
    return f"{plain.total_bytes * 0.6 / MIB:.4f}MiB"


def rows_in(text: str) -> dict:
    """`{name: [weights, optimizer, saved act., at peak]}` from a table's text lines."""
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\s*(\S+)\s+((?:[\d.]+ (?:B|KiB|MiB|GiB)\s*){4})$", line)
        if match:
            rows[match.group(1)] = re.findall(r"[\d.]+ (?:B|KiB|MiB|GiB)", match.group(2))
    return rows


_UNITS = {"B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}


def to_bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


def count_dump_compiles(monkeypatch) -> list:
    """Counts the by-layer compiles (each one reads its rows once)."""
    layers = backends.current().compiled_layers
    calls = []
    original = layers.layer_rows

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(layers, "layer_rows", counted)
    return calls


def break_layer_rows(monkeypatch) -> None:
    """Makes every by-layer table fail, as a compile whose dump cannot be read would."""
    def broken(*args, **kwargs):
        raise RuntimeError("no dump here")

    monkeypatch.setattr(backends.current().compiled_layers, "layer_rows", broken)
