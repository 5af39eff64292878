"""`backends.jax.host_copy.HostCopier`: a checkpoint's copies of the training state into
host memory, started between two steps without waiting for the steps in flight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from keras_tpu_mem.backends.jax import host_copy


def _state(layout: str) -> list:
    """Arrays as a step leaves them: float32 with -0.0 and a NaN payload, bfloat16, an
    int32 counter and a scalar, on one device, replicated over 8 or split over 8."""
    values = [np.array([[-0.0, np.nan, 1.5, -2.0]] * 8, np.float32),
              np.arange(32, dtype=np.float32).reshape(8, 4).astype(jnp.bfloat16),
              np.arange(8, dtype=np.int32), np.array(7, np.int32)]
    if layout == "one device":
        return [jax.device_put(v, jax.devices()[0]) for v in values]
    mesh = Mesh(np.array(jax.devices()[:8]), ("batch",))
    split = layout == "split over 8"
    return [jax.device_put(v, NamedSharding(mesh, P("batch") if split and v.ndim else P()))
            for v in values]


def _bits(values) -> list:
    return [np.asarray(v).view(f"u{np.asarray(v).dtype.itemsize}") for v in values]


def _busy_step(iterations: int):
    """A step that returns the arrays it is given (bit for bit, as new arrays) once a
    loop of `iterations` has run: the arrays are ready only when it has."""
    def step(xs):
        spin = jax.lax.fori_loop(0, iterations, lambda i, a: a * 1.0000001 + 1e-9,
                                 jnp.ones((32, 32)))
        spin, xs = jax.lax.optimization_barrier((spin, xs))
        return spin, list(xs)
    return jax.jit(step)


@pytest.mark.parametrize("layout", ["one device", "replicated over 8", "split over 8"])
def test_the_copies_start_without_waiting_and_outlive_the_step_that_donates_them(layout):
    """`start` returns while the step that makes the arrays still runs (a loop of
    about half a second here, where a started copy takes a fraction of a millisecond:
    a `start` that waited would find them ready), the next step donates the arrays, and
    `collect` gives their values bit for bit (-0.0, NaN payload, bfloat16) whole."""
    assert len(jax.devices()) >= 8
    state = _state(layout)
    want = _bits(state)
    copier = host_copy.HostCopier()
    _, warm = _busy_step(1)(state)
    copier.start(host_copy.one_copy_each(warm))()  # compiled for these layouts
    _, held = _busy_step(300_000)(state)
    collect = copier.start(host_copy.one_copy_each(held))
    assert not held[0].is_ready()
    jax.jit(lambda xs: [x * 2 for x in xs], donate_argnums=0)(held)  # the next step
    assert held[1].is_deleted()
    got = collect()
    assert [v.shape for v in got] == [np.asarray(v).shape for v in state]
    for g, w in zip(_bits(got), want):
        np.testing.assert_array_equal(g, w)


def test_devices_without_pinned_host_memory_are_copied_by_start(monkeypatch):
    """Where a device has no pinned host memory the copies are made in `start` itself
    (started together, then waited for), and `collect` gives the same values."""
    monkeypatch.setattr(host_copy.HostCopier, "_has_pinned_host", lambda self, devices: False)
    state = _state("split over 8")
    collect = host_copy.HostCopier().start(host_copy.one_copy_each(state))
    jax.jit(lambda xs: [x * 2 for x in xs], donate_argnums=0)(state)
    for g, w in zip(_bits(collect()), _bits([np.asarray(v) for v in _state("split over 8")])):
        np.testing.assert_array_equal(g, w)


def test_one_copy_each_reads_a_replicated_value_from_one_device():
    """A value replicated over 8 devices is read from its first copy (one copy to host,
    not eight); a split one whole; a numpy value as it is."""
    replicated, split, one, plain = (*_state("replicated over 8")[:1], *_state("split over 8")[:1],
                                     *_state("one device")[:1], np.ones(2))
    got = host_copy.one_copy_each([replicated, split, one, plain])
    assert len(got[0].sharding.device_set) == 1
    assert got[1] is split and got[2] is one and got[3] is plain


@pytest.mark.parametrize("layout", ["one chip", "split over 8"])
def test_xla_tpu_compiles_the_copy_into_host_memory_with_no_hbm_of_its_own(layout):
    """XLA:TPU's verdict on the copy a save dispatches (compiled ahead of time for a
    v5e-8 through libtpu; nothing runs): its results are in host memory, as many bytes
    as the state, and it takes no HBM besides the state it reads (no temporaries, no
    device-side results but the tuple's table of pointers)."""
    pytest.importorskip("libtpu", reason="needs libtpu: the [tpu-plan] extra "
                        '(pip install "keras-tpu-mem[tpu-plan]")')
    from keras_tpu_mem.backends.jax import tpu_topology
    from keras_tpu_mem.devices.tpu_slices import tpu_slice

    devices = tpu_topology.slice_devices(tpu_slice("v5e-8"))
    if layout == "one chip":
        shardings = (jax.sharding.SingleDeviceSharding(devices[0]),) * 3
    else:
        mesh = Mesh(np.array(devices), ("batch",))
        shardings = (NamedSharding(mesh, P("batch")),) * 2 + (NamedSharding(mesh, P()),)
    arrays = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, sharding
              in zip([(4096, 1024), (8192, 256), ()], [jnp.float32, jnp.bfloat16, jnp.int32],
                     shardings)]
    copy = host_copy.HostCopier()._copy(shardings)
    assert copy is not None  # the compile-only TPU devices have pinned host memory
    compiled = copy.lower(arrays).compile()
    memory = compiled.memory_analysis()
    split = 8 if layout == "split over 8" else 1
    # The int32 scalar whole, in the 512 bytes XLA:TPU lays a scalar out in.
    per_device = (4096 * 1024 * 4 + 8192 * 256 * 2) // split + 512
    assert [s.memory_kind for s in compiled.output_shardings] == [host_copy.PINNED_HOST] * 3
    assert memory.argument_size_in_bytes == per_device
    assert memory.host_output_size_in_bytes == memory.argument_size_in_bytes
    assert memory.temp_size_in_bytes == 0
    assert memory.output_size_in_bytes <= 1024  # the result tuple's pointers only
