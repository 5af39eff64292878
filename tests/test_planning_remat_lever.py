"""The search's targeted rematerialisation lever (planning/remat_lever.py): which layers it
offers from a `LayerTable`, without compiling (hand-made tables; the compiled search is in
test_planning_remat_lever_jax.py). On TensorFlow the lever is absent (no layer remat)."""

from __future__ import annotations

import keras
import pytest

from keras_tpu_mem import backends
from keras_tpu_mem.planning.by_layer import LayerTable
from keras_tpu_mem.planning.memory_plan import Recommendation, candidates_table
from keras_tpu_mem.planning.oom import _callbacks_repr
from keras_tpu_mem.planning.remat_lever import (
    COVER,
    EVERYTHING,
    RematLever,
    Target,
    targeted,
)
from keras_tpu_mem.remat import Rematerialize

MIB = 1024**2


def mlp():
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, name="big")(inputs)
    x = keras.layers.Dense(16, name="mid")(x)
    x = keras.layers.Dense(16, name="small")(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(x))


def table(saved, extra=()):
    """A `LayerTable` whose rows hold `saved` ({row: MiB saved}) and nothing else."""
    rows = {name: [0, 0, mib * MIB, mib * MIB] for name, mib in saved.items()}
    for name in ("optimizer", "inputs", "unattributed", *extra):
        rows.setdefault(name, [0, 0, 0, 0])
    peak = sum(v[3] for v in rows.values())
    return LayerTable(rows, peak, peak)


def test_singles_then_the_holders_covering_most_least_recompute_first():
    # "head" holds the most but is the output layer: never offered. "inputs" is no layer.
    tab = table({"big": 50, "mid": 30, "small": 15, "head": 80, "inputs": 500})
    got = targeted(tab, mlp())
    total = 50 + 30 + 15 + 80
    assert got == [Target(("mid",), 30 / total), Target(("big",), 50 / total),
                   Target(("big", "mid", "small"), 95 / total)]
    # The together candidate stops as soon as it holds COVER of the saved activations.
    got = targeted(table({"big": 70, "mid": 20, "small": 10, "head": 0}), mlp())
    assert got[-1] == Target(("big",), 0.7) and 0.7 >= COVER
    assert len(got) == 2  # big together is big alone: offered once
    assert [t.layers for t in got] == [("mid",), ("big",)]


def test_a_candidate_naming_what_rematerialize_all_would_is_dropped():
    model = mlp()
    everything = [layer.name for layer in Rematerialize().chosen_layers(model)]
    assert sorted(everything) == ["big", "mid", "small"]
    # big and mid hold 60% (< COVER): all three together, which is what everything is.
    got = targeted(table({"big": 30, "mid": 30, "small": 30, "head": 10}), model, everything)
    assert [t.layers for t in got] == [("big",), ("mid",)]
    assert targeted(table({"big": 0, "mid": 0}), model) == []


def attention_model():
    tokens = keras.Input((4, 8))
    x = keras.layers.MultiHeadAttention(2, 4, name="self_a")(tokens, tokens)
    x = keras.layers.MultiHeadAttention(2, 4, name="self_b")(x, x)
    x = keras.layers.Dense(8, name="ffn")(x)
    out = keras.layers.Dense(2, name="head")(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(tokens, out)


def test_nested_rows_count_with_their_parent_and_ambiguous_names_are_skipped():
    model = attention_model()
    # Each attention layer has sub-layers named "query", ...: Rematerialize finds layers by
    # name, so a nested name that is not unique in the model is never offered.
    saved = {"self_a/query": 60, "self_a": 20, "self_b": 10, "ffn": 5, "no_such": 0}
    got = targeted(table(saved), model)
    total = 95
    # self_a recomputes its query projection too: its share holds both rows.
    assert got == [Target(("self_b",), 10 / total), Target(("self_a",), 80 / total)]


def test_lever_absent_where_the_backend_has_no_layer_remat():
    def never():
        raise AssertionError("no table is read without the lever")

    assert list(RematLever(mlp(), available=False).options(never)) == [None]


def test_lever_without_a_table_tries_everything_and_says_why():
    class Step:
        class reference:  # noqa: N801 - a stand-in for a CompiledMemory
            @staticmethod
            def by_layer():
                raise RuntimeError("no dump")

    lever = RematLever(mlp(), available=True)
    assert list(lever.options(lambda: Step)) == [None, EVERYTHING]
    assert len(lever.notes) == 1 and "no dump" in lever.notes[0]


def test_lever_reads_the_table_once():
    calls = []

    class Step:
        class reference:  # noqa: N801
            @staticmethod
            def by_layer():
                calls.append(1)
                return table({"big": 50, "mid": 30, "small": 15})

    lever = RematLever(mlp(), available=True)
    first = list(lever.options(lambda: Step))
    assert first[0] is None and first[-1] == EVERYTHING
    assert [t.layers for t in first[1:-1]] == [("mid",), ("big",), ("big", "mid")]
    assert list(lever.options(lambda: Step)) == first and calls == [1]


def test_a_target_that_frees_nothing_more_is_not_compiled_again():
    class Step:
        class reference:  # noqa: N801
            @staticmethod
            def by_layer():
                return table({"big": 50, "mid": 30, "small": 15})

    lever = RematLever(mlp(), available=True)
    mid, big, both = (Target(("mid",), 30 / 95), Target(("big",), 50 / 95),
                      Target(("big", "mid"), 80 / 95))
    worth = {}
    totals = {None: 100, mid: 90, big: 100, both: 90, EVERYTHING: 95}
    for option in lever.options(lambda: Step):
        worth[option] = lever.record(option, totals[option])
    # big is no smaller than the step without remat, both no smaller than mid alone.
    assert worth == {None: True, mid: True, big: False, both: False, EVERYTHING: True}
    # The next round (more micro-batches, another state split) compiles mid only.
    assert list(lever.options(lambda: Step)) == [None, mid, EVERYTHING]


def test_recommendation_names_the_layers():
    rec = Recommendation(1, 64, 10 * MIB, rematerialize=True, compiled=True,
                         remat_layers=("ffn",))
    assert rec.describe() == "Rematerialize(layers=['ffn'])"
    everything = Recommendation(2, 32, 10 * MIB, rematerialize=True, compiled=True)
    assert everything.describe() == "GradientAccumulation(2) (micro-batch 32) + Rematerialize()"
    text = candidates_table([Recommendation(1, 64, 20 * MIB, compiled=True), rec,
                             everything], 15 * MIB)
    lines = text.splitlines()
    assert " ffn " in lines[3] and lines[3].rstrip().endswith("yes")
    assert " all " in lines[4] and " no " in lines[2]
    (callback,) = rec.callbacks()
    assert isinstance(callback, Rematerialize) and callback.layers == ["ffn"]
    # The out-of-memory error's "pass callbacks=[...]" names them too.
    assert _callbacks_repr(rec, []) == "[Rematerialize(layers=['ffn'])]"
    assert _callbacks_repr(everything, []) == "[GradientAccumulation(2), Rematerialize()]"
    # TensorFlow has no layer remat: the search never offers it, and fit refuses it.
    assert not backends.current("test").compiled.rematerialize_lever()
    with pytest.raises(ValueError, match="JAX"):
        callback.install(mlp())
