"""A directory of step-level checkpoints: written whole or not at all, read back checked.

Each checkpoint is one folder, `update-000000120/`, holding `state.bin` (every
array's raw bytes, one after another at 64-byte aligned offsets) and
`checkpoint.json` (where the run was: epoch, batch, update; each array's group,
path, shape, dtype and offset; the CRC-32 of `state.bin`, computed as it is
written). A save is a few large writes the interpreter lock is released for, so
an asynchronous save's writer thread takes little from the training loop. The
checksum finds a damaged or truncated file, as TensorFlow's checkpoints' CRC-32C
does, at less than half a SHA-256's CPU time (docs/resume.md); format 2's SHA-256
is still checked where a checkpoint records one.
A checkpoint is written into a hidden `.partial-update-…` folder and renamed
into place once both files are on disk, so a process killed mid-save leaves a
partial folder that no reader takes for a checkpoint; a folder whose files do
not match their checksum (a corrupt disk, a copy cut short) is skipped for the
previous complete one, with a warning naming it. The folder a prune drops is kept
as a hidden `.spare` (no checkpoint to any reader) for the next save to write over
in place (`prune(recycle=True)`), which costs the kernel less than a new file.

Arrays are stored as bytes plus their dtype's name, so dtypes numpy's own
format does not know (bfloat16) come back as they went in, bit for bit.

Remote directories (`gs://bucket/run`, any `scheme://`) are written through the
backend's file API (`tf.io.gfile` on TensorFlow; fsspec on JAX, `gcsfs` for
`gs://`), which has no atomic rename of a folder: there `state.bin` is written
into the checkpoint's own folder first and `checkpoint.json` last, so a folder
without `checkpoint.json` is a save cut short and is skipped. `state.bin` is
written and hashed in a local temporary file and copied up (local disk, not a
second copy in host memory), and read back in chunks into the memory the restored
arrays use.

State split over a multi-process JAX job's devices is written by every process,
each its own shards, through Orbax into `state.orbax/` (in place of `state.bin`),
and committed by one process like the rest (`checkpoint.json` last, then the
rename) once every process's files are complete; Orbax reads it back into the
layouts it is given (`read_arrays(info, like)`). Its files carry no checksum of
ours: `checkpoint.json` lists each file with its size, and a folder where one is
missing or of another size is skipped before Orbax reads it; one Orbax cannot
read otherwise is skipped too (a missing chunk is an error, not zeros).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import tempfile
import time
import zlib

import numpy as np

from keras_tpu_mem._utils import logger

#: Bumped when the layout of a checkpoint folder changes (1: the arrays in `state.npz`,
#: still read; 2: in `state.bin` with its SHA-256, still read; 3: with its CRC-32).
FORMAT_VERSION = 3
_PREFIX = "update-"
_PARTIAL = ".partial-"
#: A pruned checkpoint's folder kept for the next save to rewrite in place (locally).
_SPARE = ".spare"
_META = "checkpoint.json"
_STATE = "state.bin"
_STATE_V1 = "state.npz"
#: The split arrays of a multi-process job, written by every process through Orbax.
_STATE_ORBAX = "state.orbax"
#: Each array's offset in `state.bin` is a multiple of this (any dtype's alignment).
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What one checkpoint folder holds (read from its `checkpoint.json`).

    Attributes:
        path: The checkpoint's folder.
        epoch: The epoch the run resumes in (0-based, as `fit` counts).
        batch: The batch of that epoch the run resumes at (0: the epoch's start).
        update: Optimizer updates applied when it was saved (`optimizer.iterations`).
        saved_at: Seconds since the epoch (`time.time()`) when it was written.
        size_bytes: Bytes of its arrays on disk.
        meta: Everything else `checkpoint.json` records (steps per epoch, global batch,
            backend, Keras version).
    """

    path: str
    epoch: int
    batch: int
    update: int
    saved_at: float
    size_bytes: int
    meta: dict


