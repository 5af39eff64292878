"""`keras_tpu_mem._compat.jax_profiler`, by name: the XSpace schema built without TensorFlow.

Runs with TensorFlow (the harness collects it on the TensorFlow backend), whose
own generated `xplane_pb2` is the reference: the schema must match it message
by message, and the same capture must parse to the same content with both.
"""

from __future__ import annotations

import glob
import os

import pytest
import tensorflow as tf
from google.protobuf import descriptor_pb2, json_format

from keras_tpu_mem import profiling
from keras_tpu_mem._compat import jax_profiler

xplane_pb2 = pytest.importorskip("tensorflow.tsl.profiler.protobuf.xplane_pb2")


def _fields(descriptor):
    """Everything that decides how bytes parse: per field, number, label, type, oneof."""
    proto = descriptor_pb2.DescriptorProto()
    descriptor.CopyToProto(proto)
    fields = {f.name: (f.number, f.label, f.type, f.type_name.rsplit(".", 1)[-1],
                       proto.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None)
              for f in proto.field}
    nested = {n.name: (n.options.map_entry,
                       {f.name: (f.number, f.type, f.type_name.rsplit(".", 1)[-1])
                        for f in n.field})
              for n in proto.nested_type}
    return fields, nested


def test_xspace_class_matches_tensorflows_schema_message_by_message():
    ours = jax_profiler.xspace_class()
    assert ours is not None and ours.DESCRIPTOR.full_name == f"{jax_profiler.PACKAGE}.XSpace"
    reference = xplane_pb2.DESCRIPTOR.message_types_by_name
    mine = ours.DESCRIPTOR.file.message_types_by_name
    assert set(mine) == set(reference) == set(jax_profiler.SCHEMA)
    for name in reference:
        assert _fields(mine[name]) == _fields(reference[name]), name


def test_a_capture_parses_to_the_same_content_with_both(tmp_path):
    log_dir = str(tmp_path)

    @tf.function(jit_compile=True)
    def step(x):
        return tf.reduce_sum(tf.matmul(x, x))

    x = tf.ones((64, 64))
    step(x)
    tf.profiler.experimental.start(log_dir)
    for i in range(3):
        with tf.profiler.experimental.Trace("train", step_num=i, _r=1):
            step(x).numpy()
    tf.profiler.experimental.stop()
    (path,) = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
    with open(path, "rb") as f:
        data = f.read()
    theirs, ours = xplane_pb2.XSpace(), jax_profiler.xspace_class()()
    theirs.ParseFromString(data)
    ours.ParseFromString(data)
    assert len(ours.planes) == len(theirs.planes) > 0
    assert json_format.MessageToDict(ours) == json_format.MessageToDict(theirs)
    assert ours.SerializeToString(deterministic=True) == \
        theirs.SerializeToString(deterministic=True)


def test_executed_modules_read_with_either_class(tmp_path, monkeypatch):
    """`profiling.executed_xla_modules` gives the same answer through the fallback class."""
    log_dir = str(tmp_path)

    @tf.function(jit_compile=True)
    def step(x):
        return tf.reduce_sum(tf.matmul(x, x))

    x = tf.ones((32, 32))
    step(x)
    tf.profiler.experimental.start(log_dir)
    step(x).numpy()
    tf.profiler.experimental.stop()
    (path,) = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
    with_tf = profiling.executed_xla_modules(path)
    from keras_tpu_mem._compat import profiler as profiler_compat

    monkeypatch.setattr(profiler_compat, "xspace_class", lambda: None)  # as without TensorFlow
    assert profiling.executed_xla_modules(path) == with_tf
    assert with_tf  # the jitted function ran in the window
