"""Compiling a step for its memory on JAX: `jax.jit(...).lower(...).compile()`, read
through `memory_analysis()`.

The step is the engine's own (`backends.jax.trainer.Step.make_step(jit=False)`, the function
`fit` jits) for the given features, or under state split over the batch axis, or Keras'
`model.train_step` otherwise,
jitted as `fit` jits it (`donate_argnums=0`; under a `keras.distribution` the
state's shardings as `out_shardings`), lowered on `jax.ShapeDtypeStruct`s that
carry the distribution's shardings, compiled, and read through
`compiled.memory_analysis()`. Under SPMD the compiled module is one device's
program, so every byte count is what **one device** holds. Nothing runs: the
structs hold no data, and the model's variables are only read for their
shapes, dtypes and layouts (so this works during a `fit`, whose JAX trainer
purges the variables' values, as the OOM explanation needs).

Contract: `keras_tpu_mem.backends.contracts.Compiled`; here `unit()` is `"device"`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import tempfile

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.backends.contracts import CompileRefused
from keras_tpu_mem.backends.jax import pulled, reducers, tpu_topology
from keras_tpu_mem.backends.jax.layout import (
    make_state_layout,
    partitioner_shards_state,
)
from keras_tpu_mem.backends.step import check_pulled_micro_batches


def unit() -> str:
    """`"device"`: under SPMD one compile is one device's program."""
    return "device"


def table_scope() -> str:
    return "per device"


def rematerialize_lever() -> bool:
    """Yes: whole layers can be recomputed on JAX (`Rematerialize(mode="layers")`)."""
    return True


def sharding_lever() -> bool:
    """Yes: `plan(..., search=True)` also tries the state split over the data-parallel
    devices of the active distribution (ShardedDataParallel)."""
    return True


def estimates() -> bool:
    """No: `plan` without callbacks compiles the step at the plan's batch (JAX compiles
    are cheap, and small-batch compiles of its step do not extrapolate linearly)."""
    return False


def spec_name() -> str:
    return "jax.ShapeDtypeStruct"


def make_spec(shape, dtype_name: str):
    """A `jax.ShapeDtypeStruct` (exposes `.shape` and `.dtype.name`)."""
    return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jnp.dtype(dtype_name))


def compiles_deferred() -> bool:
    """Whether a model built in `ktm.shapes_only()` compiles here: yes (the step is
    lowered on `jax.ShapeDtypeStruct`s; the variables are only read for their shapes)."""
    return True


def is_out_of_memory(error) -> bool:
    """JAX's runtime error (`JaxRuntimeError`, formerly `XlaRuntimeError`) whose message
    starts with RESOURCE_EXHAUSTED."""
    if type(error).__name__ in ("XlaRuntimeError", "JaxRuntimeError"):
        return str(error).lstrip().startswith("RESOURCE_EXHAUSTED")
    return False


def _distribution():
    return keras.distribution.distribution()


def replicas(model=None) -> int:
    """Devices along the batch axis of the active `keras.distribution` (1 without one)."""
    distribution = _distribution()
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    return int(sizes.get(distribution.batch_dim_name, 1))


def _mesh_devices(distribution) -> list:
    if distribution is None:
        return jax.devices()[:1]
    # The JAX mesh's devices: a Keras mesh built from `list_devices()` (as
    # `DataParallel()` builds it) holds device names ("cpu:0"), not devices.
    mesh = jax_compat.backend_mesh(distribution.device_mesh)
    return list(np.asarray(mesh.devices).flat)


def capacity_device():
    """The first device that holds the batch."""
    return _mesh_devices(_distribution())[0]


def check_context(what: str) -> None:
    """Any context: the compile follows the active `keras.distribution`."""


def compile_shards() -> int:
    """The data-parallel devices of the active distribution: one compile is all of them."""
    return replicas()


def distributed_strategy(model):
    """None: a JAX model's variables compile under any distribution."""
    return None


def host_copy(model):
    """The model itself (never needed: see `distributed_strategy`)."""
    return model