class CorruptCheckpoint(ValueError):
    """A checkpoint folder whose files are missing or do not match their checksum."""


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # Keras' own dependency: bfloat16, float8 kinds

        return np.dtype(getattr(ml_dtypes, name))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every filesystem opens folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_remote(path: str) -> bool:
    """Whether `path` names a remote file system (`gs://...`): no atomic folder rename."""
    return "://" in path


def _files():
    """The backend's file API (`Storage.gfile()`), for remote paths."""
    from keras_tpu_mem import backends

    return backends.current("ResumableCheckpoint").storage.gfile()


def _exists(path: str) -> bool:
    return _files().exists(path) if is_remote(path) else os.path.exists(path)


def _isdir(path: str) -> bool:
    return _files().isdir(path) if is_remote(path) else os.path.isdir(path)


def _listdir(path: str) -> list[str]:
    if not is_remote(path):
        return os.listdir(path)
    return [name.rstrip("/") for name in _files().listdir(path)]


def _rmtree(path: str) -> None:
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
    elif _files().exists(path):
        _files().rmtree(path)


def _save_state(path: str, arrays: list) -> tuple[int, int]:
    """Writes `arrays` (`(offset, 1-D uint8 array)` in offset order) into one file at
    `path`, zeros between them, synced; returns its `(size, CRC-32)`, computed as it is
    written (nothing is read back). An existing file (a recycled folder's) is written
    over in place and cut to size: its blocks are reused, which costs the kernel less
    than allocating a new file's and freeing the pruned one's."""
    crc, size = 0, 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        for offset, data in arrays:
            for at, chunk in ((size, bytes(offset - size)), (offset, data)):
                crc = zlib.crc32(chunk, crc)
                _write_at(fd, chunk, at)
            size = offset + data.nbytes
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, crc


def _write_at(fd: int, data, offset: int) -> None:
    """All of `data` at `offset` (`os.pwrite` may write part of it)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _open(path: str, mode: str):
    """A local file, or a remote one through the backend's file API."""
    return _files().GFile(path, mode) if is_remote(path) else open(path, mode)


def _chunks(handle):
    """The rest of an open file, in 1 MiB chunks."""
    return iter(lambda: handle.read(1 << 20), b"")


def _copy(src: str, dst: str) -> None:
    """Copies one file in 1 MiB chunks, either side local or remote."""
    with _open(src, "rb") as source, _open(dst, "wb") as target:
        for chunk in _chunks(source):
            target.write(chunk)


def _name(update: int) -> str:
    return f"{_PREFIX}{update:09d}"


def _update_of(name: str) -> int | None:
    """The update a checkpoint folder's name gives (`update-000000120` -> 120); None
    for any other name."""
    digits = name[len(_PREFIX):]
    return int(digits) if name.startswith(_PREFIX) and digits.isdigit() else None


def staging_folder(directory: str, update: int, make: bool = True,
                   recycle: bool = False) -> str:
    """The folder a checkpoint's files are written into before `_commit`, made empty
    when `make` (by one process of a job): a hidden `.partial-` folder locally (renamed
    into place at the commit), the checkpoint's own folder remotely (complete once
    `checkpoint.json` is in it). Locally with `recycle`, the folder `prune` kept of a
    pruned checkpoint is renamed to it instead, its files to be written over."""
    remote = is_remote(directory)
    folder = os.path.join(directory, _name(update) if remote else _PARTIAL + _name(update))
    if make:
        # Remotely, the same update saved again (a resumed run's epoch end) reads as cut
        # short until its `checkpoint.json` is written again.
        _rmtree(folder)
        if remote:
            _files().makedirs(folder)
        elif not (recycle and _take_spare(directory, folder)):
            os.makedirs(folder)  # and the directory, the first time
    return folder


def _take_spare(directory: str, folder: str) -> bool:
    """Renames the spare folder (`prune(recycle=True)`) to `folder`; False if none."""
    try:
        os.replace(os.path.join(directory, _SPARE), folder)
    except OSError:  # none (the first saves), or a folder left in its place
        return False
    return True


