"""What `ResumableCheckpoint` costs a fit: the step time with and without it.

One run measures, side by side on JAX, for two models — the digits MLP (64
inputs, 2 x Dense(256, relu), 10 classes; global batch 32, single device) and
the encoder of `bench_sharding.py` (2 attention blocks, width 256, sequence 64;
global batch 64, `DataParallel` over 8 host CPU devices) — each with Adam:

The digits (1,792 examples) are tiled 20 times and the encoder's data (512
sequences) 8 times, so an epoch is 1,120 and 64 updates.

* `none`         no checkpoint;
* `async/20`     `ResumableCheckpoint(every=20)` (the copies off the device
                 and the files made on a background thread);
* `sync/20`      `ResumableCheckpoint(every=20, asynchronous=False)`;
* `async/100`    `ResumableCheckpoint(every=100)`;
* `orbax/20`     `ResumableCheckpoint(every=20, orbax=True)`: the arrays written
                 through Orbax, as the processes of a pod whose state is split
                 over them write (asynchronous; needs orbax-checkpoint). Not in
                 the default set: `--configs none,async/20,orbax/20`.
* `async/epoch`  `ResumableCheckpoint(every=10**9)`: the epoch-end save only,
                 so the callback's per-batch cost (its hook, the engine's train
                 function) shows alone;
* `hook`         an empty Keras callback with a batch hook (Keras' own
                 per-batch cost of any such callback). Neither is in the default
                 set.
* `read:synced` `every=20` with the state read as first built: synced into
                 the variables by the callback's `model` property, then
                 `jax.device_get` (since 2026-12-06 it is read where Keras' fit
                 holds it). Not in the default set.
* `orbax:synced` `orbax/20` with the state synced into the variables before each
                 save (Orbax's path as built before 2026-12-06's last change;
                 since then Orbax gets the arrays where the fit holds them).
* `read:waited`  `every=20` with the copies off the device waited for on the
                 training thread, as before 2026-12-06's last change (since then
                 they go into pinned host memory and the writer thread waits).
* `write:...`    where an asynchronous save's cost goes: `every=20` with the
                 writer thread's work replaced by `nothing` (the save's part on
                 the training thread alone), a 4 ms `sleep` (no CPU), 2 MB of
                 SHA-256 (`hash`: CPU without the interpreter lock) or 1.5 ms of
                 Python (`python`: CPU holding the lock); or the real write
                 changed, as tried and dropped (docs/resume.md): the arrays copied
                 into one buffer first, then one checksum and one write
                 (`onebuffer`), its fsyncs skipped (`nosync`), its thread under
                 Linux's SCHED_IDLE policy (`idle`); or as built before
                 2026-12-06's last change: a new folder each save, the pruned one
                 deleted (`fresh`).
                 Not in the default set:
                 `--configs none,async/20,write:nothing,write:sleep,...`.

Every configuration fits one warm-up epoch; then they take turns, one epoch
each, for `--rounds` rounds (the first of each round rotating); each round's
time is divided by the `none` time of the same round, so all share the
machine's noise, and the medians over rounds are reported. Saves fall every 20
updates and at each epoch's end, so an epoch of N updates makes N // 20 + 1
saves (the table says how many). The checkpoints go to a temporary directory
on the local disk.

`--write-cost SAVES` measures instead what one save of the digits MLP's state
(about 1 MB) takes outside training, as built, without its fsyncs and with a new
folder each save (the pruned one deleted, as before 2026-12-06): its thread's
CPU, its wall time and the whole machine's CPU (the kernel's writeback too).

`--notice-latency N` measures instead, N times per model, how long a preemption
notice takes to be saved: SIGTERM sent at the end of a batch of a fit with
`ResumableCheckpoint(every=10**9)` (no periodic save mid-epoch), timed until the
callback hands the signal back to the script's own handler once the checkpoint is
written (the rest of the steps in flight, the copy, the write and its fsyncs).

Run:  python benchmarks/bench_resume.py [--models digits,encoder] [--rounds 7]
                                        [--configs none,async/20,...] [--out results.json]
      python benchmarks/bench_resume.py --write-cost 300
      python benchmarks/bench_resume.py --notice-latency 9 [--models digits,encoder]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ("none", "async/20", "sync/20", "async/100")
#: The writer thread's work in the `write:` probes, in place of the checkpoint's write.
PROBES = {"nothing": "nothing written", "sleep": "a 4 ms sleep",
          "hash": "2 MB of SHA-256 (the lock released)",
          "python": "1.5 ms of Python (the lock held)",
          "onebuffer": "the arrays copied into one buffer first",
          "nosync": "its fsyncs skipped",
          "idle": "its thread under SCHED_IDLE",
          "fresh": "a new folder each time (the pruned one deleted, not written over)"}
#: The `PROBES` that change the real write rather than replace it.
CHANGES = ("onebuffer", "nosync", "idle", "fresh")
ALL_CONFIGS = (*CONFIGS, "orbax/20", "async/epoch", "hook", "read:synced", "orbax:synced",
               "read:waited",
               *(f"write:{probe}" for probe in PROBES))
LABELS = {"none": "none", "async/20": "`ResumableCheckpoint(every=20)`",
          "sync/20": "`ResumableCheckpoint(every=20, asynchronous=False)`",
          "async/100": "`ResumableCheckpoint(every=100)`",
          "orbax/20": "`ResumableCheckpoint(every=20, orbax=True)`",
          "async/epoch": "`ResumableCheckpoint(every=10**9)` (the epoch-end save only)",
          "hook": "an empty Keras callback with a batch hook",
          "read:synced": "`every=20`, the state synced into the variables and read with "
                         "`jax.device_get` (the read as first built)",
          "orbax:synced": "`ResumableCheckpoint(every=20, orbax=True)`, the state synced "
                          "into the variables first (as before)",
          "read:waited": "`every=20`, the copies to host waited for on the training thread "
                         "(as before)",
          **{f"write:{probe}": (f"`every=20`, the write with {label}" if probe in CHANGES
                                else f"`every=20`, the writer's work replaced by {label}")
             for probe, label in PROBES.items()}}


@contextlib.contextmanager
def _writer_probe(probe: str | None, directory: str):
    """Within it, the writer thread does the `probe`'s work (`PROBES`) in place of, or
    as a change of, `store.write_checkpoint`'s; nothing changes for `None`."""
    from keras_tpu_mem.resume import store

    saved = {name: getattr(store, name)
             for name in ("write_checkpoint", "_save_state", "prune")}
    fsync = os.fsync
    if probe == "fresh":
        prune = store.prune
        store.prune = lambda directory, keep, recycle=False: prune(directory, keep)
    elif probe == "onebuffer":
        store._save_state = _save_state_one_buffer
    elif probe == "nosync":
        os.fsync = lambda fd: None
    elif probe == "idle":
        write = store.write_checkpoint

        def idle_write(*args, **kwargs):
            # The policy of the calling thread (pid 0), set at every save: it is cheap.
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return write(*args, **kwargs)
        store.write_checkpoint = idle_write
    elif probe is not None:
        store.write_checkpoint = _probe_writer(probe, directory)
    try:
        yield
    finally:
        os.fsync = fsync
        for name, value in saved.items():
            setattr(store, name, value)