def _variable_sharding(distribution, variable):
    """The sharding a variable has under the distribution (its layout), or None."""
    if distribution is None:
        return None
    layout = distribution.get_variable_layout(variable)
    return getattr(layout, "backend_layout", layout)


def _data_sharding(distribution, shape):
    if distribution is None:
        return None
    layout = distribution.get_data_layout(tuple(shape))
    return getattr(layout, "backend_layout", layout)


def _sharding(distribution, shape, variable):
    if variable is None:
        return _data_sharding(distribution, shape)
    return _variable_sharding(distribution, variable)


def device_shape(shape, variable=None) -> tuple:
    """One device's shard of a variable (its layout) or of the batch (the data layout)."""
    sharding = _sharding(_distribution(), shape, variable)
    if sharding is None:
        return tuple(shape)
    return tuple(sharding.shard_shape(tuple(shape)))


def cache_scope():
    """The distribution: its layouts change the compiled program. One that says what
    its layouts depend on (`cache_key()`) is keyed by that, others by identity."""
    distribution = _distribution()
    key = getattr(distribution, "cache_key", None)
    return key() if callable(key) else id(distribution)


def compile_scope():
    """A callable giving a context in which a later compile sees this one's distribution
    (`CompiledMemory.by_layer()` recompiles after the user's `scope()` has ended)."""
    distribution = _distribution()
    return contextlib.nullcontext if distribution is None else distribution.scope


def _struct(shape, dtype, sharding):
    if sharding is None:
        return jax.ShapeDtypeStruct(tuple(shape), dtype)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _state_structs(model, distribution):
    """`(trainable, non_trainable, optimizer, metrics)` structs, as `fit` passes the state."""
    def structs(variables):
        return [_struct(v.shape, keras.backend.standardize_dtype(v.dtype),
                        _variable_sharding(distribution, v)) for v in variables]

    return (structs(model.trainable_variables), structs(model.non_trainable_variables),
            structs(model.optimizer.variables), structs(model.metrics_variables))


def _batch_structs(distribution, xs, ys):
    return keras.tree.map_structure(
        lambda s: _struct(s.shape, s.dtype, _data_sharding(distribution, s.shape)), (xs, ys))


def _platform_and_devices(distribution=None):
    """`(platform, devices)` the active distribution (or `distribution`) compiles for:
    `("TPU", 16)`."""
    distribution = distribution if distribution is not None else _distribution()
    devices = _mesh_devices(distribution)
    return str(devices[0].platform).upper(), (1 if distribution is None else len(devices))


def _module_name(compiled) -> str:
    try:
        return compiled.runtime_executable().hlo_modules()[0].name
    except Exception:  # only a label in the table
        return ""


class _PreparedStep:
    """A step traced and lowered for one compile (`prepare_step`): what `compile_step`
    would do first, done ahead so that it overlaps another step's XLA compile."""

    def __init__(self, lowered, platform: str, devices: int, error=None):
        self.lowered, self.platform, self.devices = lowered, platform, devices
        self.error = error  # the lowering's exception, raised as the compile's
        # Read here, on the caller's thread: the compile may run on another.
        self.options = tpu_topology.compile_options() if platform == "TPU" else {}


