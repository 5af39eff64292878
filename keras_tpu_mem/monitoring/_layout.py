"""What the monitors' files look like, shared with `keras-tpu-mem report`.

The run directory's names, the device labels and the table format. Nothing
here imports Keras or a framework, so the report (which only reads files)
loads neither TensorFlow nor JAX.
"""

from __future__ import annotations

from keras_tpu_mem import devices

TIMELINE_FILE = "timeline.jsonl"
SUMMARY_FILE = "summary.json"
MEMORY_SUBDIR = "ktm_memory"
THROUGHPUT_SUBDIR = "ktm_throughput"
SHARED_CPU_LABEL = "CPU (shared)"
#: The label of the host-RSS fallback: the whole process, read where the CPU
#: allocator keeps no statistics.
HOST_RSS_LABEL = "CPU (process RSS)"
SOURCE_TAG = "memory_source"  # the TensorBoard text tag naming each device's source
#: Marks a peak that is an upper bound, not the phase's own (a peak counter that
#: cannot be reset, as JAX's: the phase stayed at or below a mark set earlier).
UPPER_BOUND_MARK = "<= "


def format_table(rows) -> str:
    """Formats rows of strings as left-aligned columns (first row is the header)."""
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip()
        for row in rows
    )


def _fmt_bytes(num, exact: bool | None = True) -> str:
    """Bytes as a table cell; `exact=False` marks an upper bound (`"<= 1.00 GiB"`)."""
    if num is None:
        return "-"
    return ("" if exact is not False else UPPER_BOUND_MARK) + devices.format_bytes(num)


def source_column(source: str | None) -> str:
    """A memory source as a table cell: `allocator`, `host RSS (process)`."""
    if source is None or source == devices.SOURCE_ALLOCATOR:
        return "allocator"  # timelines written before sources were recorded
    if source == devices.SOURCE_HOST_RSS:
        return "host RSS (process)"
    return str(source)
