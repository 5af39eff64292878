"""`ShardedDataParallel`: data parallelism whose model state is split over the data axis.

A `keras.distribution.ModelParallel` whose layouts come from a rule instead
of a regex `LayoutMap`: every variable is split along its largest dimension
that the data axis divides (`keras_tpu_mem.sharding.rule.shard_dim`). The
batch is split over the same axis, as `DataParallel` splits it. XLA's SPMD
partitioner then gathers a weight where the step uses it and reduces its
gradient to the weight's slices.

Optimizer slots: Keras creates them with their weight's layout and never asks
the distribution (only `iteration` and `learning_rate` go through
`get_variable_layout`). The distribution therefore notes the optimizer that
creates its `iteration` under it (the caller of the Keras name scope the
variable is created in) and wraps that optimizer's `build`
(`watch_optimizer`), so that the slots are created in their own layout
(with `shard="optimizer"` split although their weight is replicated) and
every optimizer variable is laid out after it (`lay_out_optimizer`). `fit`
builds the optimizer before it compiles the step, so the step takes the
slots as laid out.
"""

from __future__ import annotations

import weakref

import keras
import numpy as np

from keras_tpu_mem import backends
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import logger
from keras_tpu_mem.backends.contracts import ShardedStateUnavailable
from keras_tpu_mem.backends.mesh import axis_size
from keras_tpu_mem.devices.units import dtype_bytes
from keras_tpu_mem.engine.core import engage
from keras_tpu_mem.sharding.rule import (
    check_min_shard_bytes,
    check_shard,
    has_divisible_dim,
    shard_dim,
)

_WHAT = "ShardedDataParallel"
# Optimizers whose `build` already lays out their slots (one wrapper each).
_WATCHED = weakref.WeakSet()


def sharding_concern(what: str):
    """The backend's `sharding` concern, once the backend is known to lay model state
    out over devices (`Backend.shards_state`).

    Raises:
        ShardedStateUnavailable: (a `RuntimeError`) on a backend that does not, naming
            `what` and JAX.
    """
    backend = backends.current(what)
    if not backend.shards_state():
        raise ShardedStateUnavailable(what)
    return backend.sharding


def _names(axis) -> tuple:
    if axis is None:
        return ()
    return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