def prepare_step(model, xs, ys, features, compile_context,
                 keras_step: bool | None = None) -> _PreparedStep:
    """Traces and lowers the step `compile_step(model, xs, ys, features, ...)` compiles,
    under the active distribution (and `compile_context`), without compiling it: pass
    it on as `compile_step(..., prepared=)`. Tracing holds Python; XLA's compile does
    not, so the plan search prepares its likely next candidate while XLA compiles the
    current one (`compile_step(..., meanwhile=)`)."""
    distribution = _distribution()
    state = _state_structs(model, distribution)
    batch = _batch_structs(distribution, xs, ys)
    shardings = jax.tree_util.tree_map(lambda s: s.sharding, state)
    # As `Step.make_step` / Keras' `make_train_function`: the state comes back with the
    # shardings it went in with (read from the layouts here, not from the variables'
    # values, which a running fit has purged).
    out_shardings = None if distribution is None else (None, shardings)
    with compile_context(model, features) as backend_step:
        k = backend_step.engine.batches_per_update()
        if k > 1:
            return _prepare_pulled_step(model, backend_step, k, state, batch, shardings,
                                        distribution)
        # Without features, a TPU's SPMD partitioner shards Keras' own step (as `fit`
        # leaves it there: `Step.owns_step`).
        shard_map_only = keras_step is False
        if keras_step is None:
            keras_step = not features and partitioner_shards_state()
        # State split over the batch axis: the engine's sharded step, as `fit` runs
        # it then even without features (`reducers.ShardedShardMap`).
        sharded = (not keras_step and model.optimizer is not None
                   and make_state_layout(model, shardings))
        # `keras_step=False`: the engine's `shard_map` step even where one micro-batch
        # on a TPU mesh would be Keras' step (`reducers.in_shard_map`).
        with reducers.in_shard_map() if shard_map_only else contextlib.nullcontext():
            step = (backend_step.make_step(jit=False, state_shardings=shardings)
                    if features or sharded else model.train_step)
        return _lowered(step, (state, batch), 0, out_shardings, distribution,
                        carries=step is not model.train_step)


def _lowered(step, args, donate_argnums, out_shardings, distribution,
             carries: bool = True) -> _PreparedStep:
    """`step` jitted as `fit` jits it (`donate_argnums`; `out_shardings` under a
    distribution, else None) and lowered on `args`, not compiled. A step that `carries`
    its features' state (pruning masks) returns it after the outputs `out_shardings`
    names: XLA lays that out as it likes, as it does in `fit`."""
    if out_shardings is not None and carries:
        outputs = len(jax.eval_shape(step, *args))
        out_shardings += (None,) * (outputs - len(out_shardings))
    jitted = jax.jit(step, donate_argnums=donate_argnums, out_shardings=out_shardings)
    platform, devices = _platform_and_devices(distribution)
    try:
        return _PreparedStep(jitted.lower(*args), platform, devices)
    except Exception as err:
        return _PreparedStep(None, platform, devices, err)


def _prepare_pulled_step(model, backend_step, k: int, state, batch, shardings,
                         distribution) -> _PreparedStep:
    """`prepare_step` of `GradientAccumulation(k, dataset_yields="micro_batches")`: its
    applying step (the k-th micro-batch's gradient added, then the update), jitted as
    `fit` jits it (`Step.make_pulled_steps`: state and accumulators donated, both
    coming back as they went in), on one micro-batch of the batch specs. It holds
    what the other k - 1 steps hold (the state, the accumulators, one micro-batch,
    its gradient) and the optimizer's update besides."""
    check_pulled_micro_batches(model, k)
    steps, reducer = backend_step.make_pulled_steps(k, jit=False, state_shardings=shardings)
    accumulator_shardings = pulled.accumulator_shardings(model, reducer, shardings[0])
    accumulators = [
        _struct(shape, keras.backend.standardize_dtype(variable.dtype),
                None if accumulator_shardings is None else accumulator_shardings[i])
        for i, (variable, shape) in enumerate(zip(model.trainable_variables,
                                                  pulled.accumulator_shapes(model, reducer)))]
    out_shardings = (None if distribution is None
                     else (None, shardings, accumulator_shardings))
    return _lowered(steps[True], (state, accumulators, batch), (0, 1), out_shardings,
                    distribution)


#: One thread for XLA's compiles while the caller goes on (`compile_step(meanwhile=)`):
#: XLA compiles without holding Python's lock.
_COMPILER_THREAD = None


def _compile_in_background(prepared: _PreparedStep, meanwhile, options):
    """`compile_for_memory` of `prepared` with `options` on the compiler thread while
    `meanwhile()` runs here; `(compiled, None)` or `(None, the compile's exception)`."""
    global _COMPILER_THREAD
    if _COMPILER_THREAD is None:
        _COMPILER_THREAD = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="ktm-xla-compile")
    future = _COMPILER_THREAD.submit(jax_compat.compile_for_memory, prepared.lowered,
                                     prepared.platform, options)
    try:
        meanwhile()
    finally:
        # The compile's outcome, once it ends, whatever `meanwhile` did.
        error = future.exception()
    return (None, error) if error is not None else (future.result(), None)


