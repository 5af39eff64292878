"""Monitor timelines written by hand, and PNG checks, for the report's tests."""

from __future__ import annotations

import json

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_timeline(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def memory_record(step, attempt, peak, *, begin_step, phase="train", epoch=0, t=None,
                   source="allocator", device="TPU:0"):
    return {"step": step, "time": 1000.0 * attempt + step if t is None else t, "phase": phase,
            "epoch": epoch, "attempt": attempt, "begin_step": begin_step,
            "memory_source": source,
            "devices": {device: {"current_bytes": peak // 2, "peak_bytes": peak,
                                 "capacity_bytes": None, "shared": source == "host_rss",
                                 "source": source, "process_wide": source == "host_rss"}}}


def throughput_record(step, attempt, *, begin_step, phase="train", seconds=0.01, samples=32):
    return {"step": step, "time": 1000.0 * attempt + step, "phase": phase, "epoch": 0,
            "attempt": attempt, "begin_step": begin_step, "steps": 1, "samples": samples,
            "seconds": seconds, "samples_per_sec": samples / seconds,
            "steps_per_sec": 1 / seconds, "step_time_ms": 1000 * seconds}


def decode(path):
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    return matplotlib.image.imread(str(path))
