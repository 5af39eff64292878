"""The host's memory: the resident set size (RSS) of this whole process.

The fallback source (`"host_rss"`) for a CPU device whose allocator keeps no
statistics (TensorFlow's CPU allocator with oneDNN off, JAX's CPU devices). It
is a process-wide figure (weights, data, Python, the framework itself), never
HBM. The peak is kept like an allocator's peak counter: `reset_host_peak`
starts an interval, `read_host_memory` reads the current RSS and the interval's
peak.

Example:

```python
from keras_tpu_mem.devices import host

host.reset_host_peak()
current, peak = host.read_host_memory()
print(host.host_peak_method())
```
"""

from __future__ import annotations

import os
import threading

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
