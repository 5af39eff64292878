"""Compile-only JAX devices of a Cloud TPU slice, on a machine with no TPU (libtpu).

With libtpu installed (`pip install "keras-tpu-mem[tpu-plan]"`, which installs
`jax[tpu]`: the libtpu that jax pins), JAX describes a TPU slice it cannot reach
(`jax.experimental.topologies.get_topology_desc`) and XLA:TPU compiles for its
devices ahead of time: nothing runs, and `memory_analysis()` is that TPU's.
`slice_devices(tpu_slice("v5e-16"))` returns those devices, once per slice.

Measured (2-core CPU machine, no TPU; jax 0.10.2, libtpu 0.0.42.1):

| slice  | topology   | chip config | devices | device_kind   | processes |
|--------|------------|-------------|---------|---------------|-----------|
| v2-8   | v2:2x2     | default     | 8       | "TPU v2"      | 1         |
| v3-8   | v3:2x2     | default     | 8       | "TPU v3"      | 1         |
| v4-8   | v4:2x2x1   | megacore    | 4       | "TPU v4"      | 1         |
| v5e-8  | v5e:2x4    | default     | 8       | "TPU v5 lite" | 1         |
| v5p-8  | v5:2x2x1   | megacore    | 4       | "TPU v5"      | 1         |
| v6e-8  | v6e:2x4    | default     | 8       | "TPU v6 lite" | 1         |

v4's default chip config shows every TensorCore (v4:2x2x1: 8 devices, core_on_chip
0 and 1); "megacore" shows one device per chip, as a v4 VM's JAX does. v5p's
default is already one device per chip. v2 and v3 show one per TensorCore.
The processes (distinct `process_index`) are `TPUSlice.hosts`: v5e/v6e hosts are
2x4 chips (v5e-16: 2), v2-v5p hosts 2x2 (v4-32: 4). How the hosts are cut does
not change XLA:TPU's memory: a sharded train step compiled for v5e:4x4 with 2x2
or 2x4 hosts, and for v4:4x4x4 with or without wraparound, reported the same bytes.

Loading: libtpu loads with the first topology (0.07-0.15 s after `import jax`,
which takes 2-3 s); each slice after that 0.002-0.02 s (the 6144 devices of
v5p-12288: 0.08-0.4 s); a cached slice 30 microseconds.

Messages: on a machine without a TPU, libtpu's start-up writes to stderr from
C++ (absl) lines such as "WARNING: could not determine TPU accelerator type" and
"E0000 ... common_lib.cc:554] INVALID_ARGUMENT: ... TPU_WORKER_HOSTNAMES"; they
are harmless for compiling. `slice_devices` sends file descriptor 2 to a
temporary file around the call that loads libtpu and logs what came on the
package's logger at DEBUG level. It does so only where no TPU chip is attached
and libtpu is not loaded yet: on a TPU VM libtpu's messages are left as they are.

The lock: libtpu takes `/tmp/libtpu_lockfile` (an exclusive POSIX lock, held for
the life of the process) when it initialises, so that two processes cannot share
a TPU. A second process that loads libtpu meanwhile fails with "ABORTED:
Internal error when accessing libtpu multi-process lockfile". On a machine
without a TPU this bites more than it seems: with libtpu installed and
JAX_PLATFORMS unset, a plain `jax.devices()` tries the TPU backend, loads libtpu
(taking the lock and printing the messages above), fails ("No jellyfish device
found") and returns the CPU devices (0.05-0.13 s); that process then holds the
lock until it exits (measured: a process that called `jax.devices()` and
slept), and every other process's `get_topology_desc` fails.
libtpu reads ALLOW_MULTIPLE_LIBTPU_LOAD=1 as "skip the lock": measured, a
process with it loads topologies while another holds the lock (both ways: set
in the environment, or in `os.environ` before the first load, also after a
failed `jax.devices()` attempt in the same process). `slice_devices` sets it
where no TPU chip is attached and the user has not set it.

JAX only; contract: `keras_tpu_mem.backends.contracts.TpuTopology`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
import tempfile
import threading
import types

from keras_tpu_mem._utils import logger

_PLAN_INSTALL = 'pip install "keras-tpu-mem[tpu-plan]"'

# The distributions that ship libtpu.so: `jax[tpu]` installs "libtpu"; older
# and nightly setups have "libtpu-nightly".
_LIBTPU_DISTRIBUTIONS = ("libtpu", "libtpu-nightly")
_LOCK_ENV = "ALLOW_MULTIPLE_LIBTPU_LOAD"
# Where the first slice is not yet loaded, `available()` loads this one: the
# smallest topology (one v5e chip).
# One v5e chip (`tpu_slice("v5e-1")`, spelled out: the seam imports no neutral module).
_PROBE_SLICE = types.SimpleNamespace(
    name="v5e-1", topology="v5e:1x1", chip_config="default", chips_per_host_bounds=(1, 1, 1),
    devices=1, wrap=(False, False, False))

_DEVICES_BY_SLICE: dict[str, tuple] = {}
# One load at a time: the first one moves file descriptor 2, which is the
# whole process's.
_LOAD_LOCK = threading.Lock()


class TPUCompilerUnavailable(RuntimeError):
    """XLA:TPU cannot compile here: libtpu is not installed or failed to load.

    The message says why (the first line of libtpu's error) and names
    the install that brings libtpu.
    """


def libtpu_version() -> str | None:
    """The installed libtpu distribution's version, or None where none is installed.

    Returns:
        The version `importlib.metadata` reports for "libtpu" (what `jax[tpu]`
        installs) or "libtpu-nightly", e.g. `"0.0.42.1"`; None without either.
    """
    for distribution in _LIBTPU_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def slice_devices(tpu) -> list:
    """The compile-only JAX devices of a TPU slice, loaded once per slice.

    XLA:TPU compiles for these devices on a machine without a TPU: build a
    `jax.sharding.Mesh` of them and lower with `jax.ShapeDtypeStruct`s (no value
    can be placed on them).

    Args:
        tpu: The slice, a `keras_tpu_mem.devices.tpu_slices.TPUSlice`
            (`ktm.tpu_slice("v5e-16")`; the seam's modules do not import the neutral
            ones, so a name is not taken here).

    Returns:
        A new list of `tpu.devices` devices (`len(result) == tpu.devices`), the
        same device objects on every call for the same slice name.

    Raises:
        TypeError: if `tpu` is not a `TPUSlice`.
        ValueError: if `tpu` is a str `tpu_slice` refuses.
        TPUCompilerUnavailable: if libtpu is not installed or fails to load; the
            message says why and names the install that brings libtpu.

    Example:

    ```python
    devices = slice_devices(tpu_slice("v5e-8"))
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32,
                             sharding=NamedSharding(mesh, P("batch")))
    print(jax.jit(f).lower(x).compile().memory_analysis())  # XLA:TPU's bytes per chip
    ```
    """
    if not all(hasattr(tpu, a) for a in ("name", "topology", "chip_config", "devices")):
        raise TypeError(f"`tpu` must be a TPUSlice (ktm.tpu_slice('v5e-16')), got "
                        f"{type(tpu).__name__}.")
    with _LOAD_LOCK:
        devices = _DEVICES_BY_SLICE.get(tpu.name)
        if devices is None:
            devices = _DEVICES_BY_SLICE[tpu.name] = tuple(_load(tpu))
    return list(devices)


def available() -> bool:
    """Whether XLA:TPU can compile here: libtpu is installed and a small topology loads.

    Returns:
        True once a slice's devices load (the first call may load libtpu:
        about 0.1 s); False without libtpu or where it fails to load (the
        reason is logged at DEBUG level).
    """
    if _DEVICES_BY_SLICE:
        return True
    try:
        slice_devices(_PROBE_SLICE)
    except Exception as err:  # any failure means "no XLA:TPU here"; the reason is logged
        logger.debug("XLA:TPU is not available: %s", err)
        return False
    return True


def _load(tpu) -> list:
    """`get_topology_desc` for the slice; failing before libtpu is up: TPUCompilerUnavailable."""
    if libtpu_version() is None and not _library_path_from_user():
        raise TPUCompilerUnavailable(
            f"libtpu is not installed: compiling for TPU slice {tpu.name} on a machine without "
            f"a TPU needs XLA:TPU's compiler, libtpu ({_PLAN_INSTALL}; Linux x86-64).")
    tpu_attached = _tpu_chips_attached()
    if not tpu_attached and _LOCK_ENV not in os.environ:
        # libtpu's process lock guards TPU chips, and there are none here: without
        # this, a second process loading libtpu at the same time (another plan, a
        # test, any `jax.devices()` with JAX_PLATFORMS unset) fails with ABORTED.
        # Set in os.environ, so processes started from this one inherit it.
        os.environ[_LOCK_ENV] = "1"
    from jax.experimental import topologies

    first_load = not _libtpu_initialized()
    quiet = _stderr_to_debug_log() if first_load and not tpu_attached else contextlib.nullcontext()
    try:
        with quiet:
            devices = topologies.get_topology_desc(
                topology_name=tpu.topology, platform="tpu", chip_config_name=tpu.chip_config,
                chips_per_host_bounds=tpu.chips_per_host_bounds, wrap=tpu.wrap).devices
    except Exception as err:
        if _libtpu_initialized():  # libtpu is up: the slice's arguments are at fault
            raise
        raise TPUCompilerUnavailable(_load_failure(tpu, err)) from err
    if len(devices) != tpu.devices:
        raise RuntimeError(
            f"libtpu {libtpu_version()} describes {tpu.name} ({tpu.topology}, chip config "
            f"{tpu.chip_config!r}) with {len(devices)} devices; keras_tpu_mem expects "
            f"{tpu.devices}. Please report this with your jax and libtpu versions.")
    return list(devices)


def _load_failure(tpu, err: Exception) -> str:
    """Why libtpu did not load: the first line of its error, and what helps."""
    first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    why = (f"XLA:TPU's compiler (libtpu {libtpu_version() or '?'}) failed to load for TPU "
           f"slice {tpu.name}: {first_line.rstrip('.')}.")
    if "lockfile" in first_line:
        return (f"{why} Another process holds libtpu's lock; {_LOCK_ENV}=1 lets "
                f"processes share it where no TPU is attached.")
    return f"{why} Reinstall the libtpu that matches jax: {_PLAN_INSTALL}."


def _library_path_from_user() -> bool:
    """Whether TPU_LIBRARY_PATH names a libtpu.so file (JAX loads that one first)."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    return bool(path) and os.path.isfile(path)


