"""JAX and Keras' JAX trainer internals. Versions: checked on jax 0.10.2 with Keras
3.15.1, and against the source of Keras 3.12.0 (the lower bound in setup.cfg);
`tests/test_compat_jax.py` calls each one by name.

The JAX backend's modules (and the JAX tests and benchmarks) import this module; it
imports JAX lazily so that importing it costs nothing on TensorFlow.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re


# ---------------------------------------------------------------- shard_map
def shard_map(fn, *, mesh, in_specs, out_specs, manual_axes):
    """`fn` mapped over the `manual_axes` of `mesh`; its other axes stay automatic.

    jax >= 0.7 (the floor of the `[jax]` extra; checked: 0.10.2):
    `jax.shard_map(..., axis_names=manual_axes, check_vma=False)`. The older
    `jax.experimental.shard_map` spelling (`check_rep=`, `auto=`) is not used:
    its `auto=` was removed in jax 0.8. `check_vma` is off because the engine
    makes every replicated output replicated itself (a `psum`/`pmean`/`pmax`
    after the loop) and the loop carries values that start replicated and become
    per-device.
    """
    import jax

    public = getattr(jax, "shard_map", None)
    if public is None:
        raise RuntimeError(
            f"keras_tpu_mem needs jax >= 0.7 (jax.shard_map); this is jax {jax.__version__}. "
            'pip install -U "keras-tpu-mem[jax]".')
    return public(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                  axis_names=frozenset(manual_axes), check_vma=False)


def memory_analysis(compiled):
    """`compiled.memory_analysis()` of a `jax.stages.Compiled`, never None.

    jax 0.4.36-0.10.2 return an object with `argument_size_in_bytes`,
    `output_size_in_bytes`, `alias_size_in_bytes`, `temp_size_in_bytes`,
    `generated_code_size_in_bytes`; jax's docs allow None (a backend or runtime
    without the analysis, which newer jax may return): then a clear error
    instead of an AttributeError inside the planner."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            "XLA gave no memory analysis for the compiled step on this JAX backend "
            "(jax.stages.Compiled.memory_analysis() returned None), so keras_tpu_mem "
            "cannot say how much memory it needs here. Plan on a backend that reports it "
            "(TPU, GPU, CPU).")
    return stats


#: XLA options for a host (XLA:CPU) compile whose executable is only read for its
#: memory: LLVM's optimisation of the generated code, and the MLIR emitters of fused
#: kernels (the older emitters generate the same kernels), come after buffer
#: assignment, so they change no figure of `memory_analysis()` (tests/test_compat_jax.py
#: compares them with a default compile; the plan search's candidates were checked the
#: same way) and they are most of XLA:CPU's compile time (four steps of the encoder of
#: benchmarks/bench_sharding.py, sharded over 8 devices: 2.9 s instead of 8.9 s).
_MEMORY_ONLY_HOST_OPTIONS = {"xla_backend_optimization_level": 0,
                             "xla_llvm_disable_expensive_passes": True,
                             "xla_cpu_use_fusion_emitters": False}


def compile_for_memory(lowered, platform: str, options=None):
    """`lowered.compile()` for a program that never runs, only read for its memory.

    On the host platform ("cpu") LLVM's code optimisation is switched off
    (`_MEMORY_ONLY_HOST_OPTIONS`); other platforms compile as they would to run (on TPU
    the options could change what XLA:TPU lays out). `options` (a dict of XLA debug
    options, e.g. `compile_with_dump`'s) are added.
    """
    merged = dict(_MEMORY_ONLY_HOST_OPTIONS) if str(platform).lower() == "cpu" else {}
    merged.update(options or {})
    return lowered.compile(merged or None)