def drop_spare(directory: str) -> None:
    """Deletes the spare folder `prune(recycle=True)` kept, if any (at the end of a fit:
    the directory then holds the checkpoints only)."""
    if not is_remote(directory):
        shutil.rmtree(os.path.join(directory, _SPARE), ignore_errors=True)


def _commit(directory: str, staging: str, record: dict) -> str:
    """Writes `checkpoint.json` into `staging` (last) and, locally, renames the folder
    into place; returns the checkpoint's folder."""
    if is_remote(directory):
        with _files().GFile(os.path.join(staging, _META), "w") as handle:
            handle.write(json.dumps(record))
        return staging
    with open(os.path.join(staging, _META), "w") as handle:
        # json.dumps, not json.dump: dump encodes in Python (holding the GIL the
        # training thread needs), dumps in C.
        handle.write(json.dumps(record))
        handle.flush()
        os.fsync(handle.fileno())
    final = os.path.join(directory, _name(record["update"]))
    if os.path.exists(final):  # the same update saved again (a resumed run's epoch end)
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(directory)
    return final


def write_checkpoint(directory: str, update: int, groups: dict[str, list], meta: dict) -> str:
    """Writes one checkpoint and returns its folder.

    Args:
        directory: The checkpoints' directory (created if missing), local or remote
            (`gs://...`, see the module's docstring).
        update: The update count; names the folder (`update-000000120`).
        groups: Group name -> list of `(path, numpy array)` in a fixed order.
        meta: JSON-serialisable position of the run (`epoch`, `batch` are required).
    """
    arrays, entries = _flat_arrays(groups)
    staging = staging_folder(directory, update, recycle=True)
    if not is_remote(directory):
        written = _save_state(os.path.join(staging, _STATE), arrays)
    else:
        # Hashed in a local file and copied up (no second copy in host memory).
        with tempfile.TemporaryDirectory(prefix="ktm-checkpoint-") as scratch:
            state = os.path.join(scratch, _STATE)
            written = _save_state(state, arrays)
            _copy(state, os.path.join(staging, _STATE))
    return _commit(directory, staging, _record(meta, update, written, entries))


def sharded_state_folder(staging: str) -> str:
    """Where Orbax writes a checkpoint's split arrays inside its staging folder."""
    return os.path.join(staging, _STATE_ORBAX)


def commit_sharded(directory: str, staging: str, update: int, groups: dict[str, list],
                   meta: dict) -> str:
    """Commits a checkpoint whose arrays Orbax wrote into `sharded_state_folder(staging)`
    on every process (once they are all complete): its `checkpoint.json` records each
    array's group, path, shape and dtype (`groups`: name -> what it saved, each with
    `path`, `shape` and `dtype`, as a variable has); Orbax's own files stand in for
    the checksum. `size_bytes` counts the arrays' bytes (Orbax's files add little)."""
    entries = {group: [{"path": item.path, "shape": [int(d) for d in item.shape],
                        "dtype": _dtype(str(item.dtype)).name}
                       for item in items]
               for group, items in groups.items()}
    size = sum(int(np.prod(entry["shape"], dtype=np.int64)) * _dtype(entry["dtype"]).itemsize
               for group in entries.values() for entry in group)
    files = _tree_files(sharded_state_folder(staging))
    record = _record(dict(meta, state=_STATE_ORBAX, files=files), update, (size, None), entries)
    return _commit(directory, staging, record)


def _tree_files(folder: str) -> dict[str, int]:
    """Every file under `folder`, local or remote: its path relative to `folder` (with
    `/`) -> its size in bytes."""
    files = {}
    remote = is_remote(folder)
    walk = _files().walk if remote else os.walk
    for root, _, names in walk(folder):
        for name in names:
            path = os.path.join(root, name)
            size = _files().stat(path).length if remote else os.path.getsize(path)
            files[os.path.relpath(path, folder).replace(os.sep, "/")] = int(size)
    return files


