"""Which compiler answers a plan: XLA:TPU for a TPU slice this machine does not have, or
XLA:CPU on the host.

A TPU user's question is about the slice they will rent ("will it fit a v5e-16?"), and
only XLA:TPU answers it exactly: it tiles layouts to 8 x 128, fuses and schedules its
own way, and is the compiler that says RESOURCE_EXHAUSTED. With libtpu installed
(`pip install "keras-tpu-mem[tpu-plan]"`), JAX describes any slice without a TPU
attached and compiles for it ahead of time; nothing runs and nothing is allocated there.

One path for every compile of the planner: the model and the step stay on the host
(compile-only devices hold no values), the model's state is built there first, and only
the compile sees the slice: a `ShardedDataParallel` over the slice's devices with the
same axis names as the distribution the model trains under proposes every variable's
layout (`sharding.layouts.proposed_layouts`), and the step is traced and compiled in its
scope. The mesh rule (`target_distribution`):

* no distribution, or `DataParallel`: the batch axis spans every device of the slice;
* `ShardedDataParallel`: the same split of the state, over the slice's devices;
* a `ModelParallel` with a `LayoutMap`: every axis but the batch axis keeps its size,
  the batch axis takes the rest;
* `mesh={"batch": 4, "model": 4}` overrides the sizes (their product: the slice's
  devices).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import keras
import numpy as np

from keras_tpu_mem import backends
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.planning.budget import usable_bytes

#: `compiler=` values: XLA:TPU where the device names a TPU slice and libtpu loads
#: (`"auto"`), XLA:TPU or an error (`"tpu"`), the host's XLA (`"host"`).
COMPILERS = ("auto", "tpu", "host")

TPU_PLAN_INSTALL = 'pip install "keras-tpu-mem[tpu-plan]"'


def check_compiler(compiler) -> str:
    if not isinstance(compiler, str) or compiler not in COMPILERS:
        raise ValueError(f"`compiler` must be one of {', '.join(map(repr, COMPILERS))}, got "
                         f"{compiler!r}.")
    return compiler


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """A TPU slice the planner compiles for with XLA:TPU.

    Attributes:
        tpu: The slice (`devices.tpu_slices.TPUSlice`).
        devices: Its compile-only JAX devices (they hold no values).
        libtpu: The installed libtpu's version.
        capacity_bytes: One device's HBM as XLA:TPU counts it (what it calls
            "available HBM" when a program does not fit).
        mesh: Axis sizes that override the mesh rule, or None.
        reserved_bytes: HBM per device that XLA:TPU's compiles leave free (a plan's
            headroom, `with_headroom`): XLA:TPU schedules a program to the memory it
            is given, so a headroom is reserved in the compile itself.
    """

    tpu: object  # devices.tpu_slices.TPUSlice
    devices: tuple
    libtpu: str
    capacity_bytes: int
    mesh: tuple | None = None
    reserved_bytes: int = 0

    def with_headroom(self, headroom: float) -> CompileTarget:
        """This target with `headroom` (a fraction of `capacity_bytes`) reserved: its
        compiles may use `capacity_bytes * (1 - headroom)`, what a plan calls usable."""
        usable = usable_bytes(self.capacity_bytes, headroom)
        return dataclasses.replace(self, reserved_bytes=self.capacity_bytes - usable)

    @property
    def label(self) -> str:
        """`"XLA:TPU (TPU v5 lite, v5e:4x4, 16 devices, libtpu 0.0.42.1)"`."""
        kind = self.devices[0].device_kind
        return (f"XLA:TPU ({kind}, {self.tpu.topology}, {len(self.devices)} devices, "
                f"libtpu {self.libtpu})")


def host_label(platform: str, devices: int) -> str:
    """`"XLA:CPU (1 device)"`: the host's compiler, as a plan names it."""
    return f"XLA:{platform.upper()} ({devices} device{'s' if devices != 1 else ''})"


def _check_mesh(mesh, what: str):
    if mesh is None:
        return None
    if not isinstance(mesh, dict) or not mesh:
        raise TypeError(f"{what}: `mesh` must be None or a dict of axis name -> size, such "
                        f"as {{'batch': 4, 'model': 4}}; got {mesh!r}.")
    for name, size in mesh.items():
        if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int) \
                or size < 1:
            raise ValueError(f"{what}: `mesh` maps axis names to sizes >= 1, got "
                             f"{name!r}: {size!r}.")
    return tuple(mesh.items())


