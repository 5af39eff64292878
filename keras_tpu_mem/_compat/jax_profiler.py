"""The profiler pieces a JAX-only environment lacks: an `XSpace` class without TensorFlow.

`ProfileWindow` on JAX captures with the public `jax.profiler` API
(`start_trace` / `stop_trace`, `StepTraceAnnotation`, `start_server`); none of
that is private. What is missing without TensorFlow is a Python class for the
`XSpace` message a `*.xplane.pb` holds: TensorFlow ships TSL's generated
`xplane_pb2` (`keras_tpu_mem._compat.profiler.XSPACE_PROTOS`), JAX and xprof
ship none. `ProfileWindow`'s summary reads a capture's execution events with
it, to tell the XLA modules that ran in the window from those merely compiled
earlier in the process (the converters report every module compiled so far).

`xspace_class()` builds that class at run time from the schema below: TSL's
`tsl/profiler/protobuf/xplane.proto` (proto3; field numbers checked against
TensorFlow 2.21.0's `xplane_pb2` descriptor, which
`tests/test_compat_jax_profiler.py` compares it with, message by message),
placed in a private descriptor pool so it never clashes with TensorFlow's
`tensorflow.profiler.XSpace` in the same process. It needs only `protobuf`
(checked: 7.36.2; `message_factory.GetMessageClass` since protobuf 4.21, the
older `MessageFactory.GetPrototype` before).
"""

from __future__ import annotations

import functools

#: The package of the private copy (TSL's own is `tensorflow.profiler`).
PACKAGE = "keras_tpu_mem.xplane"

# TSL's xplane.proto, message by message: (field name, number, label, type,
# message type or None, oneof name or None). Labels: 1 optional, 3 repeated.
# Types (FieldDescriptorProto.Type): 1 double, 3 int64, 4 uint64, 9 string,
# 11 message, 12 bytes.
_OPTIONAL, _REPEATED = 1, 3
_DOUBLE, _INT64, _UINT64, _STRING, _MESSAGE, _BYTES = 1, 3, 4, 9, 11, 12
SCHEMA: dict[str, tuple] = {
    "XSpace": (
        ("planes", 1, _REPEATED, _MESSAGE, "XPlane", None),
        ("errors", 2, _REPEATED, _STRING, None, None),
        ("warnings", 3, _REPEATED, _STRING, None, None),
        ("hostnames", 4, _REPEATED, _STRING, None, None),
    ),
    "XPlane": (
        ("id", 1, _OPTIONAL, _INT64, None, None),
        ("name", 2, _OPTIONAL, _STRING, None, None),
        ("lines", 3, _REPEATED, _MESSAGE, "XLine", None),
        ("event_metadata", 4, _REPEATED, _MESSAGE, "XPlane.EventMetadataEntry", None),
        ("stat_metadata", 5, _REPEATED, _MESSAGE, "XPlane.StatMetadataEntry", None),
        ("stats", 6, _REPEATED, _MESSAGE, "XStat", None),
    ),
    "XLine": (
        ("id", 1, _OPTIONAL, _INT64, None, None),
        ("display_id", 10, _OPTIONAL, _INT64, None, None),
        ("name", 2, _OPTIONAL, _STRING, None, None),
        ("display_name", 11, _OPTIONAL, _STRING, None, None),
        ("timestamp_ns", 3, _OPTIONAL, _INT64, None, None),
        ("duration_ps", 9, _OPTIONAL, _INT64, None, None),
        ("events", 4, _REPEATED, _MESSAGE, "XEvent", None),
    ),
    "XEvent": (
        ("metadata_id", 1, _OPTIONAL, _INT64, None, None),
        ("offset_ps", 2, _OPTIONAL, _INT64, None, "data"),
        ("num_occurrences", 5, _OPTIONAL, _INT64, None, "data"),
        ("duration_ps", 3, _OPTIONAL, _INT64, None, None),
        ("stats", 4, _REPEATED, _MESSAGE, "XStat", None),
    ),
    "XStat": (
        ("metadata_id", 1, _OPTIONAL, _INT64, None, None),
        ("double_value", 2, _OPTIONAL, _DOUBLE, None, "value"),
        ("uint64_value", 3, _OPTIONAL, _UINT64, None, "value"),
        ("int64_value", 4, _OPTIONAL, _INT64, None, "value"),
        ("str_value", 5, _OPTIONAL, _STRING, None, "value"),
        ("bytes_value", 6, _OPTIONAL, _BYTES, None, "value"),
        ("ref_value", 7, _OPTIONAL, _UINT64, None, "value"),
    ),
    "XEventMetadata": (
        ("id", 1, _OPTIONAL, _INT64, None, None),
        ("name", 2, _OPTIONAL, _STRING, None, None),
        ("display_name", 4, _OPTIONAL, _STRING, None, None),
        ("metadata", 3, _OPTIONAL, _BYTES, None, None),
        ("stats", 5, _REPEATED, _MESSAGE, "XStat", None),
        ("child_id", 6, _REPEATED, _INT64, None, None),
    ),
    "XStatMetadata": (
        ("id", 1, _OPTIONAL, _INT64, None, None),
        ("name", 2, _OPTIONAL, _STRING, None, None),
        ("description", 3, _OPTIONAL, _STRING, None, None),
    ),
}
#: XPlane's two maps (int64 key -> message), as protobuf spells map fields.
MAP_ENTRIES = {
    "XPlane": (("EventMetadataEntry", "XEventMetadata"), ("StatMetadataEntry", "XStatMetadata")),
}


