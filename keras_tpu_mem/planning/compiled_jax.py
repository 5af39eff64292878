"""The JAX compile reader: `compiled_memory` / `plan` on `KERAS_BACKEND=jax`.

The step is the engine's own (`JaxStep.make_step(jit=False)`, the function
`fit` jits) for the given features, or Keras' `model.train_step` without any,
jitted as `fit` jits it (`donate_argnums=0`; under a `keras.distribution` the
state's shardings as `out_shardings`), lowered on `jax.ShapeDtypeStruct`s that
carry the distribution's shardings, compiled, and read through
`compiled.memory_analysis()`. Under SPMD the compiled module is one device's
program, so every byte count is what **one device** holds. Nothing runs: the
structs hold no data, and the model's variables are only read for their
shapes, dtypes and layouts (so this works during a `fit`, whose JAX trainer
purges the variables' values, as the OOM explanation needs).
"""

from __future__ import annotations

import math

from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem._utils import logger
from keras_tpu_mem.planning.specs import _check_model, _dtype_size, infer_data_specs


def _distribution():
    import keras

    return keras.distribution.distribution()


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


def _struct(shape, dtype, sharding):
    import jax

    if sharding is None:
        return jax.ShapeDtypeStruct(tuple(shape), dtype)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _device_bytes(struct) -> int:
    """Bytes of one device's shard of a struct (the whole array without a sharding)."""
    shape = tuple(struct.shape)
    sharding = getattr(struct, "sharding", None)
    if sharding is not None:
        shape = tuple(sharding.shard_shape(shape))
    return int(math.prod(shape)) * _dtype_size(struct.dtype)


def _state_structs(model, distribution):
    """`(trainable, non_trainable, optimizer, metrics)` structs, as `fit` passes the state."""
    import keras

    def structs(variables):
        return [_struct(v.shape, keras.backend.standardize_dtype(v.dtype),
                        _variable_sharding(distribution, v)) for v in variables]

    return (structs(model.trainable_variables), structs(model.non_trainable_variables),
            structs(model.optimizer.variables), structs(model.metrics_variables))


def _batch_structs(distribution, xs, ys):
    import keras

    return keras.tree.map_structure(
        lambda s: _struct(s.shape, s.dtype, _data_sharding(distribution, s.shape)), (xs, ys))


def data_parallel_size() -> int:
    from keras_tpu_mem.backends.jax.trainer import data_parallel_size as size

    return size()


def _platform_and_devices(distribution):
    import jax
    import numpy as np

    if distribution is None:
        return str(jax.devices()[0].platform).upper(), 1
    flat = list(np.asarray(distribution.device_mesh.devices).flat)
    return str(flat[0].platform).upper(), len(flat)


def compile_jax_step(model, xs, ys, features=()):
    """Lowers and compiles the step for the batch specs; returns the `jax.stages.Compiled`."""
    import jax

    from keras_tpu_mem.engine.compile import compile_context

    distribution = _distribution()
    state = _state_structs(model, distribution)
    batch = _batch_structs(distribution, xs, ys)
    out_shardings = None
    if distribution is not None:
        # As `JaxStep.make_step` / Keras' `make_train_function`: the state comes
        # back with the shardings it went in with (read from the layouts here,
        # not from the variables' values, which a running fit has purged).
        out_shardings = (None, jax.tree_util.tree_map(lambda s: s.sharding, state))
    with compile_context(model, features) as backend_step:
        step = (backend_step.make_step(jit=False) if features
                else model.train_step)
        jitted = jax.jit(step, donate_argnums=0, out_shardings=out_shardings)
        try:
            lowered = jitted.lower(state, batch)
            return lowered.compile()
        except Exception as err:
            what = (f"the engine's step for {', '.join(type(f).__name__ for f in features)}"
                    if features else "the model's train step")
            first = str(err).splitlines()[0] if str(err) else ""
            raise RuntimeError(
                f"XLA could not compile {what} on JAX ({type(err).__name__}: {first}).") from err