def compile_with_dump(lowered, directory: str, platform: str = "", options=None):
    """`lowered.compile()` that also writes XLA's view of the optimized module to `directory`.

    jax 0.10.2 passes a dict of XLA debug options to `Lowered.compile(compiler_options)`;
    `xla_dump_to` makes XLA write, per module, the optimized HLO with its metadata
    (`*after_optimizations.txt`), the buffer assignment
    (`*after_optimizations-buffer-assignment.txt`) and the live ranges of its buffers
    with the peak (`*after_optimizations-live-range.txt`); XLA:TPU also writes its
    memory-usage report (`laid_out_hbm_bytes`). `xla_dump_hlo_pass_re` matching no pass
    keeps the per-pass dumps out; the backend's code files (LLVM IR, objects on CPU)
    are still written, so `directory` is a scratch folder. `options`: more compile
    options (XLA:TPU's reserve, `tpu_topology.compile_options`).
    """
    return compile_for_memory(lowered, platform,
                              {**(options or {}), "xla_dump_to": directory,
                               "xla_dump_hlo_pass_re": "^$", "xla_dump_hlo_as_text": True})


def memory_report_options(directory: str) -> dict:
    """Compile options with which XLA:TPU writes its memory-usage report of the
    optimized module to `directory` (`*after_optimizations-memory-usage-report.txt`,
    read by `laid_out_hbm_bytes`).

    libtpu 0.0.42.1 writes the module's HLO texts with it whatever the format options
    say; `xla_dump_buffer_assignment_analysis` off leaves out the per-value files (272
    MB of the 406 MB a 7B decoder's step dumps) and `xla_dump_disable_metadata` about
    a fifth of the rest. `directory` is a scratch folder."""
    return {"xla_dump_to": directory, "xla_dump_hlo_pass_re": "^$",
            "xla_dump_buffer_assignment_analysis": False, "xla_dump_disable_metadata": True}


_REPORT_SUFFIX = "after_optimizations-memory-usage-report.txt"
_DEFAULT_SPACE_TOTAL = re.compile(
    r"^Memory Space: default \(color=0\)\s*\nTotal bytes: (\d+)", re.MULTILINE)


def dumped_text(directory: str, suffix: str, purpose: str) -> str:
    """The text of the file XLA's dump wrote to `directory` whose name ends with
    `suffix` (the last by name where several do); a RuntimeError saying it cannot
    `purpose` where XLA wrote none."""
    names = os.listdir(directory)
    found = sorted(n for n in names if n.endswith(suffix))
    if not found:
        raise RuntimeError(f"XLA wrote no *{suffix} for the step (dumped: {len(names)} "
                           f"files); cannot {purpose}.")
    with open(os.path.join(directory, found[-1])) as f:
        return f.read()


def laid_out_hbm_bytes(directory: str) -> int:
    """HBM per device XLA:TPU's buffer assignment lays out for the module dumped in
    `directory` (`memory_report_options`, or `compile_with_dump`'s dump): the "Total
    bytes" of the report's default memory space (color 0), which holds the parameters,
    the results and the temporaries' arena; the on-chip memories (VMEM, SMEM) are
    other colors. Raises RuntimeError where the report or that line is missing."""
    purpose = "read the HBM its buffer assignment lays out"
    match = _DEFAULT_SPACE_TOTAL.search(dumped_text(directory, _REPORT_SUFFIX, purpose))
    if match is None:
        raise RuntimeError(f"XLA's *{_REPORT_SUFFIX} has no 'Memory Space: default "
                           f"(color=0)' total; cannot {purpose}.")
    return int(match.group(1))


# --------------------------------------------------------- Keras distribution
def backend_mesh(device_mesh):
    """The `jax.sharding.Mesh` of a `keras.distribution.DeviceMesh` (3.12-3.15:
    the `DeviceMesh.backend_mesh` property, cached on the mesh, so its shardings
    and ours name the same mesh)."""
    return device_mesh.backend_mesh


def state_sharding_spec(model):
    """Shardings of `(trainable, non_trainable, optimizer, metrics)` state, read
    from the variables' current values, as Keras' own `make_train_function`
    passes them to `jax.jit(out_shardings=...)` (3.12-3.15:
    `JAXTrainer._get_state_sharding_spec`). Call it before `fit` purges the
    variables' values (i.e. from `make_train_function`)."""
    return model._get_state_sharding_spec()


