"""Cloud TPU slice names (`"v5e-16"`, `"v4-32"`) and the topologies they stand for.

A Cloud TPU *accelerator type* names a generation and a size: `"v3-8"`,
`"v5litepod-16"`, `"v5p-128"`. `tpu_slice` turns one into a `TPUSlice`: the
chips, the JAX devices they show, the hosts, and the arguments that
`jax.experimental.topologies.get_topology_desc` takes to describe that slice
on a machine without a TPU (`keras_tpu_mem.backends.jax.tpu_topology` does
that).

The number after the dash counts TensorCores on v2, v3, v4 and v5p (two per
chip: `"v3-8"`, `"v4-8"` and `"v5p-8"` are 4 chips) and chips on v5e and v6e
(`"v5litepod-16"` is 16 chips). What one JAX device is differs too: on v2 and
v3 every TensorCore is its own device (`"v3-8"` shows 8); v4 and v5p join a
chip's two TensorCores into one "megacore" device (`"v4-8"` shows 4); a v5e or
v6e chip has one TensorCore and is one device.

The sizes are the ones Cloud TPU sells (cloud.google.com/tpu/docs/<version>,
checked 2026-12): v2 up to a 16x16 pod, v3 up to 32x32, v5e and v6e from one
chip to 16x16; v4 and v5p below one 4x4x4 cube as 2x2x1, 2x2x2, 2x4x4 or
2x2x4 chips, and from one cube on any whole number of cubes (v4 up to its
4096-chip pod, v5p up to the 96 cubes of the largest single v5p slice).
Several shapes hold the same number of cubes; Cloud's default is the one
closest to a cube, which is the one used here.

Plain data and string parsing: this module imports no framework.

Example:

```python
from keras_tpu_mem.devices.tpu_slices import tpu_slice

tpu = tpu_slice("v5litepod-16")
print(tpu.name, tpu.topology, tpu.devices, tpu.hosts)  # v5e-16 v5e:4x4 16 2
print(tpu.hbm_bytes_per_device / 1e9)                  # 16.0
```
"""

from __future__ import annotations

import dataclasses
import re

from keras_tpu_mem.devices.specs import HBM_TABLE, AcceleratorSpec


@dataclasses.dataclass(frozen=True)
class TPUSlice:
    """One Cloud TPU slice: its size, its topology and what JAX shows of it.

    Attributes:
        name: Canonical accelerator type, e.g. `"v5e-16"` (for `"v5litepod-16"`,
            `"TPU v5e-16"`, ...).
        generation: Short generation name, a key of `HBM_TABLE`, e.g. `"v5e"`.
        topology: The topology name `jax.experimental.topologies.get_topology_desc`
            takes, e.g. `"v5e:4x4"` or `"v4:2x2x4"` (libtpu names v5p `"v5"`).
        chip_config: `"megacore"` where a chip's two TensorCores form one
            device (v4, v5p), else `"default"`.
        chips_per_host_bounds: The chips one host holds, as an (x, y, z) box.
        chips: TPU chips in the slice.
        devices: JAX devices the slice shows: one per TensorCore on v2 and
            v3, one per chip from v4 on.
        hosts: TPU VMs (processes) the slice runs on.
        spec: The generation's `AcceleratorSpec` (HBM per chip, device kind).
        wrap: Per dimension, whether the slice's interconnect wraps around
            (a torus rather than a mesh), as `get_topology_desc(wrap=...)`
            takes it.
    """

    name: str
    generation: str
    topology: str
    chip_config: str
    chips_per_host_bounds: tuple[int, int, int]
    chips: int
    devices: int
    hosts: int
    spec: AcceleratorSpec
    wrap: tuple[bool, bool, bool] = (False, False, False)

    @property
    def hbm_bytes_per_device(self) -> int:
        """HBM one JAX device of this slice holds: half a chip's on v2/v3, a chip's from v4 on."""
        return self.spec.hbm_bytes_per_chip * self.chips // self.devices


# Names as users write them -> the generation (a key of HBM_TABLE). Only slice
# generations: "v5" alone is not a Cloud accelerator type, so it is refused here
# even though `lookup_tpu` reads the device kind "TPU v5" as v5p.
_GENERATIONS = {
    "v2": "v2",
    "v3": "v3",
    "v4": "v4",
    "v5e": "v5e",
    "v5litepod": "v5e",
    "v5lite": "v5e",
    "v5p": "v5p",
    "v6e": "v6e",
    "trillium": "v6e",
}

