"""The layouts a distribution gives a model's state: for `reshard`, and for a plan that
compiles a model as if it were laid out there (`proposed_layouts`)."""

from __future__ import annotations

import contextlib

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import unique
from keras_tpu_mem.sharding.distribution import ShardedDataParallel, reference_weight


def _fresh_layout(distribution, variable):
    # Distributions answer a variable's own layout first (Keras' convention);
    # forget it to ask the new distribution's rules.
    if isinstance(distribution, ShardedDataParallel):
        return distribution.layout_for(variable)
    keras_compat.set_variable_layout(variable, None)
    return distribution.get_variable_layout(variable)


def target_layouts(model, distribution):
    """`(variables, slots, {id(variable): layout})`: the model's variables (weights,
    seeds, metric state), its optimizer's, and the layout `distribution` gives each.

    Under a `ShardedDataParallel` the optimizer's slots are laid out as optimizer
    state (split also with `shard="optimizer"`); under another distribution a slot
    follows its weight, as Keras lays it out. Call it in `distribution.scope()`.
    Only for a distribution other than `ShardedDataParallel` does it clear the
    variables' own layouts (the only way to ask such a distribution's rules).
    """
    optimizer = getattr(model, "optimizer", None)
    slots = unique(optimizer.variables) if optimizer is not None else []
    slot_ids = {id(v) for v in slots}
    variables = [v for v in unique([*model.variables, *model.metrics_variables])
                 if id(v) not in slot_ids]
    layouts = {id(v): _fresh_layout(distribution, v) for v in variables}
    if isinstance(distribution, ShardedDataParallel) and optimizer is not None:
        layouts.update(distribution.slot_layouts(optimizer, model.trainable_variables))
    else:
        for slot in slots:
            weight = reference_weight(slot, model.trainable_variables)
            layouts[id(slot)] = (layouts[id(weight)] if weight is not None
                                 else _fresh_layout(distribution, slot))
    return variables, slots, layouts


@contextlib.contextmanager
def proposed_layouts(model, distribution: ShardedDataParallel):
    """In `distribution`'s scope, its rules lay out `model`'s state for whatever asks
    `get_variable_layout` (a compile), while the variables keep their values and
    layouts: `plan(search=True)` compiles each sharding candidate so.

    Example:

    ```python
    with proposed_layouts(model, ShardedDataParallel()) as distribution:
        compiled_memory(model, 1024)   # per device, as if resharded
    ```
    """
    with distribution.scope():
        _, _, layouts = target_layouts(model, distribution)
        distribution.propose(layouts)
        try:
            yield distribution
        finally:
            distribution.propose({})


__all__ = ["proposed_layouts", "target_layouts"]