def resolve(device, compiler: str, what: str, mesh=None):
    """`(CompileTarget or None, note or None)`: the slice to compile for, or None for the
    host's compiler with the line a plan says about it.

    Raises:
        ValueError: `compiler="tpu"` with a device that names no TPU slice, on a
            backend that cannot compile for one, or without libtpu (the message names
            the install); a bad `compiler` or `mesh`.
    """
    check_compiler(compiler)
    mesh = _check_mesh(mesh, what)
    if device is None and compiler != "tpu" and mesh is None:
        return None, None
    from keras_tpu_mem.devices.tpu_slices import is_tpu_slice_name, tpu_slice

    tpu_name = isinstance(device, str) and is_tpu_slice_name(device)
    if compiler == "host" or not tpu_name:
        if compiler == "tpu":
            raise ValueError(f"{what}: compiler='tpu' needs `device` to name a TPU slice "
                             f"such as 'v5e-16' or 'v3-8', got {device!r}.")
        if mesh is not None:
            raise ValueError(f"{what}: `mesh` lays the model out on a TPU slice compiled by "
                             "XLA:TPU; pass a TPU `device` such as 'v5e-16' (and libtpu).")
        return None, None
    tpu = tpu_slice(device)
    backend = backends.current(what)
    if not backend.compiles_for_tpu():  # TensorFlow: plan(compiler="tpu") lowers to JAX
        if compiler == "tpu":
            raise ValueError(
                f"{what}: compiler='tpu' on the {backend.label} backend is plan's: "
                "plan(model, batch, device=..., compiler='tpu') compiles the model's JAX "
                "lowering with XLA:TPU in a JAX subprocess.")
        return None, (f"XLA:CPU's compile (the host): XLA:TPU plans a TPU slice on the JAX "
                      f"backend with libtpu ({TPU_PLAN_INSTALL}), or from "
                      f"{backend.label} with plan(..., compiler='tpu').")
    topology = backend.tpu_topology
    try:
        devices = tuple(topology.slice_devices(tpu))
    except topology.TPUCompilerUnavailable as err:
        if compiler == "tpu":
            raise ValueError(f"{what}: compiler='tpu' needs XLA:TPU: {err}") from err
        return None, (f"XLA:CPU's compile, not XLA:TPU's: {err}")
    capacity = topology.xla_capacity(devices)
    return CompileTarget(tpu, devices, topology.libtpu_version() or "?", capacity,
                         mesh), None


def reserve_note(target: CompileTarget, headroom: float, what: str) -> str:
    """The plan's line saying that its headroom was reserved in XLA:TPU's compiles."""
    from keras_tpu_mem.devices.units import format_bytes

    options = backends.current(what).tpu_topology.compile_options(target.reserved_bytes)
    flags = " ".join(f"--{name}={value}" for name, value in options.items())
    return (f"XLA:TPU compiled with {format_bytes(target.reserved_bytes)} of each device's "
            f"HBM reserved (the {headroom:.0%} headroom): it schedules the step within the "
            "rest, and its peak grows with the memory it is given. For the run to keep "
            f"the same headroom, set LIBTPU_INIT_ARGS=\"{flags}\" before JAX starts.")


def slice_budget(target: CompileTarget, replicas: int):
    """The `DeviceBudget` of a plan on the slice: XLA:TPU's capacity per device, the
    batch split over `replicas` (the batch axis of the slice's mesh)."""
    from keras_tpu_mem.planning.budget import DeviceBudget

    return DeviceBudget(target.tpu.name, target.capacity_bytes, int(replicas), target.label)


# ------------------------------------------------------------------ the target's mesh
def _axis_sizes(active) -> dict:
    if active is None:
        return {}
    mesh = active.device_mesh
    return dict(zip(mesh.axis_names, (int(s) for s in mesh.shape)))