@contextlib.contextmanager
def _read_synced(active: bool):
    """Within it, where `active` (`read:synced`), a save reads the state as first
    built: the callback's `model` property syncs Keras' training state into the
    variables (which Keras gathers back before the next step), then one
    `jax.device_get` of their values."""
    if not active:
        yield
        return
    import functools

    import jax

    from keras_tpu_mem.backends.jax.trainer import Step
    from keras_tpu_mem.resume.callback import ResumableCheckpoint

    save, values, copier = ResumableCheckpoint._save, Step.state_values, Step.state_copier

    def synced_save(self, epoch, batch, counted=None):
        _ = self.model  # the property syncs
        return save(self, epoch, batch, counted)

    def device_get(self, variables):
        return list(jax.device_get([variable.value for variable in variables]))
    ResumableCheckpoint._save = synced_save
    Step.state_values = device_get
    Step.state_copier = lambda self: lambda variables: functools.partial(
        list, device_get(self, variables))
    try:
        yield
    finally:
        ResumableCheckpoint._save, Step.state_values, Step.state_copier = save, values, copier


@contextlib.contextmanager
def _read_waited(active: bool):
    """Within it, where `active` (`read:waited`), a save waits on the training thread
    for its copies to host (`Step.state_reader`, as before 2026-12-06's last change)
    instead of starting them into pinned host memory for the writer to wait for."""
    if not active:
        yield
        return
    import functools

    from keras_tpu_mem.backends.jax.trainer import Step

    copier = Step.state_copier

    def waited(self):
        read = self.state_reader()
        return lambda variables: functools.partial(list, read(variables))
    Step.state_copier = waited
    try:
        yield
    finally:
        Step.state_copier = copier