def _file_descriptor_proto():
    from google.protobuf import descriptor_pb2

    file_proto = descriptor_pb2.FileDescriptorProto(
        name="keras_tpu_mem/xplane.proto", package=PACKAGE, syntax="proto3")
    for name, fields in SCHEMA.items():
        message = file_proto.message_type.add(name=name)
        oneofs: list[str] = []
        for field_name, number, label, kind, type_name, oneof in fields:
            field = message.field.add(name=field_name, number=number, label=label, type=kind)
            if type_name is not None:
                field.type_name = f".{PACKAGE}.{type_name}"
            if oneof is not None:
                if oneof not in oneofs:
                    oneofs.append(oneof)
                    message.oneof_decl.add(name=oneof)
                field.oneof_index = oneofs.index(oneof)
        for entry_name, value_type in MAP_ENTRIES.get(name, ()):
            entry = message.nested_type.add(name=entry_name)
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, label=_OPTIONAL, type=_INT64)
            entry.field.add(name="value", number=2, label=_OPTIONAL, type=_MESSAGE,
                            type_name=f".{PACKAGE}.{value_type}")
    return file_proto


@functools.cache
def _message_classes() -> dict:
    from google.protobuf import descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    file_descriptor = pool.Add(_file_descriptor_proto())
    if hasattr(file_descriptor, "message_types_by_name"):
        descriptors = dict(file_descriptor.message_types_by_name)
    else:  # pragma: no cover - protobuf versions whose Add returns nothing useful
        descriptors = {n: pool.FindMessageTypeByName(f"{PACKAGE}.{n}") for n in SCHEMA}
    get_class = getattr(message_factory, "GetMessageClass", None)
    if get_class is None:  # protobuf < 4.21
        factory = message_factory.MessageFactory(pool)
        get_class = factory.GetPrototype
    return {name: get_class(descriptor) for name, descriptor in descriptors.items()}


def xspace_class():
    """An `XSpace` message class built from TSL's schema, or None without `protobuf`.

    Parses a `*.xplane.pb` like TensorFlow's
    `tensorflow.tsl.profiler.protobuf.xplane_pb2.XSpace` (same field numbers,
    so the same bytes give the same values), in a JAX-only environment.
    """
    try:
        return _message_classes()["XSpace"]
    except Exception:  # no protobuf, or one too old to build classes at run time
        return None
