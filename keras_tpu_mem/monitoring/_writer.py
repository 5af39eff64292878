"""The monitors' run directory: TensorBoard events and the JSON-lines timeline.

Written from a background thread, so the training thread only queues records.
Needs no TensorFlow on JAX, local or remote: the files go through the running
backend's storage (`backends.current().storage`) and the events through
`keras_tpu_mem.events`, which never loads TensorFlow. Where the `tensorboard`
package is missing (it is a requirement, but a trimmed environment may lack it)
the timeline and summary are still written, with one notice that names what
adds the events.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time

from keras_tpu_mem import backends
from keras_tpu_mem._utils import log_once
from keras_tpu_mem.monitoring._layout import SUMMARY_FILE, TIMELINE_FILE


def _event_writer_class():
    """`keras_tpu_mem.events.EventFileWriter`, or None without `tensorboard`."""
    try:
        import tensorboard.compat.proto.event_pb2  # noqa: F401
    except ImportError:
        return None
    from keras_tpu_mem.events import EventFileWriter

    return EventFileWriter


def _notice_no_tensorboard(directory: str) -> None:
    log_once(
        "no tensorboard", logging.WARNING,
        "keras_tpu_mem monitors: the `tensorboard` package is not installed, so no "
        "TensorBoard events are written (first under %s); timeline.jsonl and summary.json, "
        "which `keras-tpu-mem report` reads, are. `pip install tensorboard` adds the events.",
        directory)


# ------------------------------------------------------------ file outputs
class _RunFiles:
    """A monitor's run directory: TensorBoard events plus the JSON-lines timeline.

    Each `fit` is one *attempt*; its records carry the attempt number, and the
    timeline is appended to, never truncated, so a run resumed with
    `BackupAndRestore` continues the same file.

    The training thread only puts records on a queue (about a microsecond);
    a background thread encodes them, writes the files and flushes them to
    disk at least once a second while there is something new, at epoch ends
    and at the end of training (so a run killed without `on_train_end`, as a
    preempted one is, loses about the last second of records). On `gs://` and
    other stores that cannot append, the timeline is rewritten whole at each
    flush, so there the periodic flush is once a minute. TensorBoard
    events are written with a pure-Python event writer (`keras_tpu_mem.events`), not
    `tf.summary` ops: a `tf.summary.scalar` costs about 0.4 ms per call in
    eager mode, and writing and flushing in the training thread cost about
    0.2 ms per step, either of which alone would break a 2% overhead budget
    on a 10 ms step.
    """

    _FLUSH_EVERY_S = 1.0          # local files
    _REMOTE_FLUSH_EVERY_S = 60.0  # gs:// and the like: each flush rewrites the timeline

    def __init__(self, log_dir: str, subdir: str):
        self.dir = os.path.join(log_dir, subdir)
        self._remote = "://" in self.dir
        self.timeline_path = os.path.join(self.dir, TIMELINE_FILE)
        self._lines: list[str] = []
        if self._remote:
            self._gfile = backends.current().storage.gfile()
            self._gfile.makedirs(self.dir)
            if self._gfile.exists(self.timeline_path):
                with self._gfile.GFile(self.timeline_path, "r") as f:
                    self._lines = f.read().splitlines(keepends=True)
            self.attempt = _last_attempt(self._lines[-50:]) + 1
            self._file = None
        else:
            os.makedirs(self.dir, exist_ok=True)
            self.attempt = _last_attempt(_tail_lines(self.timeline_path)) + 1
            self._file = open(self.timeline_path, "a", encoding="utf-8")  # noqa: SIM115
        writer_class = _event_writer_class()
        #: Whether TensorBoard events are written (False without `tensorboard`).
        self.writes_events = writer_class is not None
        self._events = writer_class(self.dir) if writer_class else None
        if self._events is None:
            _notice_no_tensorboard(self.dir)
        self._flush_every = self._REMOTE_FLUSH_EVERY_S if self._remote else self._FLUSH_EVERY_S
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True,
                                        name=f"keras_tpu_mem-{subdir}-writer")
        self._thread.start()

    # -------------------------------------------------- training thread
    def _put(self, item) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(f"writing {self.dir} failed: {error}") from error
        self._queue.put(item)

    def record(self, record: dict) -> None:
        """Appends one timeline record (the attempt number is added)."""
        record["attempt"] = self.attempt
        self._put(("record", record))

    def scalars(self, step: int, values: dict, wall_time: float | None = None) -> None:
        """Writes TensorBoard scalars `{tag: value}` at `step`; None and NaN are skipped."""
        self._put(("scalars", int(step), values, wall_time or time.time()))

    def text(self, step: int, tag: str, markdown: str) -> None:
        """Writes a TensorBoard text summary (Text tab) at `step`."""
        self._put(("text", int(step), tag, markdown, time.time()))

    def flush(self, timeout: float = 30.0) -> None:
        """Blocks until everything queued so far is on disk."""
        done = threading.Event()
        self._put(("flush", done))
        done.wait(timeout)

    def write_summary(self, summary: dict) -> None:
        path = os.path.join(self.dir, SUMMARY_FILE)
        text = json.dumps(summary, indent=2, default=str)
        if self._remote:
            with self._gfile.GFile(path + ".tmp", "w") as f:
                f.write(text)
            self._gfile.rename(path + ".tmp", path, overwrite=True)
        else:
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._queue.put(None)
            self._thread.join(timeout=30.0)
            if self._events is not None:
                self._events.close()
            if self._file is not None:
                self._file.close()
                self._file = None

    # ------------------------------------------------ writer thread
    def _work(self) -> None:
        last_flush, dirty = time.monotonic(), False
        while True:
            try:
                item = self._queue.get(timeout=min(self._flush_every / 2, 0.5))
            except queue.Empty:
                # Idle: put what was written on disk, so that a run killed
                # without on_train_end (a preemption) loses at most ~1 s of it.
                if dirty and time.monotonic() - last_flush > self._flush_every:
                    self._safely(self._flush_files)
                    last_flush, dirty = time.monotonic(), False
                continue
            if item is None:
                return
            kind = item[0]
            if kind == "record":
                self._safely(self._write_line, item[1])
                dirty = True
            elif kind == "scalars":
                self._safely(self._write_event, *item[1:])
                dirty = True
            elif kind == "text":
                self._safely(self._write_text, *item[1:])
                dirty = True
            elif kind == "flush":
                self._safely(self._flush_files)
                last_flush, dirty = time.monotonic(), False
                item[1].set()
            if dirty and time.monotonic() - last_flush > self._flush_every:
                self._safely(self._flush_files)
                last_flush, dirty = time.monotonic(), False

    def _safely(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as err:  # reported to the training thread at its next write
            self._error = err

    def _write_line(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        if self._file is not None:
            self._file.write(line)
        else:
            self._lines.append(line)

    def _write_event(self, step, values, wall_time) -> None:
        if self._events is not None:
            self._events.scalars(step, values, wall_time)

    def _write_text(self, step, tag, markdown, wall_time) -> None:
        if self._events is not None:
            self._events.text(step, tag, markdown, wall_time)

    def _flush_files(self) -> None:
        if self._file is not None:
            self._file.flush()
        else:
            # Object stores cannot append: rewrite the whole file, then move it
            # over the old one (a crash in between leaves the old one intact).
            tmp = self.timeline_path + ".tmp"
            with self._gfile.GFile(tmp, "w") as f:
                f.write("".join(self._lines))
            self._gfile.rename(tmp, self.timeline_path, overwrite=True)
        if self._events is not None:
            self._events.flush()


def _tail_lines(path: str, nbytes: int = 65536) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - nbytes))
        data = f.read().decode("utf-8", errors="replace")
    return data.splitlines()


def _last_attempt(lines) -> int:
    last = 0
    for line in lines:
        try:
            last = max(last, int(json.loads(line).get("attempt", 0)))
        except (ValueError, TypeError, AttributeError):
            continue  # a line cut short by a crash
    return last
