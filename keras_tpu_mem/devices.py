"""Accelerator memory capacities and memory readers.

Two things live here:

* `HBM_TABLE`: how much high-bandwidth memory one *replica* of each TPU
  generation has under `tf.distribute.TPUStrategy`, with the per-chip figure
  and where it comes from. Per-core and per-chip numbers differ: on TPU v2 and
  v3 every TensorCore is its own replica (two per chip, each with half of the
  chip's HBM); from v4 on, the two TensorCores of a chip act as one "megacore"
  replica (v4, v5p), or the chip has one TensorCore (v5e, v6e).
* Memory readers, each naming its *source*:

  - `"allocator"` (`SOURCE_ALLOCATOR`): the bytes TensorFlow's allocator of a
    device holds now and at its peak (`tf.config.experimental.get_memory_info`):
    HBM on a TPU, GPU memory, or the host allocator on CPU;
  - `"host_rss"` (`SOURCE_HOST_RSS`): the resident memory (RSS) of this whole
    process, the fallback for a CPU device whose allocator keeps no statistics
    (TensorFlow's CPU allocator with oneDNN off: the default on CPUs without
    AVX-512, such as AMD EPYC with AVX2, or `TF_ENABLE_ONEDNN_OPTS=0`). It is a
    process-wide figure (weights, data, Python, TensorFlow itself), never HBM.

  `read_memory` and `reset_peak` read one source; `memory_source` picks the
  source that can read a device, and `read_memory_reading` returns a
  `MemoryReading` that carries it. They return `None` where nothing can tell
  (a TPU or GPU plugin without statistics), so callers say "unknown" instead
  of guessing.

* On the JAX backend the same functions take a `jax.Device` instead of a
  TensorFlow device name. `"allocator"` is then the device's
  `jax.Device.memory_stats()` (`bytes_in_use`, `peak_bytes_in_use`, and
  `bytes_limit` as the capacity): what TPU and GPU runtimes keep. Its peak is
  a high-water mark since the process started that nothing can reset
  (`reset_peak` returns False), so callers that keep phases apart compare it
  with the mark at the phase's start (see `HBMMonitor`). JAX's CPU devices keep
  no statistics (`memory_stats()` is `None`): for them `"host_rss"` is the
  source, as for TensorFlow's CPU allocator with oneDNN off.
  `monitored_jax_devices` lists the devices of the active `keras.distribution`
  that this process holds; `jax_device_name`, `jax_memory_stats` and
  `jax_capacity` are the other JAX readers. None of them imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading

GIB = 1024**3
GB = 1000**3


@dataclasses.dataclass(frozen=True)
class AcceleratorSpec:
    """Memory facts for one accelerator generation.

    Attributes:
        name: Short generation name, e.g. `"v3"`.
        device_kind: What TensorFlow reports as the device kind, e.g. `"TPU v3"`.
        hbm_bytes_per_chip: HBM capacity of one chip, in bytes.
        cores_per_chip: TensorCores on one chip.
        replicas_per_chip: How many `TPUStrategy` replicas one chip gives.
        source: Where the capacity figure comes from.
    """

    name: str
    device_kind: str
    hbm_bytes_per_chip: int
    cores_per_chip: int
    replicas_per_chip: int
    source: str

    @property
    def hbm_bytes_per_replica(self) -> int:
        return self.hbm_bytes_per_chip // self.replicas_per_chip


# Sources checked on 2026-11-29 against Google's Cloud TPU system-architecture
# pages (cloud.google.com/tpu/docs/<version>). Google states v2-v4 in GiB and
# v5e/v5p/v6e in GB; the numbers below keep the unit Google uses.
HBM_TABLE: dict[str, AcceleratorSpec] = {
    spec.name: spec
    for spec in (
        # "TPU v2: ... 16 GiB of HBM per chip", two TensorCores per chip,
        # so 8 GiB per core, and each core is one TPUStrategy replica.
        AcceleratorSpec("v2", "TPU v2", 16 * GIB, 2, 2, "cloud.google.com/tpu/docs/v2"),
        # "HBM2 capacity and bandwidth: 32 GiB, 900 GBps" per chip, two
        # TensorCores per chip -> 16 GiB per core/replica.
        AcceleratorSpec("v3", "TPU v3", 32 * GIB, 2, 2, "cloud.google.com/tpu/docs/v3"),
        # "HBM2 capacity and bandwidth: 32 GiB, 1200 GBps"; the two TensorCores
        # form one megacore, so one replica per chip.
        AcceleratorSpec("v4", "TPU v4", 32 * GIB, 2, 1, "cloud.google.com/tpu/docs/v4"),
        # "HBM2 capacity and bandwidth: 16 GB, 819 GBps"; one TensorCore per chip.
        AcceleratorSpec("v5e", "TPU v5 lite", 16 * GB, 1, 1, "cloud.google.com/tpu/docs/v5e"),
        # "HBM2e capacity and bandwidth: 95 GB, 2765 GBps"; megacore, one replica.
        AcceleratorSpec("v5p", "TPU v5", 95 * GB, 2, 1, "cloud.google.com/tpu/docs/v5p"),
        # "HBM capacity per chip: 32 GB"; one TensorCore per chip (Trillium).
        AcceleratorSpec("v6e", "TPU v6 lite", 32 * GB, 1, 1, "cloud.google.com/tpu/docs/v6e"),
    )
}

_ALIASES = {
    "v5litepod": "v5e",
    "v5lite": "v5e",
    "v5 lite": "v5e",
    "v6 lite": "v6e",
    "trillium": "v6e",
    "v5": "v5p",
}


def lookup_tpu(name: str) -> AcceleratorSpec:
    """Returns the `AcceleratorSpec` for a TPU name.

    Accepts a generation (`"v3"`), an accelerator type (`"v3-8"`,
    `"v5litepod-16"`) or a TensorFlow device kind (`"TPU v3"`).

    Raises:
        ValueError: if the name matches no known generation; the message lists
            the known ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a str such as 'v3-8', got {type(name).__name__}.")
    key = name.strip().lower()
    key = re.sub(r"^tpu[\s_-]*", "", key)
    key = re.sub(r"-\d+$", "", key)  # drop the core count of "v3-8"
    key = _ALIASES.get(key, key)
    if key not in HBM_TABLE:
        known = ", ".join(sorted(HBM_TABLE))
        raise ValueError(f"Unknown TPU {name!r}: known generations are {known} "
                         "(also accepted: 'v3-8', 'v5litepod-16', 'TPU v4').")
    return HBM_TABLE[key]


