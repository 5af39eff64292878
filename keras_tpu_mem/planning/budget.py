"""Where a plan runs (`DeviceBudget`), precisions, the activation model, and what fits."""

from __future__ import annotations

import dataclasses
import re

from keras_tpu_mem import devices

_BF16_NAMES = {"bf16", "bfloat16", "mixed_bfloat16"}
_F32_NAMES = {"float32", "f32", "fp32"}

_DEVICE_SIZE_RE = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB|KiB|KB|B)\s*(?:[-x*]\s*(\d+))?\s*$", re.IGNORECASE
)
_UNITS = {"gib": devices.GIB, "gb": devices.GB, "mib": 1024**2, "mb": 1000**2,
          "kib": 1024, "kb": 1000, "b": 1}

# --------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceBudget:
    """Where a plan is meant to run: per-replica memory and replica count."""

    name: str
    capacity_bytes: int
    replicas: int
    source: str


def check_headroom(headroom) -> float:
    """`headroom` as a float, checked: a fraction of capacity kept free, in [0, 1).

    Raises:
        TypeError: not a number.
        ValueError: outside [0, 1).
    """
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)):
        raise TypeError(f"`headroom` must be a float in [0, 1), got {headroom!r}.")
    if not 0.0 <= float(headroom) < 1.0:
        raise ValueError(
            f"`headroom` must be in [0, 1) (a fraction of capacity kept free), got {headroom}."
        )
    return float(headroom)


def usable_bytes(capacity_bytes: int, headroom: float) -> int:
    """The bytes a plan may use of `capacity_bytes` once `headroom` (a fraction of
    it, kept free for what the plan does not model) is set aside. Every budget of a
    plan (its verdict, the search's and the bytes XLA:TPU's compile may use) is
    this one figure, so they agree to the byte."""
    return int(capacity_bytes * (1.0 - float(headroom)))


def resolve_device(device, replicas: int | None = None) -> DeviceBudget:
    """Parses `device` for `plan`.

    Accepts a TPU accelerator type (`"v3-8"`, `"v5litepod-16"`, `"v4-32"`: HBM
    per replica from `HBM_TABLE`), a memory size for other devices (`"12GiB"`
    for one device, `"16GB-4"` or `"16GB x4"` for four; units GiB, GB, MiB, MB,
    KiB, KB, or B for a byte count such as `"3145728B"`), or a `DeviceBudget`.

    With `replicas` (the replicas of an active distribution) a size without a
    count is that many devices, and a device that names another count is an
    error: the plan is for the distribution it runs under.

    Raises:
        ValueError / TypeError naming the accepted forms.
    """
    budget = _parse_device(device)
    if replicas is None or replicas == budget.replicas:
        return budget
    size = _DEVICE_SIZE_RE.match(device) if isinstance(device, str) else None
    if size is not None and size.group(3) is None:  # a size without a count
        return dataclasses.replace(budget, name=f"{budget.name} x {replicas}",
                                   replicas=replicas)
    raise ValueError(
        f"`device` {getattr(device, 'name', device)!r} names {budget.replicas} replica(s), "
        f"but the active distribution splits the batch over {replicas} devices: plan for "
        f"the distribution it runs under (a size without a count, e.g. "
        f"'{budget.capacity_bytes}B', takes its {replicas}), or call plan outside its "
        "scope to plan another device count."
    )


def _parse_device(device) -> DeviceBudget:
    if isinstance(device, DeviceBudget):
        return device
    if not isinstance(device, str):
        raise TypeError(
            "`device` must be a TPU type such as 'v3-8', a size such as '12GiB' or "
            f"'16GB-4', or a DeviceBudget; got {type(device).__name__}."
        )
    match = _DEVICE_SIZE_RE.match(device)
    if match:
        amount, unit, count = match.groups()
        capacity = int(float(amount) * _UNITS[unit.lower()])
        replicas = int(count) if count else 1
        if capacity <= 0 or replicas < 1:
            raise ValueError(f"`device` {device!r} must name a positive size and count.")
        name = f"{amount} {unit}" + (f" x {replicas}" if replicas > 1 else "")
        return DeviceBudget(name, capacity, replicas, "given")
    try:
        spec, replicas = devices.parse_accelerator_type(device)
    except ValueError as err:
        raise ValueError(
            f"Unknown `device` {device!r}: pass a TPU type such as 'v3-8', 'v4-32', "
            "'v5litepod-16' (known generations: " + ", ".join(sorted(devices.HBM_TABLE))
            + "), or a memory size such as '12GiB' (one device), '16GB-4' (four) or a byte count "
            "such as '3145728B'."
        ) from err
    return DeviceBudget(device.strip(), spec.hbm_bytes_per_replica, replicas, spec.source)


