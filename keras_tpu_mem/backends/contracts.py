"""The backends' contracts as code: one `typing.Protocol` per concern.

A backend is a set of concern modules, `keras_tpu_mem/backends/<name>/<concern>.py`,
loaded by `Backend.__getattr__` (`backends.current().devices`). Each module
implements its concern's protocol here with module-level functions (and classes):
a module is a structural implementation of a protocol (PEP 544), so the members
are written as methods whose `self` the module does not have.

`CONCERNS` maps each concern to its protocol, and `ONLY_ON` names the backend of
a concern that only one backend has. `tests/test_backends_contracts.py` parses every
concern module of both backends (without importing either framework) and checks that
its public names are exactly its protocol's members, with the same parameter names
in the same order. A backend's capabilities are functions of its contract
(`compiled.rematerialize_lever()`), never constants that callers read.

The errors the contract names live here too, so that neutral code catches them
without importing a backend: `CompileRefused`, `ShardedStateUnavailable`.

This module imports nothing of TensorFlow, JAX or Keras.
"""

from __future__ import annotations

import re
from typing import Protocol

# ------------------------------------------------------------ the contract's errors
# XLA:TPU's refusal; it prints byte counts with binary units ("15.75G" = 15.75 GiB).
_REFUSAL = re.compile(r"\(([\d.]+[KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(text: str) -> int:
    unit = _UNITS.get(text[-1], 1)
    return int(float(text.rstrip("KMGT")) * unit)


class CompileRefused(RuntimeError):
    """XLA refused to compile the step because it does not fit the device (XLA:TPU's
    RESOURCE_EXHAUSTED at compile time): a verdict, with XLA's own message. Raised by
    `Compiled.compile_step` (JAX; XLA:CPU's compile on TensorFlow never refuses).

    Attributes:
        message: XLA's message, on one line.
        required_bytes, available_bytes: Its figures ("the total memory required
            for HLO temporaries (16.35G) exceeds available HBM (15.75G)"), None where
            the message has none.
        platform, devices: What the refused compile was for (`"TPU"`, 16).
    """

    def __init__(self, message: str, platform: str = "", devices: int = 1):
        super().__init__(message)
        self.message = message
        self.platform = platform
        self.devices = devices
        match = _REFUSAL.search(message)
        self.required_bytes = None if match is None else _bytes(match.group(1))
        self.available_bytes = None if match is None else _bytes(match.group(2))


class ShardedStateUnavailable(RuntimeError):
    """Sharded model state needs the JAX backend: what every caller that needs it
    raises where `Backend.shards_state()` is False, and what each function of
    TensorFlow's `sharding` concern raises. The message names `what` and JAX."""

    def __init__(self, what: str):
        super().__init__(
            f"{what} needs the JAX backend (KERAS_BACKEND=jax before importing keras): it "
            "shards weights and optimizer state with keras.distribution, which lays out "
            "state only on JAX. On TensorFlow use tf.distribute (TPUStrategy, "
            "MirroredStrategy), which keeps a whole copy of the state on every replica.")
        self.what = what


# ------------------------------------------------------------ both backends
class Context(Protocol):
    """The step's verbs: what `backends.step.StepContext` does for a feature, inside the
    step (the update count, writing a variable on every replica, a conditional update,
    a checked condition, a float mask) and around it (a state variable laid out like a
    weight, setting it outside the step, running eagerly), and what the backend's step
    can run. A feature never asks which backend runs."""

    def update_count_dtype(self) -> str:
        """The dtype of `optimizer.iterations`, the step a schedule gets (`"int64"`;
        `"int32"` on JAX without x64)."""
        ...

    def runs_tensorflow_ops(self) -> bool:
        """Whether a function made of TensorFlow ops (tfmot's schedules) runs in the
        step."""
        ...

    def builds_in_step(self) -> bool:
        """Whether Keras builds a model still unbuilt at `fit` inside the step's first
        trace (then a feature makes its state there, through `eagerly`)."""
        ...

    def compiles_with_xla(self, model) -> bool:
        """Whether `model`'s step is an XLA program."""
        ...

    def eagerly(self, fn):
        """`fn()` outside the step being traced (to create state inside a first
        trace)."""
        ...

    def ones_like(self, like, dtype):
        """Outside the step: an all-ones value of `like`'s shape (a variable) and
        `dtype`, laid out like its value (a feature's `init_state`)."""
        ...

    def computed_like(self, like, fn, dtype):
        """Outside the step: `fn(like's value)` as `dtype`, computed where the value
        lives (`fn`: elementwise keras.ops, a module-level function)."""
        ...

    def update_count(self, optimizer):
        """Inside the step: the updates made so far, this one included."""
        ...

    def assign(self, variable, value) -> None:
        """Inside the step: writes the model's `variable` on every replica."""
        ...

    def state_where(self, condition, ctx, new_state):
        """Inside the step: the state of the feature `ctx` runs, `new_state()` where
        `condition` holds (computed only then), else `ctx.state`."""
        ...

    def checked(self, condition, valid, message: str, *data):
        """`condition and valid`; where the backend can assert in the step (TensorFlow
        without XLA), a `valid` that fails where `condition` holds stops the step with
        `message` and `data`."""
        ...

    def masked(self, value, mask):
        """`value` with exact +0.0 where the float `mask` is 0, also over inf/NaN."""
        ...

    def first_step_where(self, predicate, first: int, stride: int, traceable: bool = True):
        """`limit -> bool`: whether `predicate(s)` holds for some `s` in `first, first +
        stride, ...` up to `limit` (`traceable`: `predicate` may be compiled)."""
        ...

    def check_layer_remat(self) -> None:
        """Raises a `ValueError` where recomputing whole layers does not work
        (TensorFlow: keras-team/keras#21207); nothing where it works."""
        ...

    def splits_batches_at_run_time(self) -> bool:
        """Whether a batch's split into micro-batches can fail while the step runs (a
        batch whose size only the run knows): exactly where the backend has the
        `batch_split` concern that explains such an error."""
        ...


class Devices(Protocol):
    """Devices and their memory. A *device* is what this backend's readers take: a
    TensorFlow device name (`"TPU:3"`, `"/job:localhost/replica:0/task:0/device:CPU:0"`)
    or a `jax.Device`."""

    def allocator_reader(self) -> str:
        """What reads an allocator, in words for notices
        (`"tf.config.experimental.get_memory_info"`)."""
        ...

    def peak_resettable(self) -> bool | None:
        """False where no allocator peak can be reset (JAX), None where `reset_peak`
        says per device (TensorFlow)."""
        ...

    def host_allocator_shared(self) -> bool:
        """Whether all host devices share one allocator (TensorFlow's logical CPUs and
        input pipeline), so that the host's figures stand for all of them."""
        ...

    def host_rss_why(self) -> str:
        """Why the monitors read the host's resident memory instead of an allocator
        (a notice's words)."""
        ...

    def host_rss_fix(self) -> str:
        """What gives allocator figures instead (a notice's words)."""
        ...

    def unreadable_why(self) -> str:
        """Why a device's memory cannot be read (a notice's words)."""
        ...

    def replica_devices(self, where=None) -> list:
        """The devices a training step runs on in this process; `where` is a
        `tf.distribute.Strategy` or a `keras.distribution` (None: the current one)."""
        ...

    def model_devices(self, model) -> list:
        """The same for `model`'s steps."""
        ...

    def device_name(self, device) -> str:
        """`"TPU:3"`, `"GPU:0"`, `"CPU:5"`."""
        ...

    def platform(self, device) -> str:
        """`"TPU"`, `"GPU"` or `"CPU"`."""
        ...

    def device_kinds(self, device) -> list[str]:
        """What names the device's hardware (`"TPU v4"`, a GPU's name), most trusted
        first; may be empty."""
        ...

    def reader_queries(self, device) -> tuple:
        """The spellings `memory_stats` may take for `device`, in the order to try
        them."""
        ...

    def host_queries(self, devices) -> tuple:
        """The same for the one entry that stands for all host `devices`."""
        ...

    def memory_stats(self, device) -> dict | None:
        """`{"bytes_in_use", "peak_bytes_in_use"[, "bytes_limit"]}`, or None where the
        allocator keeps no statistics."""
        ...

    def reset_peak(self, device) -> bool:
        """Resets the peak counter; False where it cannot."""
        ...

    def gpu_capabilities(self, devices) -> list[tuple[str, str]]:
        """`(name, "major.minor")` of each GPU whose compute capability the backend
        tells."""
        ...

    def cpu_bfloat16_matmul(self, native: bool) -> str:
        """How a bfloat16 matrix product is computed on a CPU with (`native`) or without
        bfloat16 instructions: `"bfloat16"`, `"emulated"` or `"float32"`."""
        ...


class Compiled(Protocol):
    """Compiling a step for its memory (`keras_tpu_mem.planning` reads it): one
    replica's step for the host on TensorFlow, the step over the active
    `keras.distribution`'s devices on JAX."""

    def unit(self) -> str:
        """What one compile's bytes are of: `"replica"` or `"device"`."""
        ...

    def table_scope(self) -> str:
        """How a `CompiledMemory` table names its batch (`"per-replica"`, `"per
        device"`)."""
        ...

    def rematerialize_lever(self) -> bool:
        """Whether `plan(..., search=True)` tries `Rematerialize()` (whole layers can
        be recomputed, worth a compile per candidate)."""
        ...

    def sharding_lever(self) -> bool:
        """Whether `plan(..., search=True)` tries the state split over the
        data-parallel devices."""
        ...

    def estimates(self) -> bool:
        """Whether `plan` without callbacks extrapolates from compiles at small batches
        (True) or compiles the step at its batch (False)."""
        ...

    def spec_name(self) -> str:
        """The class of `make_spec`'s specs as a user writes it (`"tf.TensorSpec"`):
        error messages name only the running backend's."""
        ...

    def compiles_deferred(self) -> bool:
        """Whether a model built in `ktm.shapes_only()` compiles here."""
        ...

    def make_spec(self, shape, dtype_name: str):
        """A static spec of one tensor (exposes `.shape` and `.dtype.name`)."""
        ...

    def is_out_of_memory(self, error) -> bool:
        """Whether `error` is a step's RESOURCE_EXHAUSTED."""
        ...

    def replicas(self, model) -> int:
        """Replicas the global batch of `model`'s fit splits over."""
        ...

    def capacity_device(self):
        """The device whose capacity an OOM is planned against (None: the runtime does
        not say)."""
        ...

    def check_context(self, what: str) -> None:
        """Raises where a compile here and now is not possible (`what` names the
        caller)."""
        ...

    def compile_shards(self) -> int:
        """Data-parallel shards one compile's batch spans."""
        ...

    def distributed_strategy(self, model):
        """The strategy whose variables a host compile cannot take (None: none)."""
        ...

    def host_copy(self, model):
        """A copy of `model` without that strategy (the model itself where none)."""
        ...

    def device_shape(self, shape, variable=None) -> tuple:
        """One device's shard of a variable (or of the batch, without `variable`)."""
        ...

    def cache_scope(self):
        """What, besides the model's state, a compile depends on (a cache key)."""
        ...

    def compile_scope(self):
        """A callable giving a context in which a later compile of the same step
        (`CompiledMemory.by_layer()`) sees what this one saw."""
        ...

    def prepare_step(self, model, xs, ys, features, compile_context,
                     keras_step: bool | None = None):
        """What `compile_step` of the same arguments does before XLA compiles, done now
        under the active distribution (JAX: the trace and lowering), to pass on as
        `compile_step(..., prepared=)`; None where the backend has nothing to do ahead
        (TensorFlow traces and compiles in one call)."""
        ...

    def compile_step(self, model, xs, ys, features, compile_context, hlo_text: bool,
                     description: str, dump: bool = False,
                     keras_step: bool | None = None, prepared=None,
                     meanwhile=None) -> dict:
        """Compiles the step (`compile_context(model, features)` installs the features)
        and returns plain numbers: `argument`, `temp`, `live_out`, `alias`, `constant`
        bytes, `module_name`, `platform`, `devices`, `hlo_text`, and `dump`, what
        `CompiledLayers.layer_rows` reads (with `dump`; else None). Without features,
        `keras_step` picks the step: None, what `fit` runs; True, Keras' own; False, the
        engine's (for state split over the batch axis: JAX; TensorFlow raises
        `ValueError`). `prepared`: `prepare_step`'s handle of this step. `meanwhile`:
        work to overlap with XLA's compile (JAX compiles on another thread and calls it
        meanwhile); a backend that cannot overlap (TensorFlow) does not call it.

        Raises:
            CompileRefused: XLA refused the step as too large for the device.
            RuntimeError: XLA could not compile it.
        """
        ...


class CompiledLayers(Protocol):
    """Memory by Keras layer, from the compile that `Compiled.compile_step(...,
    dump=True)` made."""

    def require(self) -> None:
        """Raises where the backend cannot attribute a compile's memory to layers."""
        ...

    def layer_rows(self, model, texts: dict, device_shape):
        """`(rows, peak_bytes)`: `rows` a dict `{row: [weights, optimizer,
        saved_activations, at_peak]}` in bytes per device, read from `texts` (the
        compile's `dump`); `device_shape` is `Compiled.device_shape`."""
        ...


class Materialize(Protocol):
    """Giving a shapes-only model its values: `keras_tpu_mem.shapes.materialize` calls
    `initialize` for every variable that has no value, inside `scope(model)`."""

    def scope(self, model):
        """The context `materialize` runs in: the strategy `model` was created under
        (TensorFlow), else none."""
        ...

    def place(self, initializer, shape: tuple, dtype: str, sharding):
        """`initializer(shape, dtype=dtype)` laid out as `sharding`, each device making
        only its own shards (JAX); TensorFlow variables have no layouts
        (`NotImplementedError`)."""
        ...

    def initialize(self, variable, initializer) -> None:
        """Gives `variable` (without a value) the value `initializer` makes, as a normal
        build would (in its layout, on its strategy's devices)."""
        ...


class Profiler(Protocol):
    """Profiling (`keras_tpu_mem.profiling`): captures of XProf's files, the profiler
    server, and what a batch size sweep reads."""

    def start(self, log_dir: str) -> bool:
        """Starts a capture into `log_dir/plugins/profile/<run>/`; False where another
        capture runs."""
        ...

    def stop(self) -> bool:
        """Stops it and writes the `*.xplane.pb`; False where someone else stopped it
        already."""
        ...

    def step(self, name: str, step_num: int):
        """A context manager marking one execution as a step for XProf's overview
        page."""
        ...

    def start_server(self, port: int) -> None:
        """Starts the profiler server (raises where it cannot start)."""
        ...

    def capture_hint(self, port: int, log_dir: str) -> str:
        """How to capture from that server outside TensorBoard."""
        ...

    def counter_after_execution(self, read):
        """The optimizer's step counter after an execution: `read()` where reading it
        costs nothing, else None."""
        ...

    def replica_devices(self, model, devices) -> list:
        """The devices whose memory `batch_size_sweep` watches, read with the `devices`
        module passed in."""
        ...

    def check_sweep_input(self, kind: str, data) -> None:
        """Raises `TypeError` for a sweep input this backend does not train on (`kind`
        as `monitoring.input_rate` names it)."""
        ...

    def is_out_of_memory(self, error: BaseException) -> bool:
        """Whether `error` is the framework's out-of-memory error."""
        ...

    def xspace_class(self):
        """The protobuf class that parses a capture's `*.xplane.pb` (`XSpace`), or None
        where none can be had."""
        ...


class Sharding(Protocol):
    """Sharded model state: moving a variable to a layout and reading where it lies.
    Callers ask `Backend.shards_state()` first; TensorFlow's functions each raise
    `ShardedStateUnavailable`."""

    def resolve_devices(self, devices) -> list:
        """The backend's devices for Keras device names (`"cpu:0"`) or devices, in
        order."""
        ...

    def move(self, variable, layout) -> None:
        """Lays `variable` out as `layout` (a `keras.distribution.TensorLayout`), in
        place, keeping its value."""
        ...

    def sharded_axes(self, variable):
        """Per dimension of `variable`, the mesh axis (or axes) its value is split over,
        or None for a whole dimension; None when the value is on one device."""
        ...

    def device_bytes(self, variable) -> int:
        """Bytes of `variable` one device holds."""
        ...


class Storage(Protocol):
    """Files, local and remote (`gs://`), for the monitors' and the event writer's
    output and `ResumableCheckpoint`'s remote directories."""

    def gfile(self):
        """A module-like object with `GFile(path, mode)`, `exists`, `isdir`, `listdir`,
        `makedirs`, `walk(top)` (as `os.walk`), `stat(path)` (its `.length` in bytes),
        `rename(src, dst, overwrite=)` and `rmtree`."""
        ...

    def remote_path_problem(self, path: str) -> str | None:
        """Why a remote path (`scheme://...`) cannot be written here, or None."""
        ...


class Strategy(Protocol):
    """`TPUStrategyWrapper`'s half: find the accelerator, build what the backend
    distributes with, and what the engine asks of the strategy."""

    Placement: type
    """What `place` returns: `strategy` (what `scope()` enters), `distribution` (JAX's
    `keras.distribution`; `AttributeError` on TensorFlow), `kind` (`"TPU"`, `"GPU"`,
    `"CPU"`), `reason` (why, in words), `multi_host`, `num_replicas`, `scope()`,
    `device_name()` (the device's own name, e.g. `"TPU v3"`), `accelerator_type()` (a
    TPU VM's `TPU_ACCELERATOR_TYPE`, or None), `bytes_limit()` (a runtime's own capacity
    figure, or None), `replica_devices()` (`(short name, what keras_tpu_mem.devices
    reads)` per replica of this process), `batches(dataset, global_batch_size,
    drop_remainder, seed)` (with `seed`, arrays in an `EpochOrder`'s order, the
    result's `epoch_order` attribute), `state_bytes(variables)`,
    `announcement(device_name)` (the log line without its reason) and `repr_fields`
    (what `repr` adds before the kind)."""

    def place(self, tpu: str | None, logical_cpus: int | None, **options):
        """Builds what the backend distributes with and returns a `Placement`;
        `logical_cpus` is already checked (None or a positive int). Options of the other
        backend, or of neither, raise `TypeError`."""
        ...

    def training_strategy(self, model):
        """The `tf.distribute` strategy `model`'s variables are made under and it trains
        under (None on JAX, which has no strategy)."""
        ...

    def variable_owner(self, variable):
        """The `tf.distribute` strategy `variable`'s values are distributed by, or None
        (always on JAX)."""
        ...

    def active_strategy(self):
        """The `tf.distribute` strategy whose scope is active, or None (always on
        JAX)."""
        ...

    def replica_runner(self, fn, strategy):
        """`fn` over a batch, run by `strategy`'s replicas (split, padded, gathered):
        `cache_teacher_logits` on a `tf.data` dataset. JAX raises `ValueError` (pass
        arrays there)."""
        ...


class Trainer(Protocol):
    """The engine's step (`keras_tpu_mem.engine` builds it with
    `backends.current().trainer.Step(engine)`). Only what both trainers offer at module
    level (the JAX step's parts are modules of their own: `PARTS`)."""

    Step: type
    """`Step(engine)`: builds the train function for an `Engine` (`features()`,
    `num_replicas()`, `owns_step()`, `distribution_key()`,
    `global_batch_size_of_call(args)`, `build_train_function()`, `skip_call(args,
    count)`: a resumed fit's call that reads its batches and runs no step,
    `abandon_call(args)`: a refused call's state put back into the variables,
    `state_values(variables)`: their values as numpy arrays outside the step,
    `state_reader()`: a `state_values` for the rest of this fit, with what it
    needs prepared once,
    `state_copier()`: for the rest of this fit, `start(variables)` -> `collect()`:
    the copies to host started (JAX: without waiting for the steps in flight), then
    their numpy arrays,
    `split_over_processes(variables)`: the paths of those no process holds whole
    (`state_values` refuses them; `ShardedCheckpoint` writes them),
    `writes_checkpoints()`: whether this process writes what it reads (one process
    of a multi-process job does),
    `preemption_sync()`: None where the process catches a preemption notice itself,
    else the job's sync point `reached(call) -> bool` (JAX: `jax.distributed`'s
    preemption service))."""

    def update_variable(self, variable, fn, *args):
        """Updates a model variable from inside the step, consistently on every replica:
        `fn(per_device_variable, *per_device_args)`; `fn` must assign and may return
        the assign op."""
        ...


# ------------------------------------------------------------ one backend only
class TpuTopology(Protocol):
    """JAX only: XLA:TPU's compile-only devices of a Cloud TPU slice, on a machine with
    no TPU (libtpu). Only JAX compiles in-process for a slice
    (`Backend.compiles_for_tpu()`); TensorFlow plans its model's JAX lowering in a JAX
    subprocess instead."""

    TPUCompilerUnavailable: type
    """A `RuntimeError`: libtpu is not installed or failed to load (the message says why
    and names the install)."""

    def libtpu_version(self) -> str | None:
        """The installed libtpu distribution's version, or None."""
        ...

    def slice_devices(self, tpu) -> list:
        """The compile-only devices of a slice (a `TPUSlice`), loaded once per slice.
        Raises `TPUCompilerUnavailable`."""
        ...

    def available(self) -> bool:
        """Whether XLA:TPU can compile here (libtpu installed and a small topology
        loads)."""
        ...

    def all_devices(self) -> list:
        """Every device of the job (all processes): what a plan compiled for a slice is
        rebuilt over when the job runs on that slice."""
        ...

    def xla_capacity(self, devices) -> int:
        """One device's memory as XLA:TPU counts it when it refuses a program, the
        capacity a plan on the slice is held to (cached per device kind)."""
        ...

    def reserving_hbm(self, nbytes: int):
        """A context: XLA:TPU compiles made in it leave `nbytes` of each device's HBM
        free (a plan's headroom, which XLA:TPU then schedules within)."""
        ...

    def compile_options(self, reserved_bytes: int | None = None) -> dict:
        """XLA:TPU's compile options for a compile leaving `reserved_bytes` of HBM free
        (None: one made now, as `reserving_hbm` says)."""
        ...


class ShardedCheckpoint(Protocol):
    """JAX only: a checkpoint of arrays split over a multi-process job's devices, each
    process writing and reading its own shards (Orbax), for `ResumableCheckpoint`.
    `tf.distribute` holds every value whole in each process (mirrored), so TensorFlow's
    state is always read whole. The arrays a save writes come from the JAX step's
    `live_reader()` (where Keras' `fit` holds them, not synced into the variables)."""

    OrbaxUnavailable: type
    """An `ImportError`: orbax-checkpoint is not installed (the message names the
    install)."""

    Writer: type
    """`Writer()`: `save(path, tree)` on every process, returning once this process's
    shards are off its devices; `wait()` until the folder is complete on every process;
    `close()`."""

    def problem(self) -> str | None:
        """Why Orbax cannot write checkpoints here, or None."""
        ...

    def restore(self, path: str, like):
        """The tree saved at `path`, each array laid out as its counterpart in `like`."""
        ...

    def to_host(self, values) -> list:
        """This process's shards of each array, copied to host memory."""
        ...

    def from_host(self, copies) -> list:
        """The arrays `to_host` copied, on their devices again."""
        ...


class Data(Protocol):
    """TensorFlow only: `tf.data` as user input, on either Keras backend. A
    `tf.data.Dataset` exists only where TensorFlow is loaded; the neutral
    `keras_tpu_mem.tf_data` recognises one without importing TensorFlow and hands these
    functions to whoever reads or writes one (the distillation cache)."""

    def is_dataset(self, value) -> bool:
        """Whether `value` is a `tf.data.Dataset`."""
        ...

    def is_infinite(self, dataset) -> bool:
        """Whether `dataset` repeats forever."""
        ...

    def to_numpy(self, element):
        """A nest of numpy arrays (TypeError for sparse or ragged tensors)."""
        ...

    def examples_dataset(self, examples):
        """A dataset of the nest's first-axis slices."""
        ...

    def save_examples(self, examples, path):
        """Saves `examples` (a dataset) at `path`."""
        ...

    def load_examples(self, paths, num_examples):
        """The saved parts at `paths`, in order, as one dataset."""
        ...

    def directory_in_use(self, path) -> bool:
        """Whether `path` exists and is not empty."""
        ...

    def drop_logits(self, dataset):
        """`(data, logits)` elements -> `data`."""
        ...

    def first_element(self, dataset):
        """The first element of `dataset`."""
        ...


class BatchSplit(Protocol):
    """TensorFlow only: a TensorFlow step can get a batch whose size only the run knows
    (arrays, whose last batch is smaller), so splitting it into micro-batches can fail
    while the step runs (`Context.splits_batches_at_run_time()`). JAX traces every batch
    size as a Python int and refuses a batch that does not split before any step runs."""

    def explain_split_error(self, error, message):
        """Where `error` is the failed split of a batch into micro-batches, an error of
        the same kind saying `message()` first; else None."""
        ...


class Cluster(Protocol):
    """TensorFlow only: `tf.distribute.TPUStrategy` connects to a TPU by address, and
    `MirroredStrategy` over logical CPUs needs the host CPU split before TensorFlow
    starts, both set up in the process. JAX takes its devices as its runtime lists them
    (a TPU VM's chips, `XLA_FLAGS` for host devices, `jax.distributed` for pods)."""

    def resolve_tpu_address(self, tpu: str | None, environ=None,
                            local_tpu_present: bool | None = None) -> tuple[str | None, str]:
        """`(address, reason)`: which TPU to connect to (an explicit `tpu`, `TPU_NAME`,
        `COLAB_TPU_ADDR`, a local TPU VM) or None, and why; touches no TensorFlow."""
        ...

    def shared_strategy(self, key: tuple, factory):
        """The process-wide strategy for `key` (an accelerator set), made by `factory()`
        the first time (a second TPUStrategy or MirroredStrategy over the same devices
        breaks the first)."""
        ...

    def mirrored_logical_cpus(self, count: int):
        """The process-wide `MirroredStrategy` over `count` logical CPUs (configured if
        needed)."""
        ...

    def configure_logical_cpus(self, count: int) -> None:
        """Splits the host CPU into `count` logical devices (before TensorFlow
        initialises; the same count again is a no-op). Raises `RuntimeError` otherwise."""
        ...


#: Every concern, by module name, and its protocol.
CONCERNS: dict[str, type] = {
    "context": Context,
    "devices": Devices,
    "compiled": Compiled,
    "compiled_layers": CompiledLayers,
    "materialize": Materialize,
    "profiler": Profiler,
    "sharding": Sharding,
    "storage": Storage,
    "strategy": Strategy,
    "trainer": Trainer,
    "tpu_topology": TpuTopology,
    "sharded_checkpoint": ShardedCheckpoint,
    "data": Data,
    "batch_split": BatchSplit,
    "cluster": Cluster,
}

#: The concerns only one backend has, and that backend (each protocol says why).
ONLY_ON: dict[str, str] = {
    "tpu_topology": "jax",
    "sharded_checkpoint": "jax",
    "data": "tensorflow",
    "batch_split": "tensorflow",
    "cluster": "tensorflow",
}

#: Modules of a backend that are parts of one concern's implementation, not concerns.
PARTS: dict[str, tuple[str, ...]] = {
    "jax": ("feature_state", "gradients", "host_copy", "layout", "per_device", "pulled",
            "reducers", "train_function"),
    "tensorflow": ("feature_state",),
}


def members(protocol: type) -> dict:
    """A protocol's members: name -> `"class"` for a class the module defines (an
    annotated attribute here), else the function's parameters as `inspect` gives them,
    without `self`."""
    import inspect

    found = {name: "class" for name in getattr(protocol, "__annotations__", {})}
    for name, value in vars(protocol).items():
        if not name.startswith("_") and inspect.isfunction(value):
            found[name] = list(inspect.signature(value).parameters.values())[1:]
    return found


__all__ = ["CONCERNS", "ONLY_ON", "PARTS", "BatchSplit", "Cluster", "CompileRefused",
           "Compiled", "CompiledLayers", "Context", "Data", "Devices", "Materialize",
           "Profiler", "ShardedStateUnavailable", "Sharding", "Storage", "Strategy",
           "TpuTopology", "Trainer", "members"]
