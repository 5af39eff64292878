"""The memory by layer where a plan or an out-of-memory error reports a configuration.

A compiled plan (`plan(..., callbacks=...)`, `plan(..., search=True)`, and on JAX
`plan` without them) keeps the `LayerTable` of the configuration it reports — the
recommendation, or the planned step where none was recommended — as
`MemoryPlan.by_layer`, computed once for that configuration (one more compile,
with XLA's buffer assignment written out), never for every search candidate.
"""

from __future__ import annotations

import textwrap

from keras_tpu_mem._utils import logger
from keras_tpu_mem.planning.sharding_lever import compiling_under

#: The rows a plan's text and an out-of-memory message show.
TOP = 5


def table_of(memory, under=None):
    """`(memory.by_layer(), None)`, or `(None, one line saying why not)`.

    Args:
        memory: The `CompiledMemory` of the configuration.
        under: A context manager factory the compile runs in (the search's sharding
            lever: the state laid out as the candidate's distribution would), or None.
    """
    try:
        if under is None:
            return memory.by_layer(), None
        with under():
            return memory.by_layer(), None
    except Exception as err:  # the table adds to a plan or an error; it never hides them
        logger.debug("memory by layer failed", exc_info=True)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return None, (f"memory by layer could not be computed ({type(err).__name__}"
                      + (f": {first}" if first else "") + ").")


def plan_table(model, step_reference, recommendation, reference, active):
    """The table a compiled plan reports: `(table, of, note)`.

    Args:
        model: The model planned (the user's).
        step_reference: The recommended candidate's `CompiledMemory` (None: none).
        recommendation: The search's `Recommendation` (None: none fits, or no search).
        reference: The planned step's `CompiledMemory`.
        active: The distribution active when planning (None: none).
    """
    if recommendation is not None and step_reference is not None:
        def under():
            return compiling_under(model, recommendation.compiled_under, active)

        table, note = table_of(step_reference, under)
        of = (f"the recommendation ({recommendation.describe()}), per-replica batch "
              f"{step_reference.batch_size}")
    else:
        table, note = table_of(reference)
        of = f"the planned step, per-replica batch {reference.batch_size}"
    return table, of, note


def top_lines(table, of: str, indent: str = "  ", n: int = TOP, whole: str = "") -> list:
    """The `n` largest rows at the peak, indented, under a line naming the configuration."""
    head = f"{indent}memory by layer of {of} ({n} largest at the peak{whole}):"
    body = textwrap.indent(table.table(n), indent + "  ")
    return [head, *body.splitlines()]
