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
from keras_tpu_mem.planning.compiled import Compiler
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


def failing_lines(model, features, memory, unit: str = "replica") -> list:
    """The out-of-memory message's lines: the five largest rows of the step that failed.

    The plan behind the message (`memory`) holds that step's table already where it
    recommended nothing; else the step is compiled once more (its `CompiledMemory`
    comes from the compile cache) for the table. A table that cannot be computed is
    one line saying so.
    """
    if memory.recommendation is None and memory.by_layer is not None:
        table, note = memory.by_layer, None
    else:
        try:
            reference = Compiler(model, what="plan")(memory.compiled_batches[-1], features)
        except Exception as err:  # never hide the out-of-memory error itself
            logger.debug("memory by layer failed", exc_info=True)
            return [f"Memory by layer could not be computed ({type(err).__name__})."]
        table, note = table_of(reference)
    if table is None:
        return [note[0].upper() + note[1:]]
    of = f"the step that failed, per-{unit} batch {memory.compiled_batches[-1]}"
    head, *rows = top_lines(table, of, indent="")
    return [head[0].upper() + head[1:], *rows]


def whole_table_text(model, memory) -> str:
    """`keras-tpu-mem plan --by-layer`: the plan's whole table, under a line naming its
    configuration. An estimate (TensorFlow without callbacks or search) has none: the
    largest batch it compiled is compiled once more for the table of the model's own
    train step there."""
    if memory.by_layer is not None:
        return f"Memory by layer of {memory.by_layer_of}:\n{memory.by_layer}"
    batch = max(memory.compiled_batches)
    table, note = table_of(Compiler(model, what="plan")(batch))
    if table is None:
        return note[0].upper() + note[1:]
    return (f"Memory by layer of the model's train step at per-replica batch {batch} (the "
            "plan above is an estimate; this is the largest batch it compiled, without "
            f"its levers):\n{table}")