class ShardedDataParallel(keras.distribution.ModelParallel):
    """Data parallelism with weights and optimizer state split over the data devices.

    The batch is split over the data axis as `keras.distribution.DataParallel`
    splits it, and so is the model state (FSDP / ZeRO): each variable along
    its largest dimension the axis size divides (a tie goes to the first
    such dimension). Nothing to write per model: no regex. Variables no
    dimension of which divides the axis stay replicated and are named once
    in a log line.

    With a `layout_map` (a `keras.distribution.LayoutMap` on a mesh that has
    `axis_name`, e.g. `("batch", "model")`), its rules are kept where they
    match a variable, and a dimension they leave whole is also split over
    the data axis where one divides (so every variable's state is split over
    the data devices, on top of the user's model-axis split); variables they
    do not match follow the rule alone.

    Works as Keras' own distributions do: build and compile the model in
    `distribution.scope()` or after `keras.distribution.set_distribution`;
    a model loaded with `keras.models.load_model` in the scope is laid out
    the same way. Create the optimizer in the scope too (as a string in
    `compile`, or constructed there), so its slots are laid out when it is
    built. `keras_tpu_mem.sharding.reshard` moves a model built elsewhere.

    Args:
        devices: The devices of the data axis (`jax.Device`s or Keras device
            strings such as `"cpu:0"`); default: every device
            (`keras.distribution.list_devices()`). Not with `layout_map`,
            whose mesh names the devices.
        shard: `"all"` (weights and optimizer slots, FSDP / ZeRO-3),
            `"optimizer"` (only the optimizer's slots; weights replicated,
            ZeRO-1) or `None` (nothing: `DataParallel`).
        layout_map: Optional `keras.distribution.LayoutMap` whose mesh has an
            axis called `axis_name`.
        axis_name: The mesh axis the batch and the state are split over.
        min_shard_bytes: Variables smaller than this stay replicated (their
            slices would cost more in collectives than they save).
        auto_shard_dataset: As in Keras' distributions (several processes).

    Attributes:
        shard, axis_name, min_shard_bytes: As given.
        axis_size: Devices on the data axis.

    Example:

    ```python
    import keras
    from keras_tpu_mem.sharding import ShardedDataParallel

    distribution = ShardedDataParallel()          # every device, shard="all"
    with distribution.scope():
        model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024),
                                  keras.layers.Dense(16)])
        model.compile(optimizer="adam", loss="mse")
    model.layers[0].kernel.value.sharding.spec    # PartitionSpec(None, 'batch')
    ```
    """

    def __init__(self, devices=None, *, shard="all", layout_map=None, axis_name="batch",
                 min_shard_bytes=0, auto_shard_dataset=True):
        concern = sharding_concern(_WHAT)
        check_shard(shard)
        check_min_shard_bytes(min_shard_bytes)
        if not isinstance(axis_name, str) or not axis_name:
            raise TypeError(f"`axis_name` must be a non-empty string, got {axis_name!r}.")
        if layout_map is not None:
            if not isinstance(layout_map, keras.distribution.LayoutMap):
                raise TypeError("`layout_map` must be a keras.distribution.LayoutMap or "
                                f"None, got {type(layout_map).__name__}.")
            if devices is not None:
                raise ValueError("Pass `devices` or `layout_map`, not both: the layout "
                                 "map's mesh names the devices.")
            mesh = layout_map.device_mesh
            if mesh is None or axis_name not in mesh.axis_names:
                names = None if mesh is None else tuple(mesh.axis_names)
                raise ValueError(f"`axis_name`={axis_name!r} must name an axis of "
                                 f"`layout_map`'s mesh, whose axes are {names}.")
        else:
            devices = keras.distribution.list_devices() if devices is None else devices
            if np.asarray(devices, dtype=object).size == 0:
                raise ValueError("`devices` must list at least one device, got none.")
            # Device objects, not the names `list_devices()` gives: code that
            # reads the mesh's devices (monitors, the compiled step) needs them.
            devices = np.asarray(concern.resolve_devices(devices), dtype=object)
            mesh = keras.distribution.DeviceMesh((devices.size,), (axis_name,), devices)
            layout_map = keras.distribution.LayoutMap(mesh)
        super().__init__(layout_map=layout_map, batch_dim_name=axis_name,
                         auto_shard_dataset=auto_shard_dataset)
        self.shard = shard
        self.axis_name = axis_name
        self.min_shard_bytes = min_shard_bytes
        self.axis_size = axis_size(mesh, axis_name)
        self._pending = {}     # replicated variables not yet logged: path -> shape
        self._reported = set()
        self._proposed = {}    # id(variable) -> layout while a plan compiles (`propose`)

    # ------------------------------------------------------------------ layouts
    def axes_for(self, path, shape, dtype, *, optimizer_state: bool = False) -> tuple:
        """The mesh axis of each dimension of a variable (None: whole), by the rules.

        Args:
            path: The variable's path (matched against `layout_map`).
            shape, dtype: The variable's.
            optimizer_state: An optimizer slot (split also with
                `shard="optimizer"`).
        """
        shape = tuple(int(d) for d in shape)
        user = self._layout_map[path] if len(self._layout_map) else None
        axes = list(user.axes) if user is not None else [None] * len(shape)
        if len(axes) != len(shape):
            return tuple(axes)  # the user's rule is Keras' to check
        split = self.shard == "all" or (self.shard == "optimizer" and optimizer_state)
        if not split or any(self.axis_name in _names(a) for a in axes):
            return tuple(axes)
        taken = {i for i, a in enumerate(axes) if a is not None}
        dim = shard_dim(shape, dtype_bytes(dtype), self.axis_size, self.min_shard_bytes, taken)
        if dim is not None:
            axes[dim] = self.axis_name
        elif shape and self.axis_size > 1 and not has_divisible_dim(shape, self.axis_size,
                                                                     taken):
            self._note_replicated(path, shape)
        return tuple(axes)

    def layout_for(self, variable, *, optimizer_state: bool = False):
        """The `TensorLayout` the rules give `variable` (ignoring any layout it has)."""
        axes = self.axes_for(variable.path, variable.shape, variable.dtype,
                             optimizer_state=optimizer_state)
        return keras.distribution.TensorLayout(axes, self.device_mesh)

    def get_variable_layout(self, variable):
        proposed = self._proposed.get(id(variable))
        if proposed is not None:
            return proposed
        existing = keras_compat.variable_layout(variable)
        if existing is not None:
            return existing
        optimizer = self._creating_optimizer()
        if optimizer is not None:
            watch_optimizer(optimizer)
        return self.layout_for(variable, optimizer_state=optimizer is not None)

    def propose(self, layouts: dict) -> None:
        """Answers `get_variable_layout` from `layouts` (`{id(variable): layout}`)
        first, whatever layouts the variables carry, until `propose({})`: a plan
        compiles a model built elsewhere as if it were laid out here, without
        moving it (`sharding.layouts.proposed_layouts`)."""
        self._proposed = dict(layouts)

    def cache_key(self) -> tuple:
        """What the layouts it gives depend on: a compile cache's key (an object's id
        can be reused by a later distribution)."""
        mesh = self.device_mesh
        rules = tuple(self._layout_map.keys()) if len(self._layout_map) else ()
        return (type(self).__name__, self.shard, self.axis_name, self.min_shard_bytes,
                tuple(mesh.shape), tuple(mesh.axis_names),
                tuple(str(d) for d in np.asarray(mesh.devices).flat), rules,
                tuple(sorted(self._proposed)))

    def get_data_layout(self, data_shape):
        self.log_replicated()
        return super().get_data_layout(data_shape)

    @staticmethod
    def _creating_optimizer():
        for caller in reversed(keras_compat.name_scope_callers()):
            if isinstance(caller, keras.optimizers.Optimizer):
                return caller
        return None

    # --------------------------------------------------------------- optimizer
    def slot_layouts(self, optimizer, weights=None) -> dict:
        """`{id(slot): TensorLayout}` for each of `optimizer`'s variables.

        A slot (a variable made from a weight: momentum, velocity, an
        accumulator) is laid out as its weight by the rules, and split over
        the data axis as optimizer state; scalars (`iteration`,
        `learning_rate`) are replicated.

        Args:
            optimizer: A built `keras.optimizers.Optimizer`.
            weights: The weights its slots were made from (without them a
                slot is laid out by its own path and shape).
        """
        weights = list(weights or ())
        layouts = {}
        for slot in optimizer.variables:
            weight = reference_weight(slot, weights)
            path = weight.path if weight is not None else slot.path
            axes = self.axes_for(path, slot.shape, slot.dtype, optimizer_state=True)
            layouts[id(slot)] = keras.distribution.TensorLayout(axes, self.device_mesh)
        return layouts

    def lay_out_optimizer(self, optimizer, weights=None) -> None:
        """Moves a built optimizer's variables to `slot_layouts`, in place, and logs
        the variables that stay replicated (`fit` does it when it builds the
        optimizer in this distribution's scope)."""
        concern = backends.current(_WHAT).sharding
        layouts = self.slot_layouts(optimizer, weights)
        for slot in optimizer.variables:
            concern.move(slot, layouts[id(slot)])
        self.log_replicated()

    # ------------------------------------------------------------------ report
    def _note_replicated(self, path, shape):
        if path not in self._reported:
            self._pending[path] = shape

    def log_replicated(self) -> None:
        """Logs, once, the variables noted as staying replicated since the last call."""
        if not self._pending:
            return
        listed = ", ".join(f"{path} {tuple(shape)}" for path, shape in self._pending.items())
        logger.info("%s: %d variable(s) have no dimension that %d divides and stay "
                    "replicated on every device: %s.", _WHAT, len(self._pending),
                    self.axis_size, listed)
        self._reported.update(self._pending)
        self._pending.clear()

    def get_config(self) -> dict:
        """The arguments, with the mesh's shape and axes for the devices and the
        number of `layout_map` rules (None without one)."""
        return {"shard": self.shard, "axis_name": self.axis_name,
                "min_shard_bytes": self.min_shard_bytes,
                "mesh_shape": tuple(int(s) for s in self.device_mesh.shape),
                "mesh_axes": tuple(self.device_mesh.axis_names),
                "layout_map": len(self._layout_map) or None}

    def __repr__(self) -> str:
        config = self.get_config()
        rules = f", layout_map=<{config['layout_map']} rules>" if config["layout_map"] else ""
        return (f"ShardedDataParallel(shard={self.shard!r}, axis_name={self.axis_name!r}, "
                f"min_shard_bytes={self.min_shard_bytes}, mesh={config['mesh_shape']} "
                f"{config['mesh_axes']}{rules})")

    __str__ = __repr__


