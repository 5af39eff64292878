"""What each accelerator generation holds: `HBM_TABLE` and the GPU sizes by name.

`HBM_TABLE` says how much high-bandwidth memory one *replica* of each TPU
generation has under `tf.distribute.TPUStrategy` (and per `jax.Device`, which
JAX makes per TPU v2/v3 core and per v4+ chip in the same way), with the
per-chip figure and where it comes from. Per-core and per-chip numbers differ:
on TPU v2 and v3 every TensorCore is its own replica (two per chip, each with
half of the chip's HBM); from v4 on, the two TensorCores of a chip act as one
"megacore" replica (v4, v5p), or the chip has one TensorCore (v5e, v6e).

Plain data and string parsing: this module imports no framework, so
`ktm.HBM_TABLE` and `ktm.lookup_tpu` work where neither TensorFlow nor JAX is
installed.
"""

from __future__ import annotations

import dataclasses
import re

from keras_tpu_mem.devices.units import GB, GIB


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