def _save_state_one_buffer(path: str, arrays: list) -> tuple[int, int]:
    """`store._save_state` with the arrays copied into one buffer first, then one
    checksum and one write (fewer releases and takes of the interpreter lock)."""
    import zlib

    import numpy as np

    size = arrays[-1][0] + arrays[-1][1].nbytes if arrays else 0
    buffer = np.zeros(size, np.uint8)
    for offset, data in arrays:
        buffer[offset:offset + data.nbytes] = data
    with open(path, "wb") as handle:
        handle.write(buffer)
        handle.flush()
        os.fsync(handle.fileno())
    return size, zlib.crc32(buffer)


def _probe_writer(probe: str, directory: str):
    """A stand-in for `store.write_checkpoint` doing the `probe`'s kind of work."""
    import hashlib

    import numpy as np

    data = np.zeros(1 << 20, np.uint8)

    def work():
        if probe == "sleep":
            time.sleep(0.004)
        elif probe == "hash":
            hashlib.sha256(data).digest()
            hashlib.sha256(data).digest()
        elif probe == "python":
            end = time.thread_time() + 0.0015
            while time.thread_time() < end:
                pass

    def write(*args, **kwargs):
        work()
        return directory
    return write
BATCH = {"digits": 32, "encoder": 64}
#: The data tiled this many times: epochs long enough that the epoch-end save and the
#: wait for the last write at the fit's end weigh as little as in a real epoch.
TILES = {"digits": 20, "encoder": 8}


def _setup() -> None:
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    # 8 host devices need XLA:CPU's pool to have 8+ threads on a small machine, or its
    # in-process all-reduce can deadlock (tests/conftest.py says more).
    os.environ["NPROC"] = "16"
    flag = "--xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _model_and_data(name: str):
    import keras
    import numpy as np

    if name == "encoder":
        import bench_sharding

        x, y = bench_sharding._data("encoder")
        return bench_sharding._build("encoder"), (np.tile(x, (TILES[name], 1, 1)),
                                                   np.tile(y, TILES[name]))
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    n = len(x) // BATCH[name] * BATCH[name]
    return model, (np.tile(x[:n], (TILES[name], 1)), np.tile(y[:n].astype(np.int32),
                                                              TILES[name]))