def compile_step(model, xs, ys, features, compile_context, hlo_text: bool,
                 description: str, dump: bool = False, keras_step: bool | None = None,
                 prepared: _PreparedStep | None = None, meanwhile=None) -> dict:
    """Lowers and compiles the step for the batch specs and reads `memory_analysis()`.

    With `dump`, XLA also writes the optimized module, its buffer assignment and live
    ranges (`_compat.jax.compile_with_dump`), returned as `stats["dump"]` (a dict of
    their texts, keys `hlo`, `buffers`, `live`) for `compiled_layers`. Without
    features and with state split over the batch axis, `keras_step` picks the step: None
    (what `fit` runs: Keras' own on a TPU mesh, the engine's `shard_map` step elsewhere,
    `partitioner_shards_state`), True (Keras' own, left to XLA's SPMD partitioner) or False
    (the engine's). `prepared`: this step as `prepare_step` lowered it (not lowered
    again). `meanwhile`: a function run on this thread while XLA compiles on another
    (not with `dump`). On XLA:TPU, `stats["laid_out"]` is the HBM its buffer assignment
    lays out, from its memory-usage report (`_compat.jax.laid_out_hbm_bytes`); 0 on
    other platforms."""
    if prepared is None:
        prepared = prepare_step(model, xs, ys, features, compile_context, keras_step)
    platform, devices = prepared.platform, prepared.devices
    # A folder for XLA's files: its dump (`dump`), XLA:TPU's memory-usage report.
    folder = (tempfile.TemporaryDirectory(prefix="ktm-xla-dump-")
              if dump or platform == "TPU" else contextlib.nullcontext())
    with folder as directory:
        # XLA:TPU's layout of HBM is in its memory-usage report, not memory_analysis().
        options = ({**prepared.options, **jax_compat.memory_report_options(directory)}
                   if platform == "TPU" else prepared.options)
        compiled, texts, error = None, None, prepared.error
        if error is None and meanwhile is not None and not dump:
            compiled, error = _compile_in_background(prepared, meanwhile, options)
        elif error is None:
            try:
                if dump:
                    compiled = jax_compat.compile_with_dump(prepared.lowered, directory,
                                                            platform, prepared.options)
                    texts = _dumped_texts(directory)
                else:
                    compiled = jax_compat.compile_for_memory(prepared.lowered, platform,
                                                             options)
            except Exception as err:
                error = err
        laid_out = (jax_compat.laid_out_hbm_bytes(directory)
                    if error is None and platform == "TPU" else 0)
    if error is not None:
        first = str(error).splitlines()[0] if str(error) else ""
        if is_out_of_memory(error):
            raise CompileRefused(" ".join(str(error).split()), platform, devices) from error
        raise RuntimeError(f"XLA could not compile {description} on JAX "
                           f"({type(error).__name__}: {first}).") from error
    stats = jax_compat.memory_analysis(compiled)
    return dict(
        argument=int(stats.argument_size_in_bytes),
        temp=int(stats.temp_size_in_bytes),
        live_out=int(stats.output_size_in_bytes),
        alias=int(stats.alias_size_in_bytes),
        # memory_analysis() has no constants entry: they are part of the
        # generated code, reported apart and not counted here.
        constant=0,
        laid_out=laid_out,
        module_name=_module_name(compiled),
        platform=platform,
        devices=devices,
        hlo_text=compiled.as_text() if hlo_text else "",
        dump=texts,
    )


_DUMPED = {"hlo": "after_optimizations.txt",
           "buffers": "after_optimizations-buffer-assignment.txt",
           "live": "after_optimizations-live-range.txt"}


def _dumped_texts(directory) -> dict:
    """The three files of XLA's dump (`_compat.jax.compile_with_dump`) read back."""
    return {key: jax_compat.dumped_text(directory, suffix, "attribute its memory")
            for key, suffix in _DUMPED.items()}