def reference_weight(slot, weights):
    """The weight an optimizer slot was made from, or None.

    Keras names a slot `<weight path with "/" as "_">_<slot name>`
    (`Optimizer.add_variable_from_reference`); the longest such prefix with
    the slot's shape wins.
    """
    best = None
    for weight in weights:
        prefix = weight.path.replace("/", "_") + "_"
        if (tuple(weight.shape) == tuple(slot.shape) and slot.name.startswith(prefix)
                and (best is None or len(weight.path) > len(best.path))):
            best = weight
    return best


def watch_optimizer(optimizer) -> None:
    """Wraps `optimizer.build` (once) so that, when the active distribution is a
    `ShardedDataParallel`, the slots are created in their own layout and every
    optimizer variable is laid out after it.

    Keras gives a slot its weight's layout (`add_variable_from_reference`), so
    while `build` runs each weight carries the layout its slots should have;
    the weights' own layouts are put back right after (no weight value moves:
    nothing assigns a weight during `build`). So the slots are never whole on
    a device, not even while they are created.
    """
    if optimizer in _WATCHED:
        return
    build = optimizer.build

    def build_and_lay_out(variables, *args, **kwargs):
        distribution = keras.distribution.distribution()
        if not isinstance(distribution, ShardedDataParallel):
            return build(variables, *args, **kwargs)
        weights = list(variables)
        own = [keras_compat.variable_layout(w) for w in weights]
        for weight in weights:
            keras_compat.set_variable_layout(weight, distribution.layout_for(
                weight, optimizer_state=True))
        try:
            result = build(variables, *args, **kwargs)
        finally:
            for weight, layout in zip(weights, own):
                keras_compat.set_variable_layout(weight, layout)
        distribution.lay_out_optimizer(optimizer, weights)
        model = keras_compat.model_building(optimizer)
        if model is not None:
            # A fit in the scope then runs the engine's sharded step (all-gathered
            # weights, reduce-scattered gradients) even with no feature callback.
            engage(model)
        return result

    optimizer.build = build_and_lay_out
    _WATCHED.add(optimizer)


__all__ = ["ShardedDataParallel", "reference_weight", "watch_optimizer"]