# The 2D slices of v2, v3, v5e and v6e, by the number after the dash (cores
# for v2/v3, chips for v5e/v6e) -> chips along x and y.
_V2_SHAPES = {8: (2, 2), 32: (4, 4), 128: (8, 8), 256: (8, 16), 512: (16, 16)}
_V3_SHAPES = {8: (2, 2), 32: (4, 4), 64: (4, 8), 128: (8, 8), 256: (8, 16),
              512: (16, 16), 1024: (16, 32), 2048: (32, 32)}
_LITE_SHAPES = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8),
                128: (8, 16), 256: (16, 16)}
# The edge of each 2D pod: a slice dimension that spans it wraps around (the
# pods are 2D tori; v5e-128 is 8x16 with the 16 wrapped, v5e-256 both).
_POD_EDGE = {"v2": 16, "v3": 32, "v5e": 16, "v6e": 16}

# v4 and v5p below one 4x4x4 cube: chips -> shape (Cloud's fixed small slices).
_SUB_CUBE_SHAPES = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
_CUBE_CHIPS = 64
# The most cubes one slice can have: v4's pod is 4096 chips (64 cubes); a v5p
# pod has 8960 chips but its largest single slice is 16x16x24 (96 cubes).
_MAX_CUBES = {"v4": 64, "v5p": 96}
# libtpu's topology prefix where it differs from the generation's name.
_TOPOLOGY_PREFIX = {"v5p": "v5"}

_NAME_RE = re.compile(r"^(?:tpu[\s_-]*)?([a-z][a-z0-9]*?)[\s_-]*-\s*(\d+)$")

#: Example slice names for help texts and error messages (not every size: see
#: the module docstring for the rules).
KNOWN_SLICES: tuple[str, ...] = (
    "v2-8", "v2-32", "v3-8", "v3-32", "v4-8", "v4-16", "v4-32",
    "v5e-1", "v5e-4", "v5e-8", "v5e-16", "v5e-32", "v5e-64", "v5e-128", "v5e-256",
    "v5p-8", "v5p-16", "v5p-32", "v5p-128",
    "v6e-1", "v6e-4", "v6e-8", "v6e-16", "v6e-32", "v6e-64", "v6e-128", "v6e-256",
)

_FORMS = ("a Cloud TPU accelerator type '<generation>-<size>': generation v2, v3, v4, "
          "v5e (or v5litepod), v5p or v6e (or trillium); size counts TensorCores on v2, v3, "
          "v4 and v5p (2 per chip) and chips on v5e and v6e; e.g. 'v3-8', 'v4-32', "
          "'v5litepod-16', 'v5p-8', 'v6e-256'")


def tpu_slice(name: str) -> TPUSlice:
    """Returns the `TPUSlice` a Cloud TPU accelerator type names.

    Args:
        name: An accelerator type such as `"v5e-16"`, `"v5litepod-16"`,
            `"v4-32"` or `"TPU v6e-8"` (case and a `"TPU "` prefix ignored).

    Returns:
        The slice: its canonical name, topology, chips, devices and hosts.

    Raises:
        TypeError: if `name` is not a str.
        ValueError: if `name` is not `<generation>-<size>` for a generation
            listed above, or names a size Cloud TPU does not sell (`"v5e-3"`);
            the message says which forms and sizes are accepted.

    Example:

    >>> tpu_slice("v3-8").devices, tpu_slice("v4-8").devices
    (8, 4)
    >>> tpu_slice("v5litepod-16").topology
    'v5e:4x4'
    """
    if not isinstance(name, str):
        raise TypeError(f"A TPU slice name must be a str such as 'v5e-16', "
                        f"got {type(name).__name__}.")
    match = _NAME_RE.match(name.strip().lower())
    generation = _GENERATIONS.get(match.group(1)) if match else None
    if generation is None:
        raise ValueError(f"Unknown TPU slice {name!r}: expected {_FORMS}.")
    size = int(match.group(2))
    spec = HBM_TABLE[generation]
    if generation in ("v2", "v3", "v5e", "v6e"):
        return _slice_2d(name, generation, size, spec)
    return _slice_3d(name, generation, size, spec)