def _check_sharded_files(info: CheckpointInfo) -> None:
    """Raises `CorruptCheckpoint` naming the first file Orbax wrote (`checkpoint.json`'s
    `files`, listed at the commit) that is missing or not the size it was written at, so
    that Orbax never reads a damaged folder: its reads of one fail in threads that outlive
    the restore and print tracebacks ("Event loop is closed") after it. A folder whose
    files have their sizes but not their bytes is still Orbax's to find."""
    recorded = info.meta.get("files")
    if recorded is None:  # committed before the list was recorded
        return
    folder = os.path.join(info.path, _STATE_ORBAX)
    found = _tree_files(folder) if _isdir(folder) else {}
    for name, size in sorted(recorded.items()):
        if name not in found:
            raise CorruptCheckpoint(f"{info.path}: {_STATE_ORBAX}/{name} is missing")
        if found[name] != size:
            raise CorruptCheckpoint(f"{info.path}: {_STATE_ORBAX}/{name} has {found[name]} "
                                    f"bytes where {size} were written")


def _record(meta: dict, update: int, written: tuple[int, int | None], entries: dict) -> dict:
    size, crc32 = written
    return dict(meta, format=FORMAT_VERSION, update=int(update), saved_at=time.time(),
                size_bytes=size, crc32=crc32, arrays=entries)


