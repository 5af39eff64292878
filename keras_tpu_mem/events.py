"""TensorBoard event files, written without TensorFlow on either backend.

TensorBoard's own `EventFileWriter` reaches its files through
`tensorboard.compat.tf`, which loads the real TensorFlow whenever it is
installed — inside a JAX run too. This writer builds the same records (the
TFRecord framing of `tensorboard.summary.writer.record_writer`, TensorBoard's
protobufs) and writes them through the running backend's files
(`backends.current().storage`: `tf.io.gfile` on TensorFlow, TensorBoard's
TensorFlow-free `gfile` on JAX), local or remote alike.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import time

from keras_tpu_mem import backends

_FILE_NUMBERS = itertools.count()



def gfile():
    """The running backend's file functions (`storage.gfile()`: `tf.io.gfile` on
    TensorFlow, TensorBoard's TensorFlow-free stub with fsspec on JAX)."""
    return backends.current().storage.gfile()


class EventFileWriter:
    """Appends TensorBoard summaries to a new `events.out.tfevents.*` file.

    Args:
        log_dir: The directory (created if missing); local or a URL the
            backend's file system reads (`gs://...`).

    Example:

    ```python
    writer = EventFileWriter("logs/run")
    writer.scalars(step=1, values={"loss": 0.5})
    writer.close()
    ```
    """

    def __init__(self, log_dir: str):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event_pb2 = event_pb2
        files = gfile()
        files.makedirs(log_dir)
        name = (f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_FILE_NUMBERS)}")
        self.path = os.path.join(log_dir, name) if "://" not in log_dir else f"{log_dir}/{name}"
        self._records = RecordWriter(files.GFile(self.path, "wb"))
        self._closed = False
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def add_event(self, event) -> None:
        """Writes one `tensorboard.compat.proto.event_pb2.Event`."""
        self._records.write(event.SerializeToString())

    def scalars(self, step: int, values: dict, wall_time: float | None = None) -> None:
        """Writes `{tag: value}` at `step`; None and non-finite values are skipped."""
        from tensorboard.compat.proto import summary_pb2

        summary = summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
            for tag, value in values.items()
            if value is not None and math.isfinite(value)])
        self.add_event(self._event_pb2.Event(wall_time=wall_time or time.time(),
                                             step=int(step), summary=summary))

    def text(self, step: int, tag: str, markdown: str, wall_time: float | None = None) -> None:
        """Writes a text summary (TensorBoard's Text tab) at `step`."""
        from tensorboard.compat.proto import (
            summary_pb2,
            tensor_pb2,
            tensor_shape_pb2,
            types_pb2,
        )

        # What tensorboard.plugins.text writes: a scalar string tensor tagged
        # for the "text" plugin (pure protobuf, no TensorFlow op).
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING,
                                        tensor_shape=tensor_shape_pb2.TensorShapeProto(),
                                        string_val=[markdown.encode("utf-8")])
        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        summary = summary_pb2.Summary(value=[
            summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=metadata)])
        self.add_event(self._event_pb2.Event(wall_time=wall_time or time.time(),
                                             step=int(step), summary=summary))

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._records.close()