def is_tpu_slice_name(name) -> bool:
    """Whether `tpu_slice` accepts `name`: True for `"v5e-16"`, False for `"12GiB"` or `"v5e-3"`.

    Example:

    >>> is_tpu_slice_name("v5litepod-16"), is_tpu_slice_name("16GB")
    (True, False)
    """
    try:
        tpu_slice(name)
    except (TypeError, ValueError):
        return False
    return True


def _slice_2d(name: str, generation: str, size: int, spec: AcceleratorSpec) -> TPUSlice:
    """v2, v3 (size = TensorCores) and v5e, v6e (size = chips): a table of 2D shapes."""
    per_core = generation in ("v2", "v3")
    shapes = {"v2": _V2_SHAPES, "v3": _V3_SHAPES}.get(generation, _LITE_SHAPES)
    if size not in shapes:
        unit = "TensorCores (2 per chip)" if per_core else "chips"
        sizes = ", ".join(str(s) for s in shapes)
        raise ValueError(f"{name!r} is not a TPU {generation} slice Cloud TPU offers: the number "
                         f"after the dash counts {unit} and is one of {sizes} "
                         f"(e.g. '{generation}-{next(iter(shapes))}').")
    x, y = shapes[size]
    chips = x * y
    if per_core:
        # Four chips (eight TensorCores) per host; every TensorCore is a device.
        host_bounds, hosts, devices = (2, 2, 1), chips // 4, chips * spec.cores_per_chip
    elif chips >= 8:
        # v5e/v6e hosts hold 8 chips as 2x4 (v5e-16 is 2 hosts, v5e-256 is 32).
        host_bounds, hosts, devices = (2, 4, 1), chips // 8, chips
    else:
        # v5e-1 and v5e-4 are one VM with 1 or 4 chips of an 8-chip machine.
        host_bounds, hosts, devices = (x, y, 1), 1, chips
    edge = _POD_EDGE[generation]
    return TPUSlice(
        name=f"{generation}-{size}", generation=generation,
        topology=f"{generation}:{x}x{y}", chip_config="default",
        chips_per_host_bounds=host_bounds, chips=chips, devices=devices, hosts=hosts,
        spec=spec, wrap=(x == edge, y == edge, False))


def _slice_3d(name: str, generation: str, size: int, spec: AcceleratorSpec) -> TPUSlice:
    """v4 and v5p: size = TensorCores; the fixed sub-cube shapes, then whole cubes."""
    chips, odd = divmod(size, spec.cores_per_chip)
    max_chips = _MAX_CUBES[generation] * _CUBE_CHIPS
    if not odd and chips in _SUB_CUBE_SHAPES:
        shape = _SUB_CUBE_SHAPES[chips]
    elif not odd and chips % _CUBE_CHIPS == 0 and 0 < chips <= max_chips:
        shape = tuple(4 * n for n in _most_cubic(chips // _CUBE_CHIPS))
    else:
        sub_cube = ", ".join(str(c * spec.cores_per_chip) for c in _SUB_CUBE_SHAPES)
        cube = _CUBE_CHIPS * spec.cores_per_chip
        raise ValueError(
            f"{name!r} is not a TPU {generation} slice Cloud TPU offers: the number after the "
            f"dash counts TensorCores (2 per chip) and is {sub_cube}, or a multiple of {cube} "
            f"(whole 4x4x4-chip cubes) up to {max_chips * spec.cores_per_chip} "
            f"(e.g. '{generation}-8', '{generation}-{cube}').")
    x, y, z = shape
    # From one cube on, v4 and v5p slices are full 3D tori; smaller ones are
    # meshes without wraparound links (cloud.google.com/tpu/docs/v5p).
    torus = chips >= _CUBE_CHIPS
    return TPUSlice(
        name=f"{generation}-{size}", generation=generation,
        topology=f"{_TOPOLOGY_PREFIX.get(generation, generation)}:{x}x{y}x{z}",
        chip_config="megacore", chips_per_host_bounds=(2, 2, 1), chips=chips,
        devices=chips, hosts=chips // 4, spec=spec, wrap=(torus, torus, torus))


def _most_cubic(cubes: int) -> tuple[int, int, int]:
    """The a <= b <= c with a * b * c == cubes closest to a cube: shortest longest side first."""
    shapes = [(a, b, cubes // (a * b))
              for a in range(1, cubes + 1) for b in range(a, cubes + 1)
              if cubes % (a * b) == 0 and cubes // (a * b) >= b]
    return min(shapes, key=lambda shape: (shape[2], -shape[0]))
