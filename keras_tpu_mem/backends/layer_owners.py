"""Which Keras layer holds each variable: the rows of `CompiledMemory.by_layer()` at rest.

Shared by both backends' `compiled_layers` (framework-neutral: Keras only). A weight
belongs to the deepest layer that holds it (a shared layer once, by its first path);
an optimizer slot to the layer of the weight it tracks; the optimizer's other state
(iterations, learning rate) to the "optimizer" row.
"""

from __future__ import annotations

import math

import keras
import numpy as np

from keras_tpu_mem._compat import keras as keras_compat

OPTIMIZER, INPUTS, UNATTRIBUTED = "optimizer", "inputs", "unattributed"
#: The rows of a table that are not layers.
NOT_LAYERS = (OPTIMIZER, INPUTS, UNATTRIBUTED)
_WEIGHTS, _OPTIMIZER = 0, 1


def layer_paths(model) -> dict:
    """`{id(layer): (layer, path)}`, nested layers by their path inside the model; a
    layer reached twice (shared) keeps its first path."""
    paths = {}

    def walk(layer, prefix):
        for sub in keras_compat.flatten_layers(layer, include_self=False, recursive=False):
            if id(sub) in paths or isinstance(sub, keras.layers.InputLayer):
                continue
            path = f"{prefix}/{sub.name}" if prefix else sub.name
            paths[id(sub)] = (sub, path)
            walk(sub, path)

    walk(model, "")
    return paths


def _owners(model, paths) -> dict:
    """`{id(variable): row}`: the deepest layer that holds each weight."""
    owner, depth = {}, {}
    for layer, path in paths.values():
        level = path.count("/")
        for variable in layer.weights:
            if depth.get(id(variable), -1) < level:
                owner[id(variable)], depth[id(variable)] = path, level
    return owner


def _slot_rows(model, owner) -> dict:
    """`{id(optimizer variable): row}`. Keras names a slot after the variable it tracks
    (`add_variable_from_reference`: the variable's path with `_` for `/`, then `_` and
    the slot's name); a variable it tracks none of is the "optimizer" row."""
    prefixes = sorted(((v.path.replace("/", "_") + "_", owner.get(id(v), UNATTRIBUTED))
                       for v in model.trainable_variables), key=lambda p: -len(p[0]))
    rows = {}
    for variable in model.optimizer.variables:
        name = variable.name
        rows[id(variable)] = next((row for prefix, row in prefixes
                                   if name.startswith(prefix)), OPTIMIZER)
    return rows


def _bytes(variable, device_shape) -> int:
    shape = device_shape(variable.shape, variable)
    return int(math.prod(shape)) * np.dtype(keras.backend.standardize_dtype(
        variable.dtype)).itemsize


def rows_at_rest(model, device_shape):
    """`(rows, variable_rows, names)`: every row with its weights and optimizer slots
    at rest filled in (bytes per device, `device_shape` the backend's), the row of each
    variable `{id(variable): row}` (metric state: "unattributed"), and the layer paths
    by layer name `{name: [path, ...]}`."""
    paths = layer_paths(model)
    owner = _owners(model, paths)
    slots = _slot_rows(model, owner)
    rows = {path: [0, 0, 0, 0] for _, path in paths.values()}
    for row in (OPTIMIZER, INPUTS, UNATTRIBUTED):
        rows[row] = [0, 0, 0, 0]
    for variable in {id(v): v for v in model.weights}.values():
        rows[owner.get(id(variable), UNATTRIBUTED)][_WEIGHTS] += _bytes(variable, device_shape)
    for variable in model.optimizer.variables:
        rows[slots[id(variable)]][_OPTIMIZER] += _bytes(variable, device_shape)
    variable_rows = dict(owner)
    variable_rows.update(slots)
    names = {}
    for _, path in paths.values():
        names.setdefault(path.rsplit("/", 1)[-1], []).append(path)
    return rows, variable_rows, names
