"""Compiling a step for its memory on TensorFlow: `tf.function(jit_compile=True)`,
read through `experimental_get_compiler_ir` and XLA's `HloProto` buffer assignment.

The compile is one replica's step for the host: a model built under a
`tf.distribute` strategy is compiled on a default-strategy copy.

Contract: `keras_tpu_mem.backends.contracts.Compiled`; here `unit()` is `"replica"`.
"""

from __future__ import annotations

import contextlib
import re

import keras
import tensorflow as tf

from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem.backends.step import check_pulled_micro_batches


def unit() -> str:
    """`"replica"`: one compile is one replica's step."""
    return "replica"


def table_scope() -> str:
    return "per-replica"


def rematerialize_lever() -> bool:
    """No: only activation functions can be recomputed on TensorFlow (whole layers
    crash in fit, keras-team/keras#21207), which XLA mostly fuses already: not a lever
    worth a compile per candidate."""
    return False


def sharding_lever() -> bool:
    """No: state split over the data-parallel devices is a keras.distribution (JAX)
    lever."""
    return False


def estimates() -> bool:
    """Yes: `plan` without callbacks compiles at small per-replica batches and
    extrapolates (each TensorFlow compile of a large batch takes seconds to minutes)."""
    return True


def spec_name() -> str:
    return "tf.TensorSpec"


def compiles_deferred() -> bool:
    """Whether a model built in `ktm.shapes_only()` compiles here: no (`tf.function`
    traces the variables themselves, which have no value); plan it with
    `plan(..., compiler="tpu")` (its JAX lowering) or after `ktm.materialize(model)`."""
    return False

def make_spec(shape, dtype_name: str):
    """A `tf.TensorSpec` (exposes `.shape` and `.dtype.name`)."""
    return tf.TensorSpec([int(d) for d in shape], tf.as_dtype(dtype_name))


def is_out_of_memory(error) -> bool:
    """Whether `error` is a `tf.errors.ResourceExhaustedError` (matched by class name)."""
    return type(error).__name__ == "ResourceExhaustedError"


def replicas(model) -> int:
    return int(model.distribute_strategy.num_replicas_in_sync)


def capacity_device():
    """None: TensorFlow's runtime says the capacity only in the error's text."""
    return None


def check_context(what: str) -> None:
    if tf.distribute.has_strategy():
        raise RuntimeError(
            f"{what}: call it outside `strategy.scope()`: it compiles one replica's "
            "step for the host, whatever strategy the model trains under."
        )


def compile_shards() -> int:
    """1: the compile is one replica's step."""
    return 1


def distributed_strategy(model):
    """The strategy a model was built under, or None for the default strategy.

    Keras' TensorFlow trainer records the strategy only when the model is
    created inside a `strategy.scope()`.
    """
    return keras_compat.model_strategy(model)


def host_copy(model):
    """A default-strategy copy of a model built under a tf.distribute strategy.

    XLA cannot compile a step whose variables live on several devices (a
    MirroredStrategy's per-replica copies, TPU variables) for the host, so the
    step is compiled on a clone: same layers and compile config, fresh
    variables, the user's model untouched.
    """
    if tf.distribute.has_strategy():
        raise RuntimeError(
            "compiled_memory/plan: call it outside `strategy.scope()`; it compiles one "
            "replica's step for the host on a copy of the model."
        )
    try:
        with tf.device("/CPU:0"):
            clone = keras.models.clone_model(model)
            clone.compile_from_config(model.get_compile_config())
    except Exception as err:
        raise RuntimeError(
            f"The model was built under {type(model.distribute_strategy).__name__}, whose "
            "variables XLA cannot compile for the host, and copying it failed "
            f"({type(err).__name__}: {err}). Build and compile the same model outside "
            "the strategy scope (plain weights are enough) and plan that one."
        ) from err
    if clone.optimizer is None:
        raise RuntimeError(
            "Could not recompile a host copy of the model (its `compile` is custom). "
            "Build and compile the same model outside the strategy scope and plan that."
        )
    return clone


def device_shape(shape, variable=None) -> tuple:
    """The whole shape: one replica holds all of every variable and its batch."""
    return tuple(shape)


def cache_scope():
    return None


def _hlo_proto_class():
    try:  # TensorFlow 2.16 - 2.21 ship the XLA protos under tensorflow.compiler.
        from tensorflow.compiler.xla.service import hlo_pb2
    except ImportError:  # pragma: no cover - other layouts
        try:
            from xla.service import hlo_pb2  # type: ignore[no-redef]
        except ImportError as err:
            raise RuntimeError(
                "compiled_memory needs XLA's HloProto definitions "
                "(tensorflow.compiler.xla.service.hlo_pb2), which this TensorFlow "
                "does not ship."
            ) from err
    return hlo_pb2.HloProto