def _batch_hook():
    """An empty Keras callback with a batch hook (the `hook` configuration)."""
    import keras

    class BatchHook(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            pass
    return BatchHook()


def _callbacks(config: str, directory: str) -> list:
    """The callbacks of one configuration (`LABELS`)."""
    from keras_tpu_mem import ResumableCheckpoint

    if config == "none":
        return []
    if config == "hook":
        return [_batch_hook()]
    every = config.split("/")[-1] if "/" in config else "20"
    return [ResumableCheckpoint(directory, every=10**9 if every == "epoch" else int(every),
                                asynchronous=not config.startswith("sync"),
                                orbax=True if config.startswith("orbax") else None)]


def _scope(name: str):
    """What model `name` is built and fit under: `DataParallel` over the 8 host devices
    for the encoder (a context factory), nothing for the digits MLP."""
    import keras

    if name == "encoder":
        return keras.distribution.DataParallel().scope
    return contextlib.nullcontext


def measure(name: str, rounds: int, root: str, configs=CONFIGS) -> dict:
    scope = _scope(name)
    batch = BATCH[name]
    runs, results = {}, {}
    for config in configs:
        with scope():
            model, (x, y) = _model_and_data(name)
            model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        runs[config] = (model, x, y)
        results[config] = {"times": []}
    steps = len(runs["none"][1]) // batch
    for r in range(rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            model, x, y = runs[config]
            directory = os.path.join(root, name, config.replace("/", "_"), str(r))
            probe = config[len("write:"):] if config.startswith("write:") else None
            callbacks = _callbacks(config, directory)
            with scope(), _writer_probe(probe, directory), \
                    _read_synced(config in ("read:synced", "orbax:synced")), \
                    _read_waited(config == "read:waited"):
                start = time.perf_counter()
                model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                          callbacks=callbacks)
                results[config]["times"].append(1000 * (time.perf_counter() - start) / steps)
            shutil.rmtree(directory, ignore_errors=True)
    for row in results.values():
        row["ms_per_step"] = statistics.median(row["times"])
        row["time_ratio"] = statistics.median(
            t / b for t, b in zip(row["times"], results["none"]["times"]))
    results["steps_per_epoch"] = steps
    results["saves_per_epoch"] = {every: steps // every + 1 for every in (20, 100)}
    results["configs"] = list(configs)
    return results


def markdown(name: str, results: dict) -> str:
    saves = results["saves_per_epoch"]
    lines = [f"**{name}** ({results['steps_per_epoch']} updates per epoch; saves per epoch: "
             f"{saves[20]} with `every=20`, {saves[100]} with `every=100`)", "",
             "| checkpoint | ms/step (median) | time × (median of per-round ratios) |",
             "|---|---|---|"]
    for config in results["configs"]:
        row = results[config]
        lines.append(f"| {LABELS[config]} | {row['ms_per_step']:.2f} | "
                     f"{row['time_ratio']:.3f} |")
    return "\n".join(lines)


def _machine_cpu_seconds() -> float:
    """CPU seconds every core of the machine has spent busy since boot (`/proc/stat`:
    the kernel's writeback threads included, which a thread's own CPU time misses)."""
    with open("/proc/stat") as handle:
        ticks = [int(field) for field in handle.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


#: `write_cost`'s variants: the name it reports, the `_writer_probe` it runs under.
WRITE_VARIANTS = {"synced": None, "not synced": "nosync",
                  "synced, a new folder each save": "fresh"}


def write_cost(saves: int, root: str) -> dict:
    """The CPU one save of the digits MLP's state takes outside training:
    `store.write_checkpoint` then `store.prune(keep=2, recycle=True)`, as the writer
    thread runs them, `saves` times, as built, without its fsyncs, and with a new folder
    each save (`WRITE_VARIANTS`). Per save, in ms: the thread's own CPU, the wall time,
    and the whole machine's CPU (Linux only: `/proc/stat`)."""
    from keras_tpu_mem.resume import store

    model, (x, y) = _model_and_data("digits")
    model.fit(x[:64], y[:64], batch_size=BATCH["digits"], epochs=1, verbose=0)
    groups = {"model": [(v.path, v.numpy()) for v in model.variables],
              "optimizer": [(v.path, v.numpy()) for v in model.optimizer.variables]}
    results = {"state_bytes": sum(value.nbytes for pairs in groups.values()
                                  for _, value in pairs)}
    for key, probe in [*WRITE_VARIANTS.items()] * 2:  # interleaved, each twice
        directory = tempfile.mkdtemp(dir=root)
        try:
            with _writer_probe(probe, directory):
                thread, wall = time.thread_time(), time.perf_counter()
                machine = _machine_cpu_seconds()
                for update in range(saves):
                    store.write_checkpoint(directory, update, groups, {"epoch": 0, "batch": 0})
                    store.prune(directory, 2, recycle=True)
                row = {"thread_ms": time.thread_time() - thread,
                       "wall_ms": time.perf_counter() - wall,
                       "machine_ms": _machine_cpu_seconds() - machine}
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        for name, seconds in row.items():
            results.setdefault(key, {}).setdefault(name, []).append(1000 * seconds / saves)
    for key in WRITE_VARIANTS:
        results[key] = {name: statistics.median(values)
                        for name, values in results[key].items()}
    return results


class _Handed(Exception):
    """Raised by `notice_latency`'s own SIGTERM handler: it ends the fit."""


def notice_latency(name: str, notices: int, root: str) -> dict:
    """Seconds from a preemption notice (SIGTERM at the end of a batch) to its hand-back
    by `ResumableCheckpoint` once the save is written, `notices` times on model `name`
    (the notice at a different batch each time), with the step time of a fit without
    the callback; medians."""
    import signal

    import keras

    from keras_tpu_mem import ResumableCheckpoint

    scope = _scope(name)
    batch = BATCH[name]
    with scope():
        model, (x, y) = _model_and_data(name)
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    steps = len(x) // batch
    step_s = (time.perf_counter() - start) / steps
    sent, handed, latencies = [], [], []

    class Notice(keras.callbacks.Callback):
        def __init__(self, at):
            super().__init__()
            self.at = at

        def on_train_batch_end(self, index, logs=None):
            if index == self.at:
                sent.append(time.perf_counter())
                os.kill(os.getpid(), signal.SIGTERM)

    def handler(signum, frame):
        handed.append(time.perf_counter())
        raise _Handed()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        for i in range(notices):
            directory = os.path.join(root, name, f"notice{i}")
            at = 5 + (i * 7) % max(1, steps - 10)
            with scope():
                try:
                    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False,
                              callbacks=[ResumableCheckpoint(directory, every=10**9),
                                         Notice(at)])
                except _Handed:
                    latencies.append(handed[-1] - sent[-1])
            shutil.rmtree(directory, ignore_errors=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return {"notices": len(latencies), "step_ms": 1000 * step_s,
            "latency_ms": 1000 * statistics.median(latencies),
            "latency_ms_max": 1000 * max(latencies)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="digits,encoder")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"which of {', '.join(ALL_CONFIGS)} (none first)")
    parser.add_argument("--out", default=None, help="also write the results as JSON")
    parser.add_argument("--write-cost", type=int, default=0, metavar="SAVES",
                        help="instead: the CPU one save of the digits MLP's state takes "
                             "outside training (as built, without fsync, with a new "
                             "folder each save), over SAVES saves")
    parser.add_argument("--notice-latency", type=int, default=0, metavar="N",
                        help="instead: the time from a preemption notice to its save "
                             "written, N times per model")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if args.notice_latency:
        def work(root):
            results = {}
            for name in models:
                row = results[name] = notice_latency(name, args.notice_latency, root)
                print(f"{name}: a notice saved and handed back in {row['latency_ms']:.1f} ms "
                      f"(median of {row['notices']}, max {row['latency_ms_max']:.1f}); "
                      f"a step {row['step_ms']:.2f} ms", flush=True)
            return results
    elif args.write_cost:
        def work(root):
            cost = write_cost(args.write_cost, root)
            print(f"one save of {cost['state_bytes'] / 2**20:.2f} MiB (ms per save, medians "
                  "of 2):")
            for key in WRITE_VARIANTS:
                print(f"  {key}: " + ", ".join(f"{name[:-3]} {value:.2f}"
                                               for name, value in cost[key].items()))
            return cost
    else:
        configs = tuple(args.configs.split(","))
        unknown = [c for c in configs if c not in ALL_CONFIGS]
        if unknown or configs[:1] != ("none",):
            parser.error(f"--configs: {unknown or args.configs} (accepted: "
                         f"{', '.join(ALL_CONFIGS)}; `none` first, the reference)")

        def work(root):
            everything = {}
            for name in models:
                everything[name] = measure(name, args.rounds, root, configs)
                print(markdown(name, everything[name]), flush=True)
                print()
            return everything
    _setup()
    root = tempfile.mkdtemp(prefix="bench_resume_")
    try:
        results = work(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0

if __name__ == "__main__":
    sys.exit(main())