def parse_accelerator_type(device: str) -> tuple[AcceleratorSpec, int]:
    """Splits an accelerator type such as `"v3-8"` into (spec, replicas).

    The number after the dash is Google's core count for v2-v5p slices and the
    chip count for v5e/v6e slices, the same convention `gcloud` uses; the
    replica count follows from it.

    Raises:
        ValueError: if `device` has no `-N` count or names an unknown TPU.
    """
    spec = lookup_tpu(device)
    match = re.search(r"-(\d+)$", device.strip())
    if not match:
        raise ValueError(f"`device` {device!r} needs a size, e.g. '{spec.name}-8'.")
    count = int(match.group(1))
    if count < 1:
        raise ValueError(f"`device` {device!r} must name at least one core or chip.")
    if spec.name in ("v5e", "v6e"):
        replicas = count * spec.replicas_per_chip
    else:
        replicas = max(1, count * spec.replicas_per_chip // spec.cores_per_chip)
    return spec, replicas


_GPU_MEMORY_RE = re.compile(r"(\d+)\s*GB", re.IGNORECASE)

# GPUs whose marketing name does not carry the memory size. Sources: NVIDIA
# data sheets (V100 16 GB SXM2/PCIe default, T4 16 GB, A10 24 GB, L4 24 GB).
GPU_MEMORY_BYTES = {
    "tesla t4": 16 * GB,
    "nvidia a10": 24 * GB,
    "nvidia l4": 24 * GB,
    "tesla v100-sxm2-16gb": 16 * GB,
}


def gpu_memory_bytes(device_name: str | None) -> int | None:
    """Best-effort GPU memory capacity from the device name, or `None`."""
    if not device_name:
        return None
    match = _GPU_MEMORY_RE.search(device_name)
    if match:
        return int(match.group(1)) * GB
    return GPU_MEMORY_BYTES.get(device_name.strip().lower())


#: The device's allocator statistics: `tf.config.experimental.get_memory_info` on
#: TensorFlow, `jax.Device.memory_stats()` on JAX.
SOURCE_ALLOCATOR = "allocator"
#: The resident memory of the whole process (psutil; peak from Linux's VmHWM).
SOURCE_HOST_RSS = "host_rss"
#: Every source, with the words reports use for it.
MEMORY_SOURCES = {
    SOURCE_ALLOCATOR: "allocator",
    SOURCE_HOST_RSS: "host RSS (whole process, not HBM)",
}


def _check_source(source) -> str:
    if source not in MEMORY_SOURCES:
        raise ValueError(
            f"`source` must be one of {sorted(MEMORY_SOURCES)}, got {source!r}."
        )
    return source


def describe_source(source: str | None) -> str:
    """Words for a source in tables and titles: `"allocator"`, `"host RSS (...)"`."""
    if source is None:
        return "unreadable"
    return MEMORY_SOURCES.get(source, str(source))


@dataclasses.dataclass(frozen=True)
class MemoryReading:
    """One device's memory, and where the figures come from.

    Attributes:
        device: Device name, e.g. `"TPU:0"` or `"CPU:0"` (for a `jax.Device`:
            its platform and id, `jax_device_name`).
        current_bytes: Bytes in use now, or `None` if unreadable.
        peak_bytes: Peak bytes since the last reset (or the process start),
            or `None` if unreadable.
        capacity_bytes: Total memory of the device where known, else `None`.
        shared: True when several replicas share this allocator (logical CPUs).
        source: `"allocator"` (the device's allocator statistics), `"host_rss"`
            (the resident memory of the whole process, the fallback for a CPU
            allocator that keeps no statistics), or `None` when unreadable.
        process_wide: True for `"host_rss"`: the figure covers the whole
            process (weights, data, Python, TensorFlow itself), not one device.
    """

    device: str
    current_bytes: int | None
    peak_bytes: int | None
    capacity_bytes: int | None = None
    shared: bool = False
    source: str | None = SOURCE_ALLOCATOR
    process_wide: bool = False

    @property
    def readable(self) -> bool:
        return self.current_bytes is not None


def replica_device_names(strategy) -> list[str]:
    """Full device names of a strategy's replicas, e.g. `/job:.../device:CPU:1`.

    The default strategy has no replica list: its one replica runs where
    TensorFlow places ops, the first GPU if there is one, else the CPU.
    """
    import tensorflow as tf

    try:
        names = list(strategy.extended.worker_devices)
    except (RuntimeError, AttributeError, NotImplementedError):
        names = []
    if not names:
        gpus = tf.config.list_logical_devices("GPU")
        names = [gpus[0].name] if gpus else ["/device:CPU:0"]
    return names


def is_host_device(device) -> bool:
    """True for a CPU device: a name (`"CPU:0"`, `"/job:localhost/.../device:CPU:1"`)
    or a `jax.Device` whose platform is `"cpu"`."""
    if is_jax_device(device):
        return device.platform == "cpu"
    return device.split("device:")[-1].upper().startswith("CPU")


def read_memory(device: str, *, source: str = SOURCE_ALLOCATOR) -> tuple[int, int] | None:
    """Returns `(current_bytes, peak_bytes)` for a device from one source, or `None`.

    With `source="allocator"` (the default) `None` means TensorFlow cannot
    read this allocator: on CPU that is the case when oneDNN is off (the
    default on CPUs without AVX-512, or `TF_ENABLE_ONEDNN_OPTS=0`), because
    the plain CPU allocator keeps no statistics. `source="host_rss"` reads
    the whole process's resident memory (`read_host_memory`) whatever
    `device` is; use it only for the host (see `memory_source`).

    `device` may be a `jax.Device`: then `"allocator"` reads its
    `memory_stats()` (`bytes_in_use`, `peak_bytes_in_use`), `None` where the
    device keeps none (JAX's CPU devices).

    Raises:
        ValueError: if `source` is not `"allocator"` or `"host_rss"`.
    """
    if _check_source(source) == SOURCE_HOST_RSS:
        return read_host_memory()
    if is_jax_device(device):
        stats = jax_memory_stats(device)
        if stats is None or stats.get("bytes_in_use") is None:
            return None
        current = int(stats["bytes_in_use"])
        return current, int(stats.get("peak_bytes_in_use", current))
    import tensorflow as tf

    try:
        info = tf.config.experimental.get_memory_info(device)
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None
    return int(info["current"]), int(info["peak"])


def reset_peak(device: str, *, source: str = SOURCE_ALLOCATOR) -> bool:
    """Resets a device's peak counter; returns False where that is unsupported.

    With `source="host_rss"` the peak starts again from the current RSS; the
    result says whether the OS high-water mark could be reset too (see
    `reset_host_peak`).

    A `jax.Device`'s allocator peak cannot be reset: JAX exposes no such call
    (its `peak_bytes_in_use` counts from the process start), so this returns
    False for one.

    Raises:
        ValueError: if `source` is not `"allocator"` or `"host_rss"`.
    """
    if _check_source(source) == SOURCE_HOST_RSS:
        return reset_host_peak()
    if is_jax_device(device):
        return False
    import tensorflow as tf

    try:
        tf.config.experimental.reset_memory_stats(device)
    except (ValueError, RuntimeError, tf.errors.OpError):
        return False
    return True


def memory_source(device: str) -> str | None:
    """The source that can read `device`, or `None` if none can.

    `"allocator"` where its allocator keeps statistics; `"host_rss"` for a CPU
    device whose allocator keeps none (the host's memory *is* that device's
    memory, counted for the whole process); `None` for a TPU or GPU without
    statistics: the host's RSS says nothing about accelerator memory.
    """
    if read_memory(device) is not None:
        return SOURCE_ALLOCATOR
    if is_host_device(device) and host_memory_readable():
        return SOURCE_HOST_RSS
    return None


def read_memory_reading(device: str, *, capacity_bytes: int | None = None,
                        shared: bool = False, source: str | None = None) -> MemoryReading:
    """Reads `device` into a `MemoryReading` that names its source.

    Args:
        device: A TensorFlow device name, e.g. `"CPU:0"`, `"TPU:3"`, or a
            `jax.Device`.
        capacity_bytes: The device's capacity where known (copied into the
            reading; `None` for the host RSS, which has no HBM capacity). For
            a `jax.Device` read from its allocator, `None` takes `jax_capacity`.
        shared: Whether several replicas share this device's allocator.
        source: `None` picks one (`memory_source`); else `"allocator"` or
            `"host_rss"`.

    Example:

    ```python
    from keras_tpu_mem import devices

    reading = devices.read_memory_reading("CPU:0", shared=True)
    print(reading.source, devices.format_bytes(reading.peak_bytes))
    ```
    """
    source = memory_source(device) if source is None else _check_source(source)
    value = read_memory(device, source=source) if source is not None else None
    if is_jax_device(device):
        if source == SOURCE_ALLOCATOR and capacity_bytes is None:
            capacity_bytes = jax_capacity(device)[0]
        device = jax_device_name(device)
    if value is None:
        return MemoryReading(device, None, None, capacity_bytes, shared, None, False)
    host = source == SOURCE_HOST_RSS
    return MemoryReading(device, value[0], value[1], None if host else capacity_bytes,
                         shared, source, host)


# ------------------------------------------------------------------ JAX devices
#: `jax.Device.platform` -> the kind in a device's name ("TPU:0", "GPU:1", "CPU:0").
_JAX_PLATFORM_KIND = {"tpu": "TPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "cpu": "CPU"}


def is_jax_device(device) -> bool:
    """True for a `jax.Device` (anything with `platform`, `id` and `memory_stats`)."""
    return (not isinstance(device, str) and hasattr(device, "memory_stats")
            and hasattr(device, "platform") and hasattr(device, "id"))


def jax_device_name(device) -> str:
    """`"TPU:3"`, `"GPU:0"`, `"CPU:5"`: a `jax.Device`'s platform and (global) id."""
    platform = str(device.platform)
    return f"{_JAX_PLATFORM_KIND.get(platform, platform.upper())}:{device.id}"


def jax_memory_stats(device) -> dict | None:
    """A `jax.Device`'s `memory_stats()`, or `None` where it keeps none.

    TPU and GPU runtimes report `bytes_in_use`, `peak_bytes_in_use` (since the
    process started) and `bytes_limit`; JAX's CPU devices return `None`.
    Some runtimes raise instead; that is `None` too.
    """
    try:
        stats = device.memory_stats()
    except Exception:  # a runtime without statistics may raise instead
        return None
    return dict(stats) if stats else None


def monitored_jax_devices(distribution=None) -> list:
    """The `jax.Device`s a JAX training step runs on, in this process.

    The devices of `distribution` (default: the active `keras.distribution`)
    that this process addresses, sorted by id; without a distribution, the
    first local device, where Keras' JAX trainer places everything.
    """
    import jax

    if distribution is None:
        import keras

        distribution = keras.distribution.distribution()
    if distribution is None:
        return list(jax.local_devices()[:1])
    mesh = distribution.device_mesh.devices
    flat = list(mesh.flat) if hasattr(mesh, "flat") else list(mesh)
    local = jax.process_index()
    return sorted((d for d in flat if getattr(d, "process_index", local) == local),
                  key=lambda d: d.id)


def jax_capacity(device) -> tuple[int | None, str]:
    """`(bytes, where the figure comes from)` for one `jax.Device`.

    The runtime's `bytes_limit` where `memory_stats()` has one (TPU, GPU);
    else a TPU's per-replica HBM from `HBM_TABLE` by its `device_kind` (JAX
    makes one device per TPU v2/v3 core and per v4+ chip, as `TPUStrategy`
    makes replicas), a GPU's size from its name; `None` on CPU.
    """
    stats = jax_memory_stats(device)
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "bytes_limit of jax.Device.memory_stats()"
    kind = getattr(device, "device_kind", None) or ""
    platform = _JAX_PLATFORM_KIND.get(str(device.platform), str(device.platform).upper())
    if platform == "TPU":
        try:
            spec = lookup_tpu(kind)
        except (ValueError, TypeError):
            return None, f"TPU generation unknown ({kind!r})"
        return spec.hbm_bytes_per_replica, f"{spec.device_kind} per replica (ktm.HBM_TABLE)"
    if platform == "GPU":
        capacity = gpu_memory_bytes(kind)
        return capacity, (f"{kind} (from its name)" if capacity else f"{kind or 'GPU'}: unknown")
    return None, "unknown on CPU (pass capacity_bytes=)"


# ------------------------------------------------------------------ host RSS
# psutil reads the resident set size on every platform it supports; Linux's
# /proc/self/status adds VmHWM, the kernel's own high-water mark of it, which
# catches a peak inside a step that a reading between steps misses. Writing
# "5" to /proc/self/clear_refs (Linux 4.0+) resets VmHWM to the current RSS,
# which is what makes it a per-phase peak rather than one since process start.
_STATUS_PATH = "/proc/self/status"
_CLEAR_REFS_PATH = "/proc/self/clear_refs"


class _HostPeak:
    """Process-wide host-RSS peak state (like an allocator's peak counter)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen: int | None = None  # highest RSS read since the last reset
        # None: never reset, so VmHWM counts from the process start (like an
        # allocator's peak before its first reset); True/False: the last reset
        # did / did not reset VmHWM too.
        self.hwm_reset: bool | None = None
        self.process = None
        self.pid = None


_HOST = _HostPeak()


def _process():
    import psutil

    pid = os.getpid()
    if _HOST.pid != pid:  # after a fork the cached Process names the parent
        _HOST.process, _HOST.pid = psutil.Process(pid), pid
    return _HOST.process


def host_rss_bytes() -> int:
    """The resident set size of this process, in bytes (psutil)."""
    return int(_process().memory_info().rss)


def host_memory_readable() -> bool:
    """Whether this process's RSS can be read here (psutil installed and working)."""
    try:
        host_rss_bytes()
    except Exception:  # ImportError, psutil.Error, OSError on odd platforms
        return False
    return True


def _read_vmhwm() -> int | None:
    try:
        with open(_STATUS_PATH, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_vmhwm() -> bool:
    try:
        with open(_CLEAR_REFS_PATH, "w", encoding="ascii") as f:
            f.write("5")
    except OSError:  # not Linux, an old kernel, or a sandbox that forbids it
        return False
    return True


def reset_host_peak() -> bool:
    """Starts a new host-RSS peak interval at the current RSS.

    Returns True when the OS high-water mark (Linux's VmHWM) was reset too, so
    later peaks include what happened between readings; False where only the
    readings themselves are compared (`host_peak_method()` says which).
    """
    current = host_rss_bytes()
    reset = _reset_vmhwm() and _read_vmhwm() is not None
    with _HOST.lock:
        _HOST.seen = current
        _HOST.hwm_reset = reset
    return reset


def read_host_memory() -> tuple[int, int]:
    """`(current_rss_bytes, peak_rss_bytes)` of this whole process.

    The peak is the highest RSS read since the last `reset_host_peak` (or
    since the first reading), raised to the OS high-water mark where that
    counts from the same moment: after a reset that reset it, or from the
    process start before any reset.
    """
    current = host_rss_bytes()
    hwm = _read_vmhwm() if _HOST.hwm_reset is not False else None
    with _HOST.lock:
        seen = current if _HOST.seen is None else max(_HOST.seen, current)
        _HOST.seen = seen
    return current, (seen if hwm is None else max(seen, hwm))


def host_peak_method() -> str:
    """How the host-RSS peak is taken now, in words (for notices and summaries)."""
    if _HOST.hwm_reset is False or _read_vmhwm() is None:
        return ("highest RSS read between steps (the OS high-water mark cannot be "
                "reset here, so a peak inside a step can be missed)")
    return "the OS high-water mark of the RSS (Linux VmHWM, reset per phase)"


def format_bytes(num: int | float | None) -> str:
    """Formats a byte count as `"1.50 GiB"`; `None` becomes `"unknown"`."""
    if num is None:
        return "unknown"
    num = float(num)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.2f} {unit}"
        num /= 1024
    return f"{num:.2f} TiB"  # pragma: no cover
