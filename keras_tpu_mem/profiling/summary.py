"""Reading a captured profile back: `summarize_profile` and its `ProfileSummary`.

XProf's converters (xprof, the `[profile]` extra; or an older
tensorboard_plugin_profile) turn a `*.xplane.pb` into the tools TensorBoard's
Profile tab shows; this module calls them without a server and keeps two
figures: the step time from the overview page and, for XLA-compiled steps, the
memory viewer's peak heap of the module that ran. Captures of either backend
read the same way. Without a converter the summary is a note that names the
extra (said once per process).

Example:

```python
from keras_tpu_mem.profiling import summarize_profile

summary = summarize_profile("logs/plugins/profile/2026_01_01_00_00_00/host.xplane.pb")
print(summary.text())
```
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import shutil
import tempfile

from keras_tpu_mem import backends, devices
from keras_tpu_mem._compat import profiler as profiler_compat
from keras_tpu_mem._utils import log_once


def _find_converter():
    """The XSpace converter finder (tests replace it to simulate a bare install)."""
    return profiler_compat.find_xspace_converter()


class _Converter:
    """An XSpace converter: xprof's (or an older tensorboard_plugin_profile's).

    All of them wrap the same C++ `xspace_to_tools_data(paths, tool, options)`
    (see `keras_tpu_mem._compat.profiler`).
    """

    def __init__(self):
        found, detail = _find_converter()
        self.name = found
        self.reason = None if found else detail
        self._raw = detail if found else None

    @property
    def available(self) -> bool:
        return self._raw is not None

    def tool_names(self, paths: list[str]) -> list[str]:
        data, ok = self._raw(paths, "tool_names")
        if not ok:
            return []
        data = data.decode() if isinstance(data, bytes) else str(data)
        return [t for t in data.split(",") if t]

    def tool(self, paths: list[str], tool: str, options: dict | None = None):
        data, ok = self._raw(paths, tool, dict(options or {}))
        if not ok or not data:
            return None
        if isinstance(data, bytes):
            data = data.decode("utf-8", errors="replace")
        return json.loads(data)


@dataclasses.dataclass(frozen=True)
class ProfileSummary:
    """What `ProfileWindow` read back from one capture.

    Attributes:
        run_dir: The run directory TensorBoard lists (`log_dir/plugins/profile/<run>`).
        xplane_path: The captured `*.xplane.pb`.
        first_step, last_step: Training steps (0-based, this `fit` call) traced.
        steps_per_execution: Steps in each traced execution.
        step_time_ms: Average time of one traced execution from the overview
            page (`None` where unknown), and its min / max.
        peak_heap_bytes: The memory viewer's peak heap of the largest XLA
            module captured (`None` where no XLA module was captured).
        module_name: That module's name.
        wall_ms_per_step: Host wall-clock time per traced step, measured by
            the callback around each execution (profiler on), or None.
        note: Why a part is missing, if it is.
    """

    run_dir: str
    xplane_path: str
    first_step: int
    last_step: int
    steps_per_execution: int = 1
    step_time_ms: float | None = None
    step_time_min_ms: float | None = None
    step_time_max_ms: float | None = None
    peak_heap_bytes: int | None = None
    module_name: str | None = None
    wall_ms_per_step: float | None = None
    note: str | None = None

    def text(self) -> str:
        lines = [f"ProfileWindow: captured steps {self.first_step}..{self.last_step} into "
                 f"{self.run_dir}"]
        if self.step_time_ms is not None:
            spe = self.steps_per_execution
            unit = "step" if spe == 1 else f"execution of {spe} steps"
            line = (f"  step time (overview page): {self.step_time_ms:.2f} ms per {unit} "
                    f"(min {self.step_time_min_ms:.2f}, max {self.step_time_max_ms:.2f})")
            if spe > 1:
                line += f" = {self.step_time_ms / spe:.2f} ms per step"
            lines.append(line)
        if self.wall_ms_per_step is not None:
            lines.append(f"  host wall clock: {self.wall_ms_per_step:.2f} ms per step over "
                         f"{self.last_step - self.first_step + 1} steps (profiler on)")
        if self.peak_heap_bytes is not None:
            lines.append(f"  XLA peak heap (memory viewer): "
                         f"{devices.format_bytes(self.peak_heap_bytes)} in {self.module_name}")
        if self.note:
            lines.append(f"  note: {self.note}")
        open_it = (f"  open it: tensorboard --logdir "
                   f"{os.path.dirname(os.path.dirname(os.path.dirname(self.run_dir)))} "
                   "-> Profile")
        if not profiler_compat.profile_plugin_installed():
            open_it += (f" (TensorBoard's Profile tab needs tensorboard-plugin-profile: "
                        f"{profiler_compat.PROFILE_EXTRA})")
        lines.append(open_it)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


_HLO_FILE_RE = re.compile(r"^(?P<name>.+?)(?:\((?P<pid>\d+)\))?\.hlo_proto\.pb$")


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def executed_xla_modules(xplane_path: str) -> set[str] | None:
    """Names of the XLA modules that ran in a capture, or None if unreadable.

    The profiler stores every XLA module compiled so far in the process in the
    capture's metadata, also those that did not run in the window. Execution
    events carry an `hlo_module` stat (XLA:CPU thunks, TPU/GPU ops) and device
    planes have an "XLA Modules" line; those name the modules that ran.
    """
    # The backend's XSpace class: on JAX never TensorFlow's, whose import would
    # load all of TensorFlow into a JAX run.
    xspace_cls = backends.current("executed_xla_modules").profiler.xspace_class()
    if xspace_cls is None:
        return None
    space = xspace_cls()
    try:
        with open(xplane_path, "rb") as handle:
            space.ParseFromString(handle.read())
    except Exception:
        return None
    names: set[str] = set()
    for plane in space.planes:
        stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
        module_ids = {k for k, n in stat_names.items() if n == "hlo_module"}
        for line in plane.lines:
            if line.name == "XLA Modules":
                for event in line.events:
                    meta = plane.event_metadata.get(event.metadata_id)
                    if meta is not None:
                        names.add(re.sub(r"\(\d+\)$", "", meta.name))
                continue
            if not module_ids:
                continue
            for event in line.events:
                for stat in event.stats:
                    if stat.metadata_id in module_ids:
                        value = stat.str_value or stat_names.get(stat.ref_value, "")
                        if value:
                            names.add(re.sub(r"\(\d+\)$", "", value))
    return names




def _notice_missing_converter(reason: str) -> None:
    """Says once per process that the summary needs xprof, and which extra adds it."""
    log_once(
        "no xprof converter", logging.INFO,
        "ProfileWindow: the capture is written, but its summary (step time, XLA peak heap) "
        "needs xprof's converters, which are not installed: %s adds them (%s).",
        profiler_compat.PROFILE_EXTRA, reason)


def summarize_profile(xplane_path: str, *, first_step: int = 0, last_step: int = 0,
                      steps_per_execution: int = 1) -> ProfileSummary:
    """Reads step time and XLA peak memory from a captured `*.xplane.pb`.

    Converts a temporary copy, so the converters' cache files (`*.hlo_proto.pb`,
    `*.op_stats*.pb`) never land in the run directory: it keeps only what
    the framework's profiler wrote, as TensorBoard would have found it.
    Works on captures of either backend.
    """
    run_dir = os.path.dirname(xplane_path)
    base = dict(run_dir=run_dir, xplane_path=xplane_path, first_step=first_step,
                last_step=last_step, steps_per_execution=steps_per_execution)
    converter = _Converter()
    if not converter.available:
        _notice_missing_converter(converter.reason)
        return ProfileSummary(**base, note=(
            f"no step-time or peak-heap summary: xprof's converters are not installed "
            f"({profiler_compat.PROFILE_EXTRA} adds them); the capture itself is complete: "
            "open it in TensorBoard's Profile tab"))
    notes = []
    step = dict(step_time_ms=None, step_time_min_ms=None, step_time_max_ms=None)
    peak = module = None
    with tempfile.TemporaryDirectory(prefix="ktm_xprof_") as tmp:
        copy = os.path.join(tmp, os.path.basename(xplane_path))
        shutil.copyfile(xplane_path, copy)
        try:
            tools = converter.tool_names([copy])  # also writes the HLO protos
        except Exception as err:  # a converter crash must not end training
            tools = []
            notes.append(f"tool list failed ({type(err).__name__}: {err})")
        if "overview_page" in tools:
            try:
                overview = converter.tool([copy], "overview_page")
                props = overview[1]["p"] if overview else {}
                average = _float(props.get("steptime_ms_average"))
                if average:
                    step = dict(step_time_ms=average,
                                step_time_min_ms=_float(props.get("steptime_ms_minimum")),
                                step_time_max_ms=_float(props.get("steptime_ms_maximum")))
                else:
                    notes.append("the overview page measured no step time; see the host wall clock")
            except Exception as err:
                notes.append(f"overview page failed ({type(err).__name__}: {err})")
        ran = executed_xla_modules(copy) if "memory_viewer" in tools else None
        if "memory_viewer" in tools:
            for path in glob.glob(os.path.join(tmp, "*.hlo_proto.pb")):
                match = _HLO_FILE_RE.match(os.path.basename(path))
                if not match or (ran is not None and match.group("name") not in ran):
                    continue  # compiled earlier in the process, not run in the window
                # The module is named as the converter named its file,
                # program id included: "a_inference_..._803__.7(0)".
                full_name = os.path.basename(path)[: -len(".hlo_proto.pb")]
                options = {"module_name": full_name,
                           "view_memory_allocation_timeline": False, "memory_space": ""}
                try:
                    viewer = converter.tool([copy], "memory_viewer", options)
                except Exception as err:
                    notes.append(f"memory viewer failed ({type(err).__name__}: {err})")
                    continue
                mib = _float((viewer or {}).get("peakHeapMib"))
                if mib is not None and (peak is None or mib * 2**20 > peak):
                    peak, module = int(round(mib * 2**20)), match.group("name")
        if peak is None and "memory_viewer" in tools:
            notes.append("no XLA-compiled step ran in the window (compile with "
                         "jit_compile=True, as on TPU, to see XLA's peak heap)")
    return ProfileSummary(**base, **step, peak_heap_bytes=peak, module_name=module,
                          note="; ".join(notes) or None)