class JaxCompiler:
    """`compiled.Compiler`'s interface on JAX: compiles the step at per-replica batches.

    A per-replica batch is one data-parallel shard's (see `engine/jax.py`): the
    step is compiled for `per_replica * data-parallel size` examples under the
    active distribution; the results carry `batch_size=per_replica`.
    """

    copied = False

    def __init__(self, model, x_spec=None, y_spec=None, what="compiled_memory"):
        _check_model(model, what)
        self.user_model = model
        self.model = model
        self.what = what
        self.x_spec, self.y_spec = x_spec, y_spec
        self._built = False

    def specs(self, batch_size: int):
        return infer_data_specs(self.user_model, batch_size, self.x_spec, self.y_spec)

    def __call__(self, per_replica: int, features=(), hlo_text: bool = False):
        return self.compile_global(per_replica * data_parallel_size(), features, hlo_text,
                                   per_replica=per_replica)

    def compile_global(self, global_batch: int, features=(), hlo_text: bool = False,
                       per_replica: int | None = None):
        import dataclasses

        from keras_tpu_mem.planning.compiled import (
            _CACHE,
            CompiledMemory,
            _build_for,
            _micro_batches,
            _sorted,
            _state_key,
        )

        features = tuple(features)
        _refuse_pulled(features, self.what)
        model = self.model
        distribution = _distribution()
        shards = data_parallel_size()
        if global_batch % shards:
            raise ValueError(
                f"{self.what}: the batch {global_batch} does not split over the {shards} "
                "data-parallel devices of the active keras.distribution; use a multiple "
                f"of {shards}.")
        xs, ys = self.specs(global_batch)
        if not self._built:
            _build_for(model, xs, ys)
            self._built = True
        try:
            cache = _CACHE.setdefault(self.user_model, {})
        except TypeError:
            cache = {}
        key = (_state_key(model, xs, ys, features), id(distribution))
        cached = cache.get(key)
        if cached is None or (hlo_text and not cached.hlo_text):
            micro = _micro_batches(model, features, global_batch // shards)
            compiled = compile_jax_step(model, xs, ys, features)
            stats = jax_compat.memory_analysis(compiled)
            text = compiled.as_text() if hlo_text else ""
            state = _state_structs(model, distribution)
            batch = _batch_structs(distribution, xs, ys)
            import jax

            trainable, _, optimizer, _ = state
            weights = [_struct(v.shape, v.dtype, _variable_sharding(distribution, v))
                       for v in model.weights]
            trainable_bytes = sum(_device_bytes(s) for s in trainable)
            platform, devices = _platform_and_devices(distribution)
            cached = CompiledMemory(
                batch_size=global_batch,
                argument_bytes=int(stats.argument_size_in_bytes),
                data_bytes=sum(_device_bytes(s) for s in jax.tree_util.tree_leaves(batch)),
                temp_bytes=int(stats.temp_size_in_bytes),
                live_out_bytes=int(stats.output_size_in_bytes),
                alias_bytes=int(stats.alias_size_in_bytes),
                # memory_analysis() has no constants entry: they are part of
                # the generated code, reported apart and not counted here.
                constant_bytes=0,
                weight_bytes=sum(_device_bytes(s) for s in weights),
                optimizer_bytes=sum(_device_bytes(s) for s in optimizer),
                module_name=_module_name(compiled),
                platform=platform,
                features=tuple(type(f).__name__ for f in _sorted(features)),
                micro_batches=micro,
                accumulator_bytes=trainable_bytes if micro > 1 else 0,
                hlo_text=text,
                backend="jax",
                devices=devices,
            )
            cache[key] = cached
            logger.debug("%s: compiled the JAX step at batch %d: %s", self.what,
                         global_batch, cached)
        if per_replica is not None and per_replica != global_batch:
            return dataclasses.replace(cached, batch_size=per_replica)
        return cached


def _module_name(compiled) -> str:
    try:
        return compiled.runtime_executable().hlo_modules()[0].name
    except Exception:  # only a label in the table
        return ""


def _refuse_pulled(features, what):
    from keras_tpu_mem.engine.feature import Feature

    for feature in features:
        if (type(feature).batches_per_update is not Feature.batches_per_update
                and (feature.batches_per_update() or 1) > 1):
            raise ValueError(
                f"{what}: {type(feature).__name__} with micro-batches pulled from the "
                "dataset is not an engine step on JAX; plan GradientAccumulation(steps) "
                "(dataset_yields='global_batches') at the batch of one update.")