def _mesh_shape(target: CompileTarget, active, what: str) -> tuple[tuple, tuple]:
    """`(axis names, sizes)` of the target's mesh (see the module docstring)."""
    n = len(target.devices)
    if target.mesh is not None:
        names = tuple(name for name, _ in target.mesh)
        sizes = tuple(size for _, size in target.mesh)
        if math.prod(sizes) != n:
            raise ValueError(f"{what}: `mesh` {dict(target.mesh)} has {math.prod(sizes)} "
                             f"devices; {target.tpu.name} has {n}.")
        batch = getattr(active, "batch_dim_name", None) or "batch"
        if active is not None and set(names) != set(_axis_sizes(active)):
            raise ValueError(f"{what}: `mesh` must name the axes of the active "
                             f"distribution's mesh, {tuple(_axis_sizes(active))}; got "
                             f"{names}.")
        if active is None and batch not in names:
            raise ValueError(f"{what}: `mesh` must have a 'batch' axis, got {names}.")
        return names, sizes
    sizes = _axis_sizes(active)
    batch = getattr(active, "batch_dim_name", None) or "batch"
    if len(sizes) <= 1:
        return (batch,), (n,)
    others = math.prod(size for name, size in sizes.items() if name != batch)
    if n % others:
        raise ValueError(
            f"{what}: the distribution's non-batch axes "
            f"({', '.join(f'{k}={v}' for k, v in sizes.items() if k != batch)}) need "
            f"{others} devices each, which do not divide the {n} devices of "
            f"{target.tpu.name}; pass mesh={{...}} with sizes whose product is {n}.")
    return tuple(sizes), tuple(n // others if name == batch else size
                               for name, size in sizes.items())


def target_distribution(target: CompileTarget, active, what: str = "plan"):
    """The distribution the step is compiled under on the slice: a `ShardedDataParallel`
    over the slice's devices that lays the state out as `active` does (None or
    `DataParallel`: replicated; `ShardedDataParallel`: its split; `ModelParallel`: its
    `LayoutMap` rules), on a mesh with the same axis names."""

    names, sizes = _mesh_shape(target, active, what)
    return _remeshed(active, target.devices, names, sizes)


def _remeshed(distribution, devices, names, sizes):
    """A `ShardedDataParallel` on a mesh of `devices` (axis `names`, `sizes`) that lays the
    state out as `distribution` does (its split, its `LayoutMap` rules)."""
    from keras_tpu_mem.sharding.distribution import ShardedDataParallel

    batch = getattr(distribution, "batch_dim_name", None) or "batch"
    mesh = keras.distribution.DeviceMesh(
        tuple(sizes), tuple(names), np.asarray(devices, dtype=object).reshape(sizes))
    layout_map = keras.distribution.LayoutMap(mesh)
    rules = (keras_compat.distribution_layout_map(distribution)
             if distribution is not None else None)
    for key in (rules.keys() if rules is not None else ()):
        layout_map[key] = tuple(rules[key].axes)
    return ShardedDataParallel(layout_map=layout_map, axis_name=batch,
                               shard=getattr(distribution, "shard", None),
                               min_shard_bytes=getattr(distribution, "min_shard_bytes", 0))


def on_this_machine(distribution, target: CompileTarget):
    """`distribution` (laid out on the slice's compile-only devices) rebuilt over this
    process's devices, when they are the slice's kind and count.

    Raises:
        ValueError: this machine's devices are not the slice's.
    """
    devices = backends.current("Recommendation.distribution").tpu_topology.all_devices()
    kind = target.devices[0].device_kind
    kinds = {d.device_kind for d in devices}
    if len(devices) != len(target.devices) or kinds != {kind}:
        raise ValueError(
            f"This recommendation was compiled by XLA:TPU for {target.tpu.name} "
            f"({len(target.devices)} x {kind}); this process has {len(devices)} device(s) "
            f"({', '.join(sorted(map(str, kinds)))}). Call distribution() on the slice "
            "(its callbacks() work anywhere).")
    mesh = distribution.device_mesh
    return _remeshed(distribution, devices, mesh.axis_names, mesh.shape)


@contextlib.contextmanager
def compiling_for(model, target: CompileTarget | None, active, what: str = "plan"):
    """Compiles in the block target the slice: `model`'s state laid out on its mesh
    (proposed, not moved), the target's distribution active. Yields it (None: the host,
    nothing changed)."""
    if target is None:
        yield None
        return
    from keras_tpu_mem.shapes import deferring
    from keras_tpu_mem.sharding.layouts import proposed_layouts

    distribution = target_distribution(target, active, what)
    topology = backends.current(what).tpu_topology
    # Whatever a compile creates (feature state, a mask) is created without a value:
    # the slice's devices cannot hold one.
    with deferring(), proposed_layouts(model, distribution), \
            topology.reserving_hbm(target.reserved_bytes):
        yield distribution


__all__ = ["COMPILERS", "CompileTarget", "check_compiler", "compiling_for", "host_label",
           "reserve_note", "resolve", "slice_budget", "target_distribution"]