def _buffer_stats(serialized: bytes) -> dict:
    proto = _hlo_proto_class()()
    proto.ParseFromString(serialized)
    stats = dict(argument=0, temp=0, live_out=0, alias=0, constant=0)
    # Parameters updated in place. Newer XLA marks the allocation
    # (`is_parameter_aliased_with_output`); every version lists the module's
    # input/output aliases, which is what TensorFlow 2.19's proto offers.
    aliased = {
        (int(e.parameter_number), tuple(e.parameter_shape_index))
        for e in proto.hlo_module.input_output_alias.entries
    }
    for alloc in proto.buffer_assignment.buffer_allocations:
        size = int(alloc.size)
        if alloc.is_entry_computation_parameter:
            stats["argument"] += size
            number = int(alloc.parameter_number)
            flag = getattr(alloc, "is_parameter_aliased_with_output", False)
            if flag or (number, tuple(alloc.parameter_shape_index)) in aliased:
                stats["alias"] += size
        if alloc.maybe_live_out:
            stats["live_out"] += size
        if alloc.is_constant:
            stats["constant"] += size
        if not (alloc.is_entry_computation_parameter or alloc.maybe_live_out
                or alloc.is_thread_local or alloc.is_constant):
            stats["temp"] += size
    stats["module_name"] = proto.hlo_module.name
    return stats


def _platform(model) -> str:
    try:
        device = model.trainable_variables[0].value.device or ""
    except (IndexError, AttributeError):
        device = ""
    match = re.search(r"device:([A-Z]+):", device)
    return match.group(1) if match else "CPU"


def compile_scope():
    """A callable giving a context for a later compile of the same step (none needed:
    one replica's step compiles on the host)."""
    return contextlib.nullcontext


def prepare_step(model, xs, ys, features, compile_context, keras_step: bool | None = None):
    """Nothing to do ahead of `compile_step`: TensorFlow traces and compiles the step
    in one call (`experimental_get_compiler_ir`), holding Python throughout."""
    return None


def _replica_step(model, step):
    """The engine's replica step for the features installed on `step`: its step, or with
    micro-batches pulled from the dataset the step that applies the update (the k-th
    micro-batch's gradient added to the accumulators, then the optimizer), its
    accumulators made here, as `fit` makes them, and captured by the compile (entry
    parameters, as the weights are). Returns `(step, accumulators)`: one per trainable
    weight, in their order (none without pulled micro-batches)."""
    k = step.engine.batches_per_update()
    if k <= 1:
        return step._replica_step, []
    check_pulled_micro_batches(model, k)
    accumulators = step._make_accumulators(tf.distribute.get_strategy())
    return lambda data: step._pulled_micro_step(data, True, accumulators, k), accumulators


def compile_step(model, xs, ys, features, compile_context, hlo_text: bool,
                 description: str, dump: bool = False, keras_step: bool | None = None,
                 prepared=None, meanwhile=None) -> dict:
    """Compiles one train step with XLA and reads its buffer assignment.

    `prepared` is `prepare_step`'s None; `meanwhile` is not called (nothing here
    compiles without holding Python, so there is nothing to overlap it with).

    Without features this is Keras' own `train_step`. With features it is the
    engine's per-replica step (`backends.tensorflow.trainer.Step._replica_step`) with those
    features installed, exactly what `fit` would run on each replica, traced
    with `jit_compile=True` as a TPU compiles it. XLA:CPU never refuses a step as too
    large here (no `CompileRefused`).

    Raises:
        ValueError: `keras_step=False`: the engine's step without features is the one
            for state split over the batch axis, which only JAX lays out (None and True
            are Keras' own step, what `fit` runs here without features).
    """
    if keras_step is False and not features:
        raise ValueError(
            f"{description}: the engine's step without features (keras_step=False) "
            "compiles state split over the batch axis, which needs the JAX backend "
            "(keras.distribution); on TensorFlow fit runs Keras' own step.")
    # experimental_get_compiler_ir takes flat TensorSpecs only: pass the
    # leaves and rebuild (x, y) inside.
    structure = (xs, ys)
    flat = keras.tree.flatten(structure)
    accumulators = []
    with contextlib.ExitStack() as stack:
        if features:
            step = stack.enter_context(compile_context(model, features))
            replica_step, accumulators = _replica_step(model, step)
            train_step = tf.autograph.experimental.do_not_convert(replica_step)
        else:
            train_step = model.train_step

        @tf.function(jit_compile=True, reduce_retracing=False)
        def one_train_step(*leaves):
            x, y = keras.tree.pack_sequence_as(structure, list(leaves))
            return train_step((x, y))

        try:
            generator = one_train_step.experimental_get_compiler_ir(*flat)
            proto = generator(stage="optimized_hlo_proto_serialized")
            # A second XLA compile of the same graph: only when asked.
            text = generator(stage="optimized_hlo") if hlo_text else ""
            if dump:
                # For `compiled_layers`: the proto itself and what each entry parameter
                # is (the batch's leaves, then the function's captures in order), and
                # the pulled step's accumulators (one per trainable weight).
                captures = one_train_step.get_concrete_function(*flat).captured_inputs
                dumped = dict(proto=proto, leaves=len(flat), captures=list(captures),
                              accumulators=list(accumulators))
        except Exception as err:
            raise RuntimeError(
                f"XLA could not compile {description} for the host "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
                "A TPU compiles every step with XLA too, so the same op would fail there; "
                "see the full error above."
            ) from err
    return dict(_buffer_stats(proto), platform=_platform(model), devices=1, hlo_text=text,
                dump=dumped if dump else None)
