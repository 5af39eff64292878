"""`StateLayout.grad_dims`: a replicated weight's gradient is reduce-scattered as its
own optimizer slots lie, found as the optimizer maps slots to weights, not by shape
(issue 29, defect 7)."""

from __future__ import annotations

import jax
import keras
from jax.sharding import NamedSharding, PartitionSpec

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.backends.jax.layout import make_state_layout


def _two_kernels_of_one_shape():
    model = keras.Sequential([keras.Input((16,)),
                              keras.layers.Dense(16, use_bias=False, name="first"),
                              keras.layers.Dense(16, use_bias=False, name="second")])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _slots_of(weight, optimizer):
    prefix = weight.path.replace("/", "_") + "_"  # Keras' slot names
    return {id(v) for v in optimizer.variables if v.name.startswith(prefix)}


def _layout(specs_by_slot):
    """The layout of the two-kernel model under 8-device data parallelism, weights
    replicated and each optimizer variable laid out by `specs_by_slot(model)`."""
    distribution = keras.distribution.DataParallel(devices=jax.devices()[:8])
    mesh = jax_compat.backend_mesh(distribution.device_mesh)
    with distribution.scope():
        model = _two_kernels_of_one_shape()
    specs = specs_by_slot(model)
    optimizer_shardings = [NamedSharding(mesh, specs.get(id(v), PartitionSpec()))
                           for v in model.optimizer.variables]
    replicated = [NamedSharding(mesh, PartitionSpec()) for _ in model.trainable_variables]
    return make_state_layout(model, (replicated, [], optimizer_shardings, []), distribution)


def test_two_weights_of_one_shape_whose_slots_lie_differently():
    def specs(model):
        first, second = model.trainable_variables
        found = {**{i: PartitionSpec("batch", None) for i in _slots_of(first, model.optimizer)},
                 **{i: PartitionSpec(None, "batch") for i in _slots_of(second,
                                                                      model.optimizer)}}
        assert len(found) == 4  # Adam: a momentum and a velocity each
        return found

    layout = _layout(specs)
    # Matched by shape, both kernels took the layout of whichever slots came first.
    assert layout.weight_dims == [None, None]
    assert layout.grad_dims == [0, 1]


def test_a_weight_without_sharded_slots_is_all_reduced():
    def specs(model):
        first, _ = model.trainable_variables
        return {i: PartitionSpec("batch", None) for i in _slots_of(first, model.optimizer)}

    # Matched by shape, the second kernel took the first one's slots' layout.
    assert _layout(specs).grad_dims == [0, None]