@contextlib.contextmanager
def tensor_layouts_for_manual_axes(distribution, manual_axes):
    """While a `shard_map` body is traced: layer-output layouts without the manual axes.

    Keras constrains a layer's output to `distribution.get_tensor_layout(path)`
    (a `LayoutMap` entry such as `"dense/output"`) with a `NamedSharding` over
    the whole mesh, which JAX refuses inside a `shard_map` whose batch axis is
    manual ("Context mesh ... should match the mesh of sharding"). Inside the
    body the same constraint is a `PartitionSpec` over the remaining automatic
    axes, resolved against the body's mesh. (3.12-3.15: `Layer.__call__` calls
    `distribution.get_tensor_layout(path + "/output")` and
    `keras.src.backend.jax.distribution_lib.distribute_tensor`, which passes a
    non-`TensorLayout` layout to `jax.lax.with_sharding_constraint` as is.)
    """
    from jax.sharding import PartitionSpec

    manual = frozenset(manual_axes)
    own = distribution.__dict__.get("get_tensor_layout")
    original = distribution.get_tensor_layout

    def keep(axis):
        if isinstance(axis, (tuple, list)):
            kept = tuple(a for a in axis if a not in manual)
            return kept or None
        return None if axis in manual else axis

    def get_tensor_layout(path):
        layout = original(path)
        if layout is None:
            return None
        axes = getattr(layout, "axes", None)
        if axes is None:  # already a backend sharding: its spec
            axes = tuple(getattr(layout, "spec", ()))
        return PartitionSpec(*(keep(axis) for axis in axes))

    distribution.get_tensor_layout = get_tensor_layout
    try:
        yield
    finally:
        if own is None:
            del distribution.get_tensor_layout
        else:
            distribution.get_tensor_layout = own


# ---------------------------------------------------------------- the step
@contextlib.contextmanager
def losses_override(model, losses):
    """Makes `model.losses` return `losses` (the forward pass's `add_loss` and
    activity-regularizer terms from `stateless_call(return_losses=True)`) while
    the compiled loss is computed, exactly as Keras' `compute_loss_and_updates`
    does (3.12-3.15: `Layer._losses_override`)."""
    if not losses:
        yield
        return
    model._losses_override.clear()
    model._losses_override = losses
    try:
        yield
    finally:
        model._losses_override.clear()


def seed_generators(layer) -> list:
    """The `keras.random.SeedGenerator`s a layer owns (3.12-3.15:
    `Layer._seed_generators`); their `state` variables are part of the
    model's non-trainable variables."""
    return list(getattr(layer, "_seed_generators", None) or ())


def is_nnx_enabled() -> bool:
    """Whether Keras runs Flax NNX mode, where Keras' trainer uses `nnx.jit`
    (public: `keras.config.is_nnx_enabled`, 3.12-3.15)."""
    import keras

    return bool(keras.config.is_nnx_enabled())


def state_synced(model) -> bool:
    """Whether Keras' JAX `fit` considers the model's variables up to date with its
    training state (3.12-3.15: `JAXTrainer._jax_state_synced`; `jax_state_sync()`
    sets it, and `fit` then reloads the state from the variables)."""
    return bool(getattr(model, "_jax_state_synced", True))


def set_state_synced(model, value: bool) -> None:
    model._jax_state_synced = value


def fit_state_index(model) -> dict:
    """Where Keras' JAX `fit` holds each variable's value while its training state is
    out of the variables: `id(variable)` -> `(list, position)` in
    `JAXTrainer._jax_state` (3.12-3.16: four lists, in the order of
    `trainable_variables`, `non_trainable_variables`, `optimizer.variables`,
    `metrics_variables`). Valid while the model keeps these variables (one fit):
    walking the model for it takes longer than reading the values."""
    optimizer = getattr(model, "optimizer", None)
    index = {}
    for key, owners in (("trainable_variables", model.trainable_variables),
                        ("non_trainable_variables", model.non_trainable_variables),
                        ("optimizer_variables",
                         optimizer.variables if optimizer is not None else []),
                        ("metrics_variables", model.metrics_variables)):
        for position, variable in enumerate(owners):
            index.setdefault(id(variable), (key, position))
    return index