def _flat_arrays(groups: dict[str, list]) -> tuple[list, dict]:
    """`([(offset in state.bin, the array's bytes as 1-D uint8)], group -> entries of
    checkpoint.json)`."""
    arrays, entries, end = [], {}, 0
    for group, pairs in groups.items():
        entries[group] = []
        for path, value in pairs:
            value = np.asarray(value)  # not ascontiguousarray: it makes a scalar 1-D
            if not value.flags.c_contiguous:
                value = value.copy(order="C")
            offset = -(-end // _ALIGN) * _ALIGN
            arrays.append((offset, value.reshape(-1).view(np.uint8)))
            end = offset + value.nbytes
            entries[group].append({"path": path, "shape": list(value.shape),
                                   "dtype": value.dtype.name, "offset": offset})
    return arrays, entries


def read_info(path: str) -> CheckpointInfo:
    """The `CheckpointInfo` of one checkpoint folder, without reading its arrays.

    Raises:
        CorruptCheckpoint: `checkpoint.json` is missing or unreadable.
    """
    meta_path = os.path.join(path, _META)
    try:
        with _open(meta_path, "r") as handle:
            meta = json.loads(handle.read())
        return CheckpointInfo(path=path, epoch=int(meta["epoch"]), batch=int(meta["batch"]),
                              update=int(meta["update"]), saved_at=float(meta["saved_at"]),
                              size_bytes=int(meta["size_bytes"]), meta=meta)
    except Exception as err:  # any file system's "not found" (tf.errors too) or bad JSON
        raise CorruptCheckpoint(f"{path}: {_META} is missing or unreadable ({err})") from err


def is_sharded(info: CheckpointInfo) -> bool:
    """Whether a checkpoint's arrays were written split, by every process (Orbax)."""
    return info.meta.get("state") == _STATE_ORBAX


def read_arrays(info: CheckpointInfo, like: dict[str, list] | None = None) -> dict[str, list]:
    """Group name -> list of `(path, array)`: numpy arrays checked against the checksum,
    or for a checkpoint of split arrays (`is_sharded`) arrays laid out as those of
    `like` (group name -> the arrays now in their place), each process reading its
    own shards.

    Raises:
        CorruptCheckpoint: the arrays' file is missing or does not match its checksum,
            or Orbax cannot read them back.
    """
    if is_sharded(info):
        return _read_sharded(info, like)
    name = _STATE_V1 if info.meta.get("format") == 1 else _STATE
    state = os.path.join(info.path, name)
    if not _exists(state):
        raise CorruptCheckpoint(f"{info.path}: {name} is missing")
    # Read once into host memory, where the arrays will live (remote too: no copy on
    # the local disk first).
    data = bytearray()
    with _open(state, "rb") as handle:
        for chunk in _chunks(handle):
            data += chunk
    if "crc32" in info.meta:
        matches, checksum = zlib.crc32(data) == info.meta["crc32"], "CRC-32"
    else:  # formats 1 and 2
        matches = hashlib.sha256(data).hexdigest() == info.meta.get("sha256")
        checksum = "SHA-256"
    if not matches:
        raise CorruptCheckpoint(f"{info.path}: {name} does not match its {checksum} in {_META}")
    if info.meta.get("format") == 1:  # an earlier build's .npz
        with np.load(io.BytesIO(data)) as stored:
            def stored_bytes(group, index, entry):
                return stored[f"{group}/{index}"].tobytes()
            return _arrays(info, stored_bytes)
    return _arrays(info, lambda group, index, entry: memoryview(data)[entry["offset"]:])


def _read_sharded(info: CheckpointInfo, like: dict[str, list] | None) -> dict[str, list]:
    from keras_tpu_mem import backends

    backend = backends.current("ResumableCheckpoint")
    if like is None or not backend.has("sharded_checkpoint"):
        raise ValueError(
            f"{info.path} holds training state split over a multi-process JAX job's "
            "devices (written by Orbax, each process its shards): it is read back on the "
            "JAX backend, into the variables of the model it was saved from.")
    stored = {group: entries for group, entries in info.meta["arrays"].items() if entries}
    _check_sharded_files(info)
    try:
        tree = backend.sharded_checkpoint.restore(
            os.path.join(info.path, _STATE_ORBAX), {group: like[group] for group in stored})
    except backend.sharded_checkpoint.OrbaxUnavailable:
        raise
    except Exception as err:  # Orbax's and TensorStore's errors for missing/bad files
        reason = str(err).splitlines()[0] if str(err) else ""
        if len(reason) > 300:  # TensorStore appends its whole spec
            reason = reason[:300] + "..."
        raise CorruptCheckpoint(f"{info.path}: Orbax could not read {_STATE_ORBAX} "
                                f"({type(err).__name__}: {reason})") from err
    return {group: [(entry["path"], value) for entry, value in
                    zip(entries, tree[group] if entries else [])]
            for group, entries in info.meta["arrays"].items()}


def _arrays(info: CheckpointInfo, stored_bytes) -> dict[str, list]:
    """The groups of `info` with each array made from `stored_bytes(group, index,
    entry)` (a buffer starting at its bytes), its dtype and shape."""
    groups = {}
    for group, entries in info.meta["arrays"].items():
        groups[group] = []
        for index, entry in enumerate(entries):
            dtype, shape = _dtype(entry["dtype"]), entry["shape"]
            value = np.frombuffer(stored_bytes(group, index, entry), dtype=dtype,
                                  count=int(np.prod(shape, dtype=np.int64)))
            groups[group].append((entry["path"], value.reshape(shape)))
    return groups


def _scan(directory: str) -> tuple[list[CheckpointInfo], list[str], list[str]]:
    """`scan`, with the paths of the folders whose save was cut short (to prune).

    A local checkpoint cut short is a `.partial-` folder (renamed when complete); a
    remote one is an `update-` folder without `checkpoint.json` (written last). A
    remote folder costs one request, the read of its `checkpoint.json`; only where that
    fails is the file's existence asked, to tell a save cut short from a corrupt one.
    """
    if not _isdir(directory):
        return [], [], []
    found, skipped, cut_short = [], [], []
    remote = is_remote(directory)
    for name in sorted(_listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(_PARTIAL):
            cut_short.append(path)
            skipped.append(_cut_short_message(path))
            continue
        if _update_of(name) is None or (not remote and not os.path.isdir(path)):
            continue
        try:
            found.append(read_info(path))
        except CorruptCheckpoint as err:
            if remote and not _exists(os.path.join(path, _META)):
                cut_short.append(path)
                skipped.append(_cut_short_message(path))
            else:
                skipped.append(f"Skipping a corrupt checkpoint: {err}")
    return sorted(found, key=lambda info: info.update), skipped, cut_short


def _cut_short_message(path: str) -> str:
    return (f"Skipping {path}: a checkpoint whose save was cut short (the process ended "
            "mid-save).")


def scan(directory: str) -> tuple[list[CheckpointInfo], list[str]]:
    """`(complete checkpoints oldest update first, why each other folder is left out)`:
    partial folders (a save cut short) and folders whose `checkpoint.json` cannot be
    read. A missing directory holds none."""
    found, skipped, _ = _scan(directory)
    return found, skipped


def list_checkpoints(directory: str, warn: bool = True) -> list[CheckpointInfo]:
    """The complete checkpoints in `directory`, oldest update first.

    Partial folders (a save cut short) and folders whose `checkpoint.json` cannot be
    read are left out, each with a warning naming it when `warn`.

    Args:
        directory: A `ResumableCheckpoint` directory (a missing one holds none).
        warn: Log a warning for each folder left out.

    Returns:
        A list of `CheckpointInfo`; the last is the one a restart resumes from (unless
        its arrays turn out corrupt).

    Example:

    ```python
    import keras_tpu_mem as ktm

    for info in ktm.list_checkpoints("/tmp/ktm_resume_example"):
        print(info.update, info.epoch + 1, info.batch, info.size_bytes)
    ```
    """
    found, skipped = scan(directory)
    for message in skipped if warn else []:
        logger.warning("%s", message)
    return found


def latest_complete(directory: str, check=None,
                    like: dict[str, list] | None = None) -> tuple[CheckpointInfo, dict] | None:
    """The newest checkpoint whose arrays read back whole, with its arrays
    (`read_arrays(info, like)`); None when there is none. Each one skipped on the way
    is named in a warning. `check(info)`, before each one's arrays are read, raises
    where it cannot be resumed (another model): that is not skipped."""
    for info in reversed(list_checkpoints(directory)):
        if check is not None:
            check(info)
        try:
            return info, read_arrays(info, like)
        except CorruptCheckpoint as err:
            logger.warning("Skipping a corrupt checkpoint for the previous one: %s", err)
    return None


def prune(directory: str, keep: int, recycle: bool = False) -> None:
    """Deletes all but the `keep` newest complete checkpoints, and partial folders (none
    is being written: saves and prunes take turns).

    Locally a folder is complete once renamed into place, so its name says it: no
    `checkpoint.json` is read (this runs after every save, on the writer thread, and
    Python work there holds the interpreter lock the training loop needs). With
    `recycle`, the newest pruned folder of `write_checkpoint`'s two files is renamed to
    a hidden spare (`.spare`, no checkpoint to any reader) that the next save writes
    over in place: reusing a file's blocks costs the kernel less CPU than freeing one
    file's and allocating another's (docs/resume.md). `drop_spare` deletes it."""
    if is_remote(directory):
        found, _, cut_short = _scan(directory)
        complete = [info.path for info in found]
    else:
        folders = [entry.name for entry in os.scandir(directory)
                   if entry.is_dir()] if os.path.isdir(directory) else []
        cut_short = [os.path.join(directory, name) for name in folders
                     if name.startswith(_PARTIAL)]
        updates = sorted(update for update in map(_update_of, folders) if update is not None)
        complete = [os.path.join(directory, _name(update)) for update in updates]
    for path in cut_short:
        _rmtree(path)
    pruned = complete[:-keep]
    if recycle and pruned and not is_remote(directory) and _SPARE not in folders \
            and sorted(os.listdir(pruned[-1])) == sorted((_META, _STATE)):
        os.replace(pruned.pop(), os.path.join(directory, _SPARE))
    for path in pruned:
        _rmtree(path)