def _tpu_chips_attached() -> bool:
    """Whether this machine has TPU chips on its PCI bus (as JAX itself checks)."""
    try:
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # a JAX without the check: assume a TPU may be there, change nothing
        return True


def _libtpu_initialized() -> bool:
    """Whether libtpu is loaded and initialised in this process (by JAX or by us)."""
    try:
        from jax._src.lib import xla_client

        return bool(xla_client.pjrt_plugin_loaded("tpu")
                    and xla_client.pjrt_plugin_initialized("tpu"))
    except Exception:  # a JAX without these calls: count it as not loaded
        return False


@contextlib.contextmanager
def _stderr_to_debug_log():
    """File descriptor 2 goes to a temporary file; its content is logged at DEBUG after.

    libtpu writes from C++, below `sys.stderr`, so only moving the descriptor
    quiets it. Where descriptor 2 cannot be duplicated, nothing is moved.
    """
    saved = _duplicate_stderr()
    if saved is None:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace").strip()
            if text:
                logger.debug("libtpu's start-up messages (no TPU attached):\n%s", text)


def _duplicate_stderr() -> int | None:
    """A duplicate of file descriptor 2 (Python's buffer flushed first), or None if it has none."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.flush()
    try:
        return os.dup(2)
    except OSError:
        return None


def all_devices() -> list:
    """Every device of the job (all processes), as a distribution over them names them:
    what a plan compiled for a slice's compile-only devices is rebuilt over when this
    job runs on that slice (`Recommendation.distribution()`)."""
    import jax

    return list(jax.devices())


_CAPACITY: dict = {}


def xla_capacity(devices) -> int:
    """One device's memory as XLA counts it when it refuses a program ("exceeds
    available HBM (15.75G)" on TPU v5 lite: the chip's 16 GiB less what the runtime
    keeps), the capacity a plan on the slice is held to; read by compiling a program
    that cannot fit (nothing runs; cached per device kind).

    Raises:
        RuntimeError: XLA compiled the probe or refused it without that figure.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from keras_tpu_mem.backends.contracts import CompileRefused
    from keras_tpu_mem.backends.jax.profiler import is_out_of_memory

    kind = devices[0].device_kind
    if kind not in _CAPACITY:
        mesh = jax.sharding.Mesh(np.asarray(devices[:1]), ("d",))
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        # 4 TiB of float32: more than any accelerator holds.
        big = jax.ShapeDtypeStruct((2**40,), jnp.float32, sharding=whole)
        try:
            jax.jit(lambda x: x + 1, out_shardings=whole).lower(big).compile()
        except Exception as err:
            refused = CompileRefused(" ".join(str(err).split()))
            if refused.available_bytes is None or not is_out_of_memory(err):
                raise RuntimeError(f"XLA gave no memory capacity for {kind}: {err}") from err
            _CAPACITY[kind] = refused.available_bytes
        else:
            raise RuntimeError(f"XLA compiled 4 TiB for one {kind}: no capacity to read.")
    return _CAPACITY[kind]


