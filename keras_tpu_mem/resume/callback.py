"""`ResumableCheckpoint`: a preempted `fit` resumes at the batch it reached, exactly.

Keras' `BackupAndRestore(save_freq=N)` restores the weights of batch N but then
replays the epoch from its first batch; an epoch of a real dataset is hours of a
spot TPU. This callback saves, at optimizer-update boundaries, everything an
uninterrupted run holds at that point (the model's variables with their random
seed state, the optimizer's, the compiled metrics', every engine feature's
carried state such as pruning masks) with the epoch and the batch within it. A
restarted script restores it at `on_train_begin`, starts `fit` at that epoch and
reads the epoch's first batches again without training on them (the engine
skips those calls), so the run goes on from the next batch as if it had never
stopped. A preemption notice (SIGTERM) is saved at the next update boundary before
the process ends (`preemption`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import os
import time
import weakref

import keras

from keras_tpu_mem import backends
from keras_tpu_mem._compat import keras as keras_compat
from keras_tpu_mem._utils import check_positive_int, logger, unique
from keras_tpu_mem.engine import Engine, FitRefused, StepContext, observe_first_batch
from keras_tpu_mem.resume import preemption, store

_MODEL, _OPTIMIZER, _METRICS = "model", "optimizer", "metrics"

#: What a restarted fit can read again in the same order, as its refusals list it.
_POSITIONABLE = ("arrays with `shuffle=False`, a keras.utils.PyDataset (batches by index) "
                 "with `shuffle=False`, or a tf.data.Dataset / grain dataset whose order is "
                 "the same at every run")


#: The callback that last wrote each directory in this process. A fit interrupted in a
#: notebook (KeyboardInterrupt, an error) calls no `on_train_end`, so its last write
#: may still be in flight when the cell is run again with a new callback: the new one
#: waits for it before it reads the directory (a checkpoint half-written there would
#: otherwise be taken for one cut short, and pruned under the writer).
_LAST_WRITER: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _directory_key(directory: str) -> str:
    return directory if store.is_remote(directory) else os.path.realpath(directory)


def _check_data(model, epochs: int):
    """Refuses data a restarted fit cannot read again in the same order, before
    anything is restored or saved; returns the data's `EpochOrder`, if it has one
    (`TPUStrategyWrapper.distribute(seed=...)`). `epochs`: the fit's."""
    found = keras_compat.fit_data(model)
    if found is None:
        logger.warning(
            "ResumableCheckpoint could not tell what data this fit reads: a resume is "
            "exact only if it comes in the same order at every run (%s).", _POSITIONABLE)
        return None
    kind, shuffled, source = found[:3]
    if kind == "Python generator":
        raise TypeError(
            "ResumableCheckpoint cannot position a Python generator (fit's `x`): a "
            "restarted script's generator starts again at its first batch, so the resumed "
            f"epoch would train on other examples. Pass {_POSITIONABLE}.")
    if shuffled:
        raise ValueError(
            f"ResumableCheckpoint needs the batches in the same order at every run, and "
            f"fit(shuffle=True), the default, reorders the {kind} at random at each run: "
            "the resumed epoch would train on other examples. Pass `shuffle=False` "
            "(and shuffle with TPUStrategyWrapper.distribute(..., seed=...): each "
            "epoch's order a function of the seed and the epoch).")
    if kind == "tf.data.Dataset":
        _check_tf_data_order(source, found, int(epochs))
    return getattr(source, "epoch_order", None)


def _check_tf_data_order(dataset, found, epochs: int) -> None:
    """Refuses a `tf.data.Dataset` whose own `shuffle` a restarted script would draw
    anew: one without a seed, and a seeded one that reshuffles at each of the several
    iterators Keras makes over this fit (one per epoch, or per pass over the data with
    `steps_per_epoch`), whose count a restart starts afresh."""
    from keras_tpu_mem._compat import tensorflow as tf_compat

    shuffles = tf_compat.dataset_shuffles(dataset) or []
    if any(not seeded for seeded, _ in shuffles):
        raise ValueError(
            "ResumableCheckpoint: the tf.data.Dataset shuffles without a seed "
            "(`.shuffle(buffer_size)`), so a restarted script draws another order and the "
            "resumed epoch would train on other examples. Give the shuffle a seed: "
            "`.shuffle(buffer_size, seed=S)`, or `tf.random.set_seed(S)` before the "
            "dataset is built.")
    if not any(reshuffles for _, reshuffles in shuffles):
        return
    starts = keras_compat.epoch_starts(found.steps_per_epoch, found.num_batches,
                                       found.steps_per_execution)
    if 0 in itertools.islice(starts, 1, epochs):  # an epoch after the first opens a pass
        raise ValueError(
            "ResumableCheckpoint: the tf.data.Dataset's seeded shuffle reshuffles at each "
            "pass (`reshuffle_each_iteration=True`, the default), and this fit makes a new "
            "pass at each epoch: each pass's order comes from a count of the passes made "
            "in this process, which a restarted script starts afresh (epoch 3 would be read "
            "in epoch 1's order). Pass `reshuffle_each_iteration=False` (the same order "
            "every epoch), or make the data one stream: `.repeat()` and `steps_per_epoch` "
            "(the repeated passes' orders are then the same at every run).")