def _normalise_precision(precision) -> str | None:
    if precision is None:
        return None
    if isinstance(precision, str):
        key = precision.strip().lower()
        if key in _BF16_NAMES:
            return "mixed_bfloat16"
        if key in _F32_NAMES:
            return "float32"
    raise ValueError(
        f"`precision` must be None (the model's own), 'float32' or 'mixed_bfloat16' "
        f"(also 'bf16', 'bfloat16'); got {precision!r}."
    )


def model_precision(model) -> str:
    """`"mixed_bfloat16"` if any layer computes in bfloat16, else `"float32"`."""
    from keras_tpu_mem._compat import keras as keras_compat

    for layer in keras_compat.flatten_layers(model, include_self=True):
        if str(getattr(layer, "compute_dtype", "float32")) == "bfloat16":
            return "mixed_bfloat16"
    return "float32"


@dataclasses.dataclass(frozen=True)
class ActivationModel:
    """XLA temporaries as a function of the per-replica batch.

    Compiled batches are used as they are; other batches are interpolated
    linearly between the nearest compiled ones, or extrapolated along the line
    through the two largest (or two smallest) compiled batches.
    """

    points: tuple[tuple[int, int], ...]  # (batch, temp bytes), sorted

    def __call__(self, batch: int) -> float:
        pts = self.points
        for b, t in pts:
            if b == batch:
                return float(t)
        if len(pts) == 1:
            (b, t), = pts
            return float(t) * batch / b
        if batch > pts[-1][0]:
            i = len(pts) - 2
        elif batch < pts[0][0]:
            i = 0
        else:
            i = next(j for j in range(len(pts) - 1) if pts[j][0] < batch < pts[j + 1][0])
        (b0, t0), (b1, t1) = pts[i], pts[i + 1]
        value = t1 + (batch - b1) * (t1 - t0) / (b1 - b0)
        return max(0.0, value)

    @property
    def per_sample_bytes(self) -> float:
        """Slope between the two largest compiled batches."""
        if len(self.points) < 2:
            b, t = self.points[0]
            return t / b
        (b0, t0), (b1, t1) = self.points[-2], self.points[-1]
        return (t1 - t0) / (b1 - b0)

    @property
    def fixed_bytes(self) -> float:
        """Batch-independent part: the line's value at batch 0 (gradients, workspace)."""
        b1, t1 = self.points[-1]
        return max(0.0, t1 - self.per_sample_bytes * b1)

    def scaled(self, factor: float, extra_fixed: float = 0.0) -> ActivationModel:
        """Per-sample part scaled by `factor`, `extra_fixed` bytes added (bf16 estimates)."""
        fixed = self.fixed_bytes
        return ActivationModel(tuple(
            (b, int(round(max(0.0, min(t, fixed) + max(0.0, t - fixed) * factor
                              + extra_fixed))))
            for b, t in self.points
        ))

    def linearity_error(self) -> float | None:
        """Relative miss of the middle of the three largest points off their chord."""
        if len(self.points) < 3:
            return None
        (b0, t0), (bm, tm), (b1, t1) = self.points[-3:]
        predicted = t0 + (bm - b0) * (t1 - t0) / (b1 - b0)
        return abs(predicted - tm) / max(tm, 1)


def divisors(n: int) -> list[int]:
    """The accumulation steps a batch of `n` splits into evenly, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


def largest_batch(budget, fixed_state, act, data_per_sample, other, limit=1 << 24) -> int:
    """Largest batch b with fixed_state + act(b) + data(b) + other <= budget (0: none)."""
    def fits(b):
        return fixed_state + act(b) + data_per_sample * b + other <= budget

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
