"""Copies of device arrays into host memory, started without waiting for the steps in flight.

A checkpoint's save reads the training state between two steps, and the step after
it donates those arrays. A read that starts their copies (`copy_to_host_async`) has
to wait for them before that step is dispatched, which means waiting for every step
in flight too; the device then idles until the host has dispatched the next one. A
copy into each device's pinned host memory (XLA's host memory space: one jitted
call whose results live in host memory) is a computation of its own: the step that
donates its inputs runs after it, and its results outlive that step. The training
thread dispatches it and goes on; whoever writes the checkpoint waits for it. The
state's bytes are in host memory once, as with the copy it replaces, and no second
copy is made on the device.

Where a device has no pinned host memory the copies are made as before: started
together, then waited for by `start` itself.

JAX only; used by the JAX step's `state_copier` (contract: `backends.contracts.Trainer`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

#: The memory kind of a device's pinned host memory (JAX's name for XLA's host memory
#: space).
PINNED_HOST = "pinned_host"


def one_copy_each(values) -> list:
    """What a copy to host reads of each value: a value replicated over several devices,
    or not fully addressable (a multi-process job's replicated value: split values are
    refused before this), from this process's first copy only; a value split over
    this process's devices whole (its shards together)."""
    return [value.addressable_data(0) if isinstance(value, jax.Array) and (
                not value.is_fully_addressable
                or (value.sharding.is_fully_replicated and len(value.sharding.device_set) > 1))
            else value for value in values]


def wait_for_host_copies(arrays) -> list:
    """`arrays` (`one_copy_each`) as numpy arrays: every copy started before the first
    is waited for (what `jax.device_get` does, without its walk of a tree)."""
    for array in arrays:
        if isinstance(array, jax.Array):
            array.copy_to_host_async()
    return [np.asarray(array) for array in arrays]


class HostCopier:
    """Starts copies of arrays into their devices' pinned host memory.

    `start(arrays)` dispatches one jitted copy per set of devices the arrays lie on
    (compiled at the first call with their layouts, then reused) and returns
    `collect()`, which waits for the copies and gives them as numpy arrays in the
    order given, once (it lets go of each copy in pinned host memory as it takes
    it). Values that are no `jax.Array` are taken as they are.
    """

    def __init__(self):
        self._copies: dict[tuple, Callable] = {}  # the arrays' shardings -> their copy
        self._pinned: dict[int, bool] = {}  # device id -> whether it has pinned host memory

    def _has_pinned_host(self, devices) -> bool:
        for device in devices:
            if device.id not in self._pinned:
                kinds = {memory.kind for memory in device.addressable_memories()}
                self._pinned[device.id] = PINNED_HOST in kinds
            if not self._pinned[device.id]:
                return False
        return True

    def _copy(self, shardings: tuple) -> Callable | None:
        """The jitted copy of arrays laid out as `shardings` into pinned host memory, or
        None where a device of theirs has none."""
        if shardings not in self._copies:
            places = [getattr(sharding, "with_memory_kind", None) for sharding in shardings]
            copy = None
            if None not in places and self._has_pinned_host(shardings[0].device_set):
                # Not forwarded (an output laid out in another memory than its input is
                # a copy), and bit for bit (-0.0 and NaN payloads included).
                copy = jax.jit(lambda arrays: arrays,
                               out_shardings=[place(PINNED_HOST) for place in places])
            self._copies[shardings] = copy
        return self._copies[shardings]

    def start(self, arrays) -> Callable[[], list]:
        arrays = list(arrays)
        groups: dict[frozenset, list[int]] = {}  # device set -> positions in `arrays`
        for position, array in enumerate(arrays):
            if isinstance(array, jax.Array):
                groups.setdefault(frozenset(array.sharding.device_set), []).append(position)
        pending, waited = list(arrays), []
        for positions in groups.values():
            group = [arrays[p] for p in positions]
            copy = self._copy(tuple(array.sharding for array in group))
            if copy is None:
                waited.append(positions)
                continue
            for position, copied in zip(positions, copy(group)):
                pending[position] = copied
        for positions in waited:  # no pinned host memory: copied now, as before
            for position, value in zip(positions,
                                       wait_for_host_copies([arrays[p] for p in positions])):
                pending[position] = value

        def collect() -> list:
            values = []
            for position, value in enumerate(pending):
                values.append(np.asarray(value))
                pending[position] = None  # one copy at a time in host memory, not two
            return values
        return collect


__all__ = ["PINNED_HOST", "HostCopier", "one_copy_each", "wait_for_host_copies"]