def _orbax_problem(split) -> None:
    """Raises where this fit cannot write through Orbax: on TensorFlow a `ValueError`,
    without orbax-checkpoint installed an `ImportError` naming the install. `split`:
    the paths of the values split over processes that need it (None: `orbax=True`)."""
    backend = backends.current("ResumableCheckpoint")
    if not backend.has("sharded_checkpoint"):
        raise ValueError(
            f"ResumableCheckpoint(orbax=True) writes JAX arrays through Orbax, and this is "
            f"the {backend.label} backend, whose strategies hold every value whole in one "
            "process: pass `orbax=None` (the default) or False.")
    problem = backend.sharded_checkpoint.problem()
    if problem:
        why = (f"{len(split)} values (e.g. {split[0]!r}) are split over several processes' "
               "devices, and a checkpoint of them is written" if split else
               "`orbax=True` writes the state")
        raise backend.sharded_checkpoint.OrbaxUnavailable(
            f"ResumableCheckpoint: {why} through Orbax, each process its own shards, and "
            f"{problem}.")


def _build_optimizer(model) -> None:
    """Creates the optimizer's variables before they are restored: Keras builds them
    in the first step where no strategy is set (TensorFlow's default strategy)."""
    optimizer = model.optimizer
    if optimizer.built:
        return
    strategy = keras_compat.model_strategy(model)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        optimizer.build(model.trainable_variables)


class _FeatureState:
    """A feature's state (`Feature.init_state`), which the engine holds, saved as a
    group of its leaves and read and written whole: one engine call per feature (a
    read per leaf would copy the whole state once per leaf)."""

    def __init__(self, engine, feature, template):
        self.engine, self.feature, self.template = engine, feature, template
        #: What the checkpoint checks and names, as of a variable (no value).
        self.leaves = [_StateLeaf(self, f"{feature.name}/state/{index}", leaf)
                       for index, leaf in enumerate(keras.tree.flatten(template))]

    def snapshot(self) -> list[_StateLeaf]:
        """The leaves with the state's values now, from one read."""
        state = self.engine.feature_state(self.feature)
        values = keras.tree.flatten(self.template if state is None else state)
        return [_StateLeaf(self, leaf.path, leaf, value)
                for leaf, value in zip(self.leaves, values)]

    def assign(self, values) -> None:
        self.engine.set_feature_state(
            self.feature, keras.tree.pack_sequence_as(self.template, list(values)))


class _StateLeaf:
    """One value of a feature's state, described as the checkpoint describes a
    variable (`path`, `shape`, `dtype`; `value` in a `_FeatureState.snapshot`)."""

    def __init__(self, owner: _FeatureState, path: str, like, value=None):
        self.owner, self.path, self.value = owner, path, value
        self.shape = tuple(int(d) for d in like.shape)
        self.dtype = keras.backend.standardize_dtype(like.dtype)


def _readable(group: list) -> list:
    """What `state_values` reads a saved group through: the variables, or a feature's
    state as one snapshot of its leaves."""
    if group and isinstance(group[0], _StateLeaf):
        return group[0].owner.snapshot()
    return group


def _live_values(group: list) -> list:
    """The arrays a saved group holds now, where they are (no copy), read through the
    variables: at a fit's start, before Keras takes its state out of them (a save
    mid-epoch reads them through the step's `live_reader`)."""
    return [leaf.value for leaf in _readable(group)]


def _assign(group: list, values) -> None:
    """Writes `values` into a saved group: each variable, or a feature's whole state."""
    if group and isinstance(group[0], _StateLeaf):
        group[0].owner.assign(values)
        return
    for variable, value in zip(group, values):
        variable.assign(value)