#: HBM per device that XLA:TPU leaves free in the compiles `compile_options` describes
#: (`reserving_hbm`): 0 outside.
_RESERVED_HBM = [0]

#: libtpu's option for HBM "reserved by the user": XLA:TPU schedules the program within
#: the rest, and refuses it where it cannot.
_RESERVE_OPTION = "xla_tpu_user_reserved_hbm_bytes"


@contextlib.contextmanager
def reserving_hbm(nbytes: int):
    """Compiles for a TPU made in the block leave `nbytes` of each device's HBM free.

    XLA:TPU schedules a program to the memory it is given: its peak is not what the
    program needs but what the scheduler used of the HBM it could use (the 6.71B MLP of
    docs/planning.md under `ShardedDataParallel()` on v5e-16 compiled to 14.99 GiB per
    chip against the whole 15.75 GiB, to 13.36 GiB with 1.575 GiB reserved and to 9.03
    GiB with 6 GiB reserved). A plan's headroom is therefore reserved in XLA:TPU's own
    compile (`xla_tpu_user_reserved_hbm_bytes`), not subtracted from a compile against
    the whole chip. Nests; the previous reserve comes back at the end."""
    previous = _RESERVED_HBM[0]
    _RESERVED_HBM[0] = max(0, int(nbytes))
    try:
        yield
    finally:
        _RESERVED_HBM[0] = previous


def compile_options(reserved_bytes: int | None = None) -> dict:
    """XLA:TPU's options for a compile that leaves `reserved_bytes` of HBM free (None: a
    compile made now, as `reserving_hbm` says); empty for none."""
    reserved = _RESERVED_HBM[0] if reserved_bytes is None else int(reserved_bytes)
    return {_RESERVE_OPTION: reserved} if reserved > 0 else {}