def fit_state_values(model, variables, index: dict) -> list:
    """The values of `variables` where Keras' JAX `fit` holds them now, without
    syncing them into the variables (`index`: `fit_state_index` of this fit); an
    object that is no Keras variable gives its own `.value`.

    Mid-epoch Keras keeps the training state out of the variables
    (`JAXTrainer._jax_state`) and empties them (an emptied variable reads its
    initializer's value). A callback's `model` property syncs the state back
    (`jax_state_sync`), which assigns every variable and makes Keras gather and
    empty them again before the next step, on the training thread while the
    device waits. A Keras variable the index does not place (none is known) syncs
    the state after all.
    """
    import keras

    state = getattr(model, "_jax_state", None)
    if state and not state_synced(model):
        places = [index.get(id(v)) if isinstance(v, keras.Variable) else ()
                  for v in variables]
        if None not in places:
            return [state[place[0]][place[1]] if place else v.value
                    for v, place in zip(variables, places)]
        model.jax_state_sync()
    return [v.value for v in variables]


def jax_state(model):
    """`(trainable, non_trainable, optimizer, metrics)` values of a compiled model,
    the state Keras' JAX `fit` passes to the train function (3.12-3.15:
    `JAXTrainer._get_jax_state`, without purging the variables). For lowering
    and compiling a step outside `fit` (benchmarks, memory analysis)."""
    return model._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                optimizer_variables=True, metrics_variables=True,
                                purge_model_variables=False)


def distribute_data(data):
    """A batch placed as Keras' JAX `fit` places it under the active distribution
    (3.12-3.15: `keras.src.backend.jax.trainer._distribute_data`): global arrays
    sharded on the batch axis, or committed to the default device without one."""
    from keras.src.backend.jax.trainer import _distribute_data

    return _distribute_data(data)


@functools.cache
def _partial_batch_list():
    """Keras 3.16's `PartialBatchList` class, or None before it. Looked up once:
    a failed import costs tens of microseconds, at every call of the train
    function."""
    try:
        from keras.src.trainers.data_adapters.data_adapter_utils import PartialBatchList
    except ImportError:
        return None
    return PartialBatchList


def super_batch_steps(model, data) -> list | None:
    """The steps' batches in one train-function call's `data`, or None where `data`
    is one step's batch.

    Keras <= 3.15 (JAX): the epoch iterator yields one batch per `next()`, and a
    train function with `steps_per_execution = N` pulls N of them. Keras 3.16
    (checked: keras-nightly 3.16.0.dev2026102704) yields one *super batch* per
    call when N > 1: the N batches stacked on a new leading axis (laid out with
    the batch on the distribution's batch axis), or at an epoch's end a
    `keras.src.trainers.data_adapters.data_adapter_utils.PartialBatchList` of
    the remaining batches.
    """
    PartialBatchList = _partial_batch_list()
    if PartialBatchList is None:  # Keras <= 3.15: no super batches
        return None
    if isinstance(data, PartialBatchList):
        return list(data)
    if int(model.steps_per_execution) <= 1:
        return None
    import keras

    steps = keras.tree.flatten(data)[0].shape[0]
    return [keras.tree.map_structure(lambda x, i=i: x[i], data) for i in range(steps)]


# ---------------------------------------------------------------- devices
def backends_initialized() -> bool:
    """Whether JAX has started its device backends, after which XLA_FLAGS such as
    the host device count no longer apply (jax >= 0.4.36:
    `jax._src.xla_bridge.backends_are_initialized()`; older: the private
    `_backends` dict, empty until the first device query)."""
    import sys

    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    initialized = getattr(xla_bridge, "backends_are_initialized", None)
    if initialized is not None:
        return bool(initialized())
    return bool(getattr(xla_bridge, "_backends", {}))