class ResumableCheckpoint(keras.callbacks.Callback):
    """Saves the whole training state every `every` updates; a restarted `fit` resumes
    at the next batch, with the weights an uninterrupted run would have.

    What a checkpoint holds: every variable of the model (weights, non-trainable
    state, the random seed generators of layers such as `Dropout`), the optimizer's
    (slots, `iterations`), the compiled metrics' (so the epoch's logs are the
    uninterrupted run's), the state the package's feature callbacks carry in the step
    (`Pruning`'s masks), the epoch and the batch within it. Saves fall on update
    boundaries (never inside a `GradientAccumulation` window) every `every` updates,
    at each epoch's end, and at the first boundary after a preemption notice
    (`save_on_preemption`).

    On `on_train_begin` of a later `fit` with the same directory (the same script,
    restarted after a preemption), the newest complete checkpoint is restored, `fit`
    starts at its epoch, and the epoch's batches before its position are read and
    skipped without a step, so the data must come in the same order at every run:
    arrays with `shuffle=False`, or a `tf.data.Dataset` / `keras.utils.PyDataset` /
    grain dataset whose order is fixed (or a pure function of the epoch). Where
    `steps_per_epoch` is shorter than the data (a repeated dataset: Keras reads one
    iterator on across epochs), the restart first reads on to where that epoch's data
    began in the uninterrupted run. A Python
    generator (a restart starts it again at its first batch) and `fit(shuffle=True)`
    (a new random order at each run) are refused at `on_train_begin`, before any save
    or restore, also on the first run. A folder left half-written
    by a process killed mid-save is skipped for the previous complete checkpoint, with
    a warning naming it. A restart whose steps per epoch or global batch differ from
    the checkpoint's is refused before anything changes (the position would mean
    other examples).

    What it does not restore: other callbacks' own Python state (e.g.
    `EarlyStopping`'s patience counter). The state is written whole from one process
    into one file (`state.bin`), local or remote: `gs://bucket/run` goes through
    `tf.io.gfile` on TensorFlow and fsspec on JAX (`pip install gcsfs`), with
    `checkpoint.json` written last (object stores rename no folders). In a
    multi-process JAX job (a pod's hosts) whose state is replicated
    (`keras.distribution.DataParallel`), process 0 writes and every process reads the
    same checkpoint back at a restart. Where the state is split over the processes
    (`ShardedDataParallel` on a pod: no process holds it whole), every process writes
    and reads its own shards through Orbax (`pip install "keras-tpu-mem[checkpoint]"`),
    and process 0 commits the folder once every process's files are complete; Orbax
    reads it back into this run's layouts, so a checkpoint saved split resumes under
    another distribution too. Either way, give the processes one directory they all
    see (`gs://`, a shared disk).

    Args:
        directory: Directory of the checkpoints (created if missing): a local path or
            a remote one (`gs://...`).
        every: Save every this many optimizer updates (and at each epoch end).
        keep: How many of the newest checkpoints to keep.
        asynchronous: Write the files on a background thread, which also waits for the
            copies of the values off the device on JAX (where the devices have pinned
            host memory: the next step runs meanwhile); on TensorFlow, and through
            Orbax, the step waits for those copies. A save also waits for the previous
            write, if it has not finished. False writes before `fit` goes on.
        orbax: Write the arrays through Orbax, each process its own shards (JAX, with
            orbax-checkpoint installed). None (the default): where the state is split
            over a multi-process job's devices, and only there. True: always (e.g. to
            test a pod's checkpoints on one host). False: never; state split over
            processes is then refused at `on_train_begin`.
        save_on_preemption: At a preemption notice (SIGTERM, what a spot VM's
            shutdown sends its processes about 30 s before the VM stops), save at
            the next update boundary, wait for the files, then end the process as
            the notice would have: a process that is the whole job hands SIGTERM
            back to the handler it had before the fit (by default the process ends
            with it; if that handler returns, the fit goes on); the processes of a
            `jax.distributed` job save at the same update, agreed through JAX's
            preemption service, then exit with status 143. No update is lost. False:
            SIGTERM is left as it is.

    Example:

    ```python
    import numpy as np
    import keras
    import keras_tpu_mem as ktm

    x = np.random.rand(256, 8).astype("float32")
    y = np.random.randint(0, 2, 256)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # Run the script again after a preemption: it resumes at the next batch.
    model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
              callbacks=[ktm.ResumableCheckpoint("/tmp/ktm_resume_example", every=4)])
    ```
    """

    def __init__(self, directory, every: int = 100, keep: int = 2,
                 asynchronous: bool = True, orbax: bool | None = None,
                 save_on_preemption: bool = True):
        super().__init__()
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"`directory` must be a path (str or os.PathLike), got "
                            f"{type(directory).__name__}.")
        directory = os.fspath(directory)
        problem = store.is_remote(directory) and (
            backends.current("ResumableCheckpoint").storage.remote_path_problem(directory))
        if problem:
            raise ValueError(f"`directory` {directory!r} is a remote path, and {problem}. "
                             "Save to a local directory, or mount the bucket (gcsfuse).")
        check_positive_int(every, "every")
        check_positive_int(keep, "keep")
        if not isinstance(asynchronous, bool):
            raise TypeError(f"`asynchronous` must be a bool, got {asynchronous!r}.")
        if orbax is not None and not isinstance(orbax, bool):
            raise TypeError(f"`orbax` must be None (Orbax where the state is split over "
                            f"processes), True or False, got {orbax!r}.")
        if not isinstance(save_on_preemption, bool):
            raise TypeError(f"`save_on_preemption` must be a bool, got "
                            f"{save_on_preemption!r}.")
        if orbax:
            _orbax_problem(None)
        self.directory = directory
        self.every = every
        self.keep = keep
        self.asynchronous = asynchronous
        self.orbax = orbax
        self.save_on_preemption = save_on_preemption
        #: The checkpoint the last `fit` resumed from (a `CheckpointInfo`), or None.
        self.resumed_from = None
        # One writer thread for the fit (a thread made per save cost a 0.5 ms step
        # about 0.3 ms a save), and the write it runs.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._writer: concurrent.futures.Future | None = None
        self._write_error: BaseException | None = None
        # Whether this process wrote checkpoints (`state.bin`, or Orbax's commit): it then
        # deletes the spare folder their prune keeps (`_finish_writes`), also one that
        # a killed run left, which only the writing process may do.
        self._wrote_checkpoints = False
        # This fit's position and restore, set again at each on_train_begin.
        self._resume_at = self._metrics_values = self._saved_global_batch = None
        self._undo = self._last_begin = self._epoch_order = self._saved_groups = None
        self._fit_readers = {}
        # Whether this fit writes through Orbax (`orbax`, or state split over processes),
        # and Orbax's writer (made at the fit's first such save).
        self._sharded, self._sharded_writer = False, None
        self._epoch, self._skipping, self._position_pending = 0, False, False
        # Where this fit learns of a preemption notice (`preemption.watch`), or None.
        self._notice = None

    def get_config(self) -> dict:
        return {"directory": self.directory, "every": self.every, "keep": self.keep,
                "asynchronous": self.asynchronous, "orbax": self.orbax,
                "save_on_preemption": self.save_on_preemption}

    # ------------------------------------------------------------ variables
    def _groups(self, model) -> dict[str, list]:
        """Group name -> the variables it saves, in a fixed order (the order a script
        that builds the same model makes them in)."""
        optimizer = getattr(model, "optimizer", None)
        owners = [(_MODEL, model.variables),
                  (_OPTIMIZER, optimizer.variables if optimizer else []),
                  (_METRICS, model.metrics_variables)]
        engine = Engine.attach(model)
        for feature in engine.features:
            template = engine.feature_state(feature)
            if template is None:  # TensorFlow: its carriers are made in the first step
                template = feature.init_state(StepContext.outside(model))
            if template is not None:
                owners.append((f"feature:{feature.name}",
                               _FeatureState(engine, feature, template).leaves))
        groups, seen = {}, set()
        for name, variables in owners:  # a variable two owners list is saved once, first
            groups[name] = [v for v in unique(variables) if id(v) not in seen]
            seen.update(id(v) for v in groups[name])
        return groups

    def _updates_made(self, model, groups: dict | None = None) -> int:
        """`optimizer.iterations`, read as the state is (also in a multi-process job), or
        taken from `groups` (`_read_groups`) where they hold it."""
        iterations = model.optimizer.iterations
        if groups is not None:
            for variable, (_, value) in zip(self._saved_groups[_OPTIMIZER],
                                            groups[_OPTIMIZER]):
                if variable is iterations:
                    return int(value)
        return int(self._reader()([iterations])[0])

    def _scheduled(self, model, counted: int | None) -> int:
        """The updates a save counts from: `counted` between two steps (mid-epoch: no
        read, which would wait for the steps in flight), read at an epoch's end."""
        return counted if counted is not None else self._updates_made(model)

    def _fit_reader(self, kind: str):
        """This fit's `state_reader`, `state_copier` or `live_reader` of the step (`kind`),
        made at its first save, when the step has made every variable."""
        if kind not in self._fit_readers:
            self._fit_readers[kind] = getattr(self._engine.backend_step, kind)()
        return self._fit_readers[kind]

    def _reader(self):
        """This fit's `state_reader`."""
        return self._fit_reader("state_reader")

    def _read_groups(self, groups: dict[str, list]) -> dict[str, list]:
        """Group name -> `(path, numpy value)` of each of its variables now, from one
        read of them all."""
        readable = {name: _readable(group) for name, group in groups.items()}
        values = iter(self._reader()(
            [variable for group in readable.values() for variable in group]))
        return {name: [(variable.path, next(values)) for variable in group]
                for name, group in readable.items()}

    # ------------------------------------------------------------ restore
    def on_train_begin(self, logs=None):
        self._close_notice()  # of a fit of it that ended in an error
        self._finish_writes()
        self._raise_write_error()
        self._take_over_directory()
        model = self.model
        self._epoch_order = _check_data(model, (self.params or {}).get("epochs") or 1)
        self._steps = (self.params or {}).get("steps")
        self._spe = int(getattr(model, "steps_per_execution", 1) or 1)
        self._engine = Engine.attach(model)
        groups = self._groups(model)
        # The values now, from one read of each feature's state.
        readable = {name: _readable(group) for name, group in groups.items()}
        # Decided here, before anything is restored, not at the first save.
        self._sharded = self._writes_sharded(readable)
        self._resume_at = self._metrics_values = self._undo = self._saved_groups = None
        self._fit_readers = {}
        self._position_pending = False
        self.resumed_from = None
        self._restore_latest(model, groups, readable)
        # Read here once, not through this fit's `_reader`, which is made at the first
        # save, once the step has made every variable.
        self._base_update = int(self._engine.backend_step.state_values(
            [model.optimizer.iterations])[0])
        self._last_saved = self._base_update
        self._batches = 0  # batches run since `_base_update` was read
        self._last_begin = None
        self._global_batch = None
        self._engine.unobserve(self._first_batch)  # from a fit of it that ran no step
        observe_first_batch(model, self._first_batch)
        if self.save_on_preemption:
            self._notice = preemption.watch(self._engine.backend_step.preemption_sync,
                                            keras_compat.fit_frame(model))

    def _writes_sharded(self, readable) -> bool:
        """Whether this fit writes through Orbax: `orbax=True`, or (`orbax=None`) state
        split over a multi-process job's devices, which no process can read whole.
        `readable`: group name -> its values (`_readable`)."""
        split = self._engine.backend_step.split_over_processes(
            [leaf for group in readable.values() for leaf in group])
        if split and self.orbax is False:
            raise ValueError(
                f"ResumableCheckpoint(orbax=False) writes every value whole from one "
                f"process, and {len(split)} values (e.g. {split[0]!r}) are split over "
                "several processes' devices: no process holds them whole. Pass "
                "`orbax=None` (the default): Orbax writes them, each process its shards.")
        if self.orbax or split:
            _orbax_problem(split or None)
            return True
        return False

    def _restore_latest(self, model, groups, readable) -> None:
        """Restores the newest complete checkpoint, if there is one. `groups`, and
        `readable` (their values), as this fit's start made them."""
        like = None
        if backends.current("ResumableCheckpoint").has("sharded_checkpoint"):
            # A checkpoint of split state is read into the arrays in its place, laid
            # out as this fit lays them out (saved split, resumed replicated too). On
            # JAX, Keras builds the optimizer before `on_train_begin`.
            like = {name: [leaf.value for leaf in group] for name, group in readable.items()}

        def check(info):
            nonlocal groups
            if not model.optimizer.built:  # TensorFlow builds it in the first step
                _build_optimizer(model)
                groups = self._groups(model)
            self._check_saved(info, groups)

        found = store.latest_complete(self.directory, check, like)
        if found is not None:
            self._restore(model, groups, *found)

    def _check_saved(self, info, groups) -> None:
        """Refuses a checkpoint of another model or other callbacks, or saved at other
        steps per epoch, before its arrays are read."""
        saved_steps = info.meta.get("steps_per_epoch")
        if saved_steps and self._steps and saved_steps != self._steps:
            raise ValueError(
                f"{info.path} was saved with {saved_steps} steps per epoch, and this fit "
                f"has {self._steps}: its position (epoch {info.epoch}, batch {info.batch}) "
                "would mean other examples. Resume with the global batch and data it was "
                f"saved with, or start afresh with another `directory`.")
        saved = info.meta["arrays"]
        for name, entries in saved.items():
            if name == _METRICS:
                continue  # checked where they are restored (`on_epoch_begin`)
            variables = groups.get(name)
            if variables is None:
                raise ValueError(
                    f"{info.path} holds the state of {name!r}, which this fit does not "
                    f"have (it has {sorted(groups)}). Resume with the same callbacks.")
            self._check_group(info, name, variables, entries)
        missing = [name for name, variables in groups.items()
                   if name not in saved and name != _METRICS and variables]
        if missing:
            raise ValueError(f"{info.path} holds no state for {missing}: this fit has "
                             "callbacks the saved run did not. Resume with the same ones.")

    def _kept(self, groups: dict[str, list]) -> dict:
        """The groups' values now, kept in host memory (this process's shards of split
        values): group name -> a function giving them back for `_assign`."""
        if self._sharded:
            sharded = backends.current("ResumableCheckpoint").sharded_checkpoint
            copies = {name: sharded.to_host(_live_values(group))
                      for name, group in groups.items()}
            return {name: functools.partial(sharded.from_host, kept)
                    for name, kept in copies.items()}
        return {name: functools.partial(list, [value for _, value in pairs])
                for name, pairs in self._read_groups(groups).items()}

    def _restore(self, model, groups, info, saved):
        before = self._kept({name: groups[name] for name in saved if name != _METRICS})
        for name, pairs in saved.items():
            if name == _METRICS:
                continue  # at the resumed epoch's start, after Keras resets them
            _assign(groups[name], [value for _, value in pairs])
        keras_compat.set_initial_epoch(model, info.epoch if info.epoch else None)

        def undo():
            for name, values in before.items():
                _assign(groups[name], values())
            keras_compat.set_initial_epoch(model, None)

        self._undo = undo
        self._metrics_values = (info, saved.get(_METRICS, []))
        self._saved_global_batch = info.meta.get("global_batch_size")
        self._resume_at = (info.epoch, info.batch)
        self.resumed_from = info
        logger.info("ResumableCheckpoint: resuming from %s (update %d): epoch %d, batch %d.",
                    info.path, info.update, info.epoch + 1, info.batch)

    @staticmethod
    def _check_group(info, name, variables, entries):
        """`entries`: the group's arrays as `checkpoint.json` describes them."""
        if len(variables) != len(entries):
            raise ValueError(
                f"{info.path} holds {len(entries)} {name} variables and this fit has "
                f"{len(variables)}: not the model/optimizer it was saved from. Build the "
                "same model and optimizer (the same script) to resume.")
        for variable, entry in zip(variables, entries):
            shape = tuple(int(d) for d in variable.shape)
            dtype = keras.backend.standardize_dtype(variable.dtype)
            saved = (tuple(entry["shape"]), entry["dtype"])
            if saved != (shape, dtype):
                raise ValueError(
                    f"{info.path}: {name} variable {entry['path']!r} was saved as "
                    f"{saved[0]} {saved[1]}, and this fit's {variable.path!r} is {shape} "
                    f"{dtype}. Build the same model to resume.")

    def _first_batch(self, size):
        self._global_batch = size
        undo, self._undo = self._undo, None
        saved = self._saved_global_batch
        if saved and size and saved != size:
            raise FitRefused(
                f"{self.resumed_from.path} was saved with a global batch of {saved}, and "
                f"this fit's is {size}: its position would mean other examples. Resume "
                "with the batch it was saved with, or start afresh with another "
                "`directory`.", undo=self._end_resume_refused(undo))

    def _end_resume_refused(self, undo):
        def run():
            if undo is not None:
                undo()
            self._engine.stop_skipping()
            self._resume_at = None
        return run

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._last_begin = None
        if self._epoch_order is not None:
            # Keras reads the epoch's first batch after this: the order of `epoch`, also
            # where a restarted fit starts at a later epoch than the data counted.
            self._epoch_order.set_epoch(epoch)
        resume = self._resume_at
        if resume is None or epoch != resume[0]:
            return
        # Where the data of this epoch's first call stands (`on_train_batch_begin`).
        self._position_pending = True
        if resume[1] == 0:
            return
        # Keras reset the metrics just before this: give them the epoch's first batches.
        info, pairs = self._metrics_values
        variables = self._groups(self.model)[_METRICS]
        if len(variables) == len(pairs):
            self._check_group(info, _METRICS, variables, info.meta["arrays"].get(_METRICS, []))
            _assign(variables, [value for _, value in pairs])
        else:
            # Keras builds the compiled metrics in the first step where no strategy is
            # set (TensorFlow's default strategy): nothing to give the saved sums to.
            logger.warning(
                "ResumableCheckpoint: this fit's metrics are not built before its first "
                "step, so epoch %d's logs cover only the batches after the restart (the "
                "weights are restored all the same).", epoch + 1)
        self._engine.start_skipping()
        self._skipping = True

    def on_train_batch_begin(self, batch, logs=None):
        # Saves happen here, before the call of `batch`, not in on_train_batch_end:
        # a callback with a batch-end hook makes Keras wait for every step's logs
        # (no asynchronous dispatch), which costs a fast step more than the saves.
        if self._position_pending:
            # With `steps_per_epoch`, the data runs on across epochs: a restart's new
            # iterator starts at the data's first batch, the uninterrupted run's
            # further on.
            self._position_pending = False
            read = keras_compat.position_fit_data(self.model, self._epoch)
            if read:
                logger.info("ResumableCheckpoint: read %d batches to where epoch %d's "
                            "data begins.", read, self._epoch + 1)
        if self._skipping:
            self._skip(batch)
            if self._skipping:
                return
        if self._last_begin is not None:
            self._batches += batch - self._last_begin
        self._last_begin = batch
        updates = self._base_update + self._batches // self._engine.batches_per_update()
        if self._engine.pending_micro_batches():
            return  # inside an accumulation window: never saved
        if self._notice is not None and self._notice.reached():
            self._save_at_notice(batch, updates)
        elif updates - self._last_saved >= self.every:
            self._save(self._epoch, batch, updates)

    def _save_at_notice(self, batch: int, updates: int) -> None:
        """A preemption notice: saves here (unless the last save holds this update),
        waits for the files, then ends the process as the notice would have."""
        try:
            if updates != self._last_saved:
                self._save(self._epoch, batch, updates)
            self._finish_writes()
            self._raise_write_error()
        except BaseException as err:
            # Said here: the process ends by the notice, which may not print it.
            logger.error("ResumableCheckpoint: the save at a preemption notice failed "
                         "(%s: %s); a restart resumes from the checkpoint before it.",
                         type(err).__name__, err)
            raise
        else:
            logger.warning("ResumableCheckpoint: update %d (epoch %d, batch %d) saved at a "
                           "preemption notice; ending the process.", updates,
                           self._epoch + 1, batch)
        finally:
            self._notice.end_process()

    def _skip(self, batch):
        resume_batch = self._resume_at[1]
        if batch >= resume_batch:
            self._engine.stop_skipping()
            self._skipping = False
            self._resume_at = None
            return
        count = self._spe if not self._steps else min(self._spe, self._steps - batch)
        if batch + count > resume_batch:
            raise ValueError(
                f"The checkpoint's position (batch {resume_batch}) falls inside a call of "
                f"{count} steps from batch {batch}: `steps_per_execution` differs from the "
                "run that saved it. Resume with the same `steps_per_execution`.")
        self._engine.skip_next_call(count)

    # ------------------------------------------------------------ save
    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        # A fit that ran no step (resumed at its end) did not call it: the next fit's
        # first batch is not this fit's.
        self._engine.unobserve(self._first_batch)
        self._engine.stop_skipping()
        self._skipping = False
        if self.resumed_from is not None:
            keras_compat.set_initial_epoch(self.model, None)
        self._finish_writes()
        try:
            self._raise_write_error()
        finally:
            # A notice after the last update boundary: the epoch-end save holds the end.
            self._close_notice()

    def _close_notice(self) -> None:
        notice, self._notice = self._notice, None
        if notice is not None:
            notice.close()

    def _take_over_directory(self) -> None:
        """Waits for the writes another `ResumableCheckpoint` of this process left in
        flight in the same directory (its fit ended in an error), then becomes the
        directory's writer. A write of it that failed is named in a warning: the fit
        resumes from the checkpoint before it."""
        key = _directory_key(self.directory)
        other = _LAST_WRITER.get(key)
        if other is not None and other is not self:
            other._finish_writes()
            err, other._write_error = other._write_error, None
            if err is not None:
                logger.warning("ResumableCheckpoint: the last write of the previous "
                               "callback on %r failed (%s: %s); resuming from the "
                               "checkpoint before it.", self.directory,
                               type(err).__name__, err)
        _LAST_WRITER[key] = self

    def _finish_writes(self) -> None:
        """Waits for the writes in flight and closes the writers: at the end of a fit,
        and at the start of the next where the last one ended in an error (Keras calls
        no `on_train_end` then)."""
        self._wait()
        if self._wrote_checkpoints:  # the directory then holds the checkpoints only
            store.drop_spare(self.directory)
            self._wrote_checkpoints = False
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self._sharded_writer is not None:
            writer, self._sharded_writer = self._sharded_writer, None
            try:
                writer.wait()  # this process's shards of the last save (every process)
            except BaseException as err:
                self._write_error = self._write_error or err
            writer.close()

    def _save(self, epoch: int, batch: int, counted: int | None = None) -> None:
        """Saves the state at `epoch`, `batch`. `counted`: the updates made, as counted
        between two steps (mid-epoch), which then need not wait for the steps in
        flight to read them; None at an epoch's end, where they are read."""
        # Not the `model` property: on JAX it syncs Keras' training state into every
        # variable (and Keras gathers it back before the next step), where the fit's
        # readers (`state_reader`, `live_reader`) read the state as it is.
        model = self._model
        self._batches = 0
        writes = self._engine.backend_step.writes_checkpoints()
        if not writes and not self._sharded:
            # Another process of the job writes the same (replicated) state. Mid-epoch
            # nothing is read here: a read would wait for this process's steps in flight,
            # and the job's next collective would make every process wait for it.
            self._last_saved = self._base_update = self._scheduled(model, counted)
            return
        if self._saved_groups is None:
            # Made once a step has run: Keras and the TensorFlow engine make the
            # optimizer's, the metrics' and the features' variables in the first one.
            self._saved_groups = self._groups(model)
        meta = {"epoch": epoch, "batch": batch, "steps_per_epoch": self._steps,
                "global_batch_size": self._global_batch,
                "batches_per_update": self._engine.batches_per_update(),
                "backend": self._engine.backend.label, "keras": keras.__version__}
        if self._sharded:
            update = self._updates_made(model)
            self._last_saved = self._base_update = update
            self._save_sharded(update, meta, writes)
            return
        # The copies to host start here (on JAX without waiting for the steps in
        # flight: the next step is dispatched meanwhile) and are waited for where the
        # files are written. The checkpoint is named by the update count it holds.
        readable = {name: _readable(group) for name, group in self._saved_groups.items()}
        collect = self._fit_reader("state_copier")(
            [leaf for group in readable.values() for leaf in group])
        self._last_saved = self._base_update = self._scheduled(model, counted)
        self._wait()
        self._raise_write_error()
        self._wrote_checkpoints = True

        def write():
            values = iter(collect())
            groups = {name: [(leaf.path, next(values)) for leaf in group]
                      for name, group in readable.items()}
            return store.write_checkpoint(self.directory, self._updates_made(model, groups),
                                          groups, meta)
        self._run_write(write)

    def _save_sharded(self, update, meta, writes) -> None:
        """Every process starts Orbax's save of its shards (the arrays as they are now:
        Orbax copies them off the devices before it returns); process 0 then commits
        the folder once every process's files are complete."""
        self._wait()
        self._raise_write_error()
        if self._sharded_writer is None:
            self._sharded_writer = backends.current(
                "ResumableCheckpoint").sharded_checkpoint.Writer()
        # Process 0 empties the folder before Orbax's save, whose first barrier the
        # other processes wait at before they write into it.
        staging = store.staging_folder(self.directory, update, make=writes)
        # The arrays where the fit holds them (the `model` property would sync every
        # variable, and Keras would gather them back before the next step).
        live = self._fit_reader("live_reader")
        tree = {name: live(_readable(group))
                for name, group in self._saved_groups.items() if group}
        self._sharded_writer.save(store.sharded_state_folder(staging), tree)
        if writes:
            self._wrote_checkpoints = True

            def commit():
                self._sharded_writer.wait()  # every process's files complete
                return store.commit_sharded(self.directory, staging, update,
                                            self._saved_groups, meta)
            self._run_write(commit)
        elif not self.asynchronous:
            self._sharded_writer.wait()  # this process's shards too, before fit goes on

    def _run_write(self, write) -> None:
        """`_writing(write)` on the writer thread, or here when not asynchronous."""
        if self.asynchronous:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="ResumableCheckpoint")
            self._writer = self._executor.submit(self._writing, write)
        else:
            self._writing(write)
            self._raise_write_error()

    def _writing(self, write):
        """Runs `write()` (which returns the checkpoint's folder), then prunes; an error
        is kept for the training thread (`_raise_write_error`)."""
        started = time.perf_counter()
        try:
            path = write()
            store.prune(self.directory, self.keep, recycle=True)
            logger.debug("ResumableCheckpoint: wrote %s in %.2f s.", path,
                         time.perf_counter() - started)
        except BaseException as err:  # raised on the training thread at the next save
            self._write_error = err

    def _wait(self):
        if self._writer is not None:
            self._writer.result()  # `_write` keeps its error for `_raise_write_error`
            self._writer = None

    def _raise_write_error(self):
        err, self._write_error = self._write_error, None
        if err is not None:
            raise RuntimeError(f"ResumableCheckpoint could not write to "
                               f"{self.directory!r}: {err}") from err


__all__ = ["ResumableCheckpoint"]
