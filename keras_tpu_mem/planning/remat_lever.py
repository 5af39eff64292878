"""The search's rematerialisation lever: every layer, or only the largest activation holders.

Where the backend has layer rematerialisation as a lever (`compiled.rematerialize_lever()`),
`plan(..., search=True)` compiles, after a configuration as it is, a few
`Rematerialize(layers=[...])` candidates built from `CompiledMemory.by_layer()` of the
search's first compile — the layers holding the most saved activations — and then
`Rematerialize()` (every layer with weights but the outputs). Each is compiled like every
candidate: which layer's recompute lowers XLA's peak is not a rule (a layer's activations
can be the largest and still not be live at the peak), so the compile decides.

Recompute is measured as the share of the step's saved activations the chosen layers hold
(a chosen layer recomputes the layers nested in it: theirs count too). Targeted candidates
are ordered by increasing share, all before `Rematerialize()`, which is counted as the whole
(it recomputes the forward pass of every layer with weights); the search recommends the
first that fits in that order, so a targeted candidate that fits is preferred to
rematerialising everything.

The search assumes no order of memory between the remat options: recomputing more can need
more (XLA:CPU's compiles of a small encoder: `Rematerialize()` above the targeted options,
and in bfloat16 above no recompute at all), so each option is decided by its own compiles
(`search.search_levers` prunes only along micro-batches and the state split).
`RematLever.record` is the rule an earlier search used to stop compiling a targeted option
that freed nothing; the pruned search does not use it, since an option that frees nothing
at one configuration can free memory at another.
"""

from __future__ import annotations

import collections

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.backends.layer_owners import NOT_LAYERS, layer_paths
from keras_tpu_mem.remat import Rematerialize, output_layers

#: How many of the largest holders are tried alone. Two, because the largest is not always
#: the one whose recompute lowers the peak (where the peak lies in that layer's own backward
#: pass, recomputing it frees nothing), and every candidate costs one compile per
#: micro-batch count, state split and precision the search reaches.
SINGLES = 2
#: Then the largest holders together, as many as hold this share of the saved activations.
COVER = 2 / 3

Target = collections.namedtuple("Target", ["layers", "share"])
Target.__doc__ = """One rematerialisation option of the search.

Attributes:
    layers: The layer names given to `Rematerialize(layers=...)`, a tuple; None for
        `Rematerialize()` (every layer with weights but the outputs).
    share: The share of the step's saved activations recomputed (1.0 for every layer).
"""

#: `Rematerialize()`: every layer with weights but the outputs.
EVERYTHING = Target(None, 1.0)


def _within(path: str, chosen) -> bool:
    return any(path == c or path.startswith(c + "/") for c in chosen)


def targeted(table, model, everything=None) -> list:
    """The targeted candidates for `model` from its `LayerTable`, least recompute first.

    A row can be chosen when it names a layer of `model` whose name is unique in it
    (`Rematerialize` finds layers by name), that is not an output layer (its output feeds
    the loss: nothing is saved for it) and that holds saved activations. Candidates: each of
    the `SINGLES` largest holders alone, then the largest holders together until they hold
    `COVER` of the saved activations; a candidate that repeats another, or that names
    exactly the layers `Rematerialize()` would (`everything`), is dropped.

    Args:
        table: The `LayerTable` of the configuration as it is (`CompiledMemory.by_layer()`).
        model: The model it was compiled for.
        everything: The layer names `Rematerialize()` chooses (None: not compared).

    Returns:
        A list of `Target`s, increasing in `share`.

    Example:

    ```python
    table = ktm.compiled_memory(model, 64).by_layer()
    targeted(table, model)   # [Target(layers=('dense',), share=0.28), ...]
    ```
    """
    # `{path: layer}`, as the rows of `by_layer()` name them (a shared layer by its first path).
    paths = {path: layer for layer, path in layer_paths(model).values()}
    counts = collections.Counter(
        layer.name for layer in keras_compat.flatten_layers(model, include_self=False))
    outputs = output_layers(model)
    layer_rows = [r for r in table if r.name not in NOT_LAYERS]
    total = sum(r.saved_activations for r in layer_rows)
    if total <= 0:
        return []
    eligible = [r for r in sorted(layer_rows, key=lambda r: (-r.saved_activations, r.name))
                if r.saved_activations > 0 and r.name in paths
                and counts[paths[r.name].name] == 1 and id(paths[r.name]) not in outputs]

    def share(chosen) -> float:
        return sum(r.saved_activations for r in layer_rows if _within(r.name, chosen)) / total

    sets = [(r.name,) for r in eligible[:SINGLES]]
    together = []
    for row in eligible:
        if share(together) >= COVER:
            break
        if _within(row.name, together):
            continue
        # A holder that contains chosen ones recomputes them: it replaces them.
        together = [c for c in together if not c.startswith(row.name + "/")] + [row.name]
    if together:
        sets.append(tuple(together))
    skip = {frozenset(everything)} if everything is not None else set()
    out = []
    for chosen in sets:
        names = frozenset(paths[p].name for p in chosen)
        if names in skip:
            continue
        skip.add(names)
        out.append(Target(tuple(paths[p].name for p in chosen), share(chosen)))
    return sorted(out, key=lambda t: t.share)


class RematLever:
    """The rematerialisation options of one search, the targeted ones read once.

    Args:
        model: The model planned.
        available: Whether the backend has rematerialisation as a lever; without it the
            only option is None (nothing recomputed).
    """

    def __init__(self, model, available: bool):
        self.model = model
        self.available = bool(available)
        self.notes = []
        self._targets = None
        self._useless = set()
        self._floor = None

    def options(self, plain_step):
        """None (as it is), then the targeted `Target`s, then `EVERYTHING`.

        Args:
            plain_step: A callable returning the `CompiledStep` of the search's first
                configuration as it is; called only when the first targeted option is
                needed (the lever's one extra compile: its `by_layer()`).
        """
        self._floor = None
        yield None
        if not self.available:
            return
        if self._targets is None:
            self._targets = self._read(plain_step())
        for target in self._targets:
            if target not in self._useless:
                yield target
        yield EVERYTHING

    def record(self, target, total: int) -> bool:
        """Records the compiled total of an option (in the model's own precision) in this
        round of `options`; returns whether it is worth more compiles: False for a
        targeted option no smaller than the option without remat and every targeted one
        before it (it is then no longer yielded by `options`). Not used by
        `plan(search=True)`, whose pruning skips only what a compile has decided."""
        if target is None:
            self._floor = total
            return True
        if target is EVERYTHING or target.layers is None:
            return True
        if self._floor is not None and total >= self._floor:
            self._useless.add(target)
            return False
        self._floor = total
        return True

    def _read(self, step) -> list:
        try:
            table = step.reference.by_layer()
        except (RuntimeError, ValueError, OSError) as err:
            # The table is a refinement: without it the search tries everything, as before.
            self.notes.append(f"rematerialising only the largest activation holders was not "
                              f"tried: the step's memory by layer could not be read ({err}).")
            return []
        everything = [layer.name for layer in Rematerialize().chosen_layers(self.model)]
        return targeted(table, self.model, everything)


__all__ = ["COVER", "EVERYTHING", "SINGLES", "RematLever", "Target", "targeted"]
