"""One process of a localhost JAX cluster, for `test_multiprocess_jax.py` (not a test).

`python multiprocess_worker_jax.py PROCESS_ID NUM_PROCESSES DEVICES PORT OUT.npz FEATURES`

Trains the same model on the same global batches under `DataParallel` over
every device of the cluster (`NUM_PROCESSES` x `DEVICES` host CPU devices;
gloo CPU collectives between processes) with the callbacks FEATURES names —
`accumulation`: `GradientAccumulation(4)`; `prune_distill`: `Pruning`
(ConstantSparsity 0.5, masks recomputed every 2 updates) and `Distillation`
from a live teacher that is sharded by the same distribution; `sharded`: no
callback, under `ShardedDataParallel()` (weights and Adam slots split over
every device of the cluster) instead of `DataParallel`; `resume`: the run of
`resume_cases.py` (every feature, `ResumableCheckpoint`, killed where told) under
`DataParallel`; `resume_fsdp`: the same under `ShardedDataParallel()` (the state split
over the processes: Orbax writes the checkpoints) — and
writes the final weights (whole) and update count to `OUT.npz`.
Each process feeds its own slice of every global batch
(`auto_shard_dataset=False`), as on a multi-host TPU slice.
"""

from __future__ import annotations

import os
import sys

GLOBAL_BATCH = 32
UPDATES = 5


def _callbacks(features: str, keras, np):
    import keras_tpu_mem as ktm

    if features == "sharded":
        return []
    if features == "accumulation":
        return [ktm.GradientAccumulation(4)]
    if features == "prune_distill":
        keras.utils.set_random_seed(7)  # the teacher: its own fixed weights
        teacher = keras.Sequential([keras.Input((16,)),
                                    keras.layers.Dense(64, activation="relu"),
                                    keras.layers.Dense(8)])
        return [ktm.Pruning(ktm.ConstantSparsity(0.5, begin_step=0, frequency=2)),
                ktm.Distillation(teacher, temperature=2.0, alpha=0.5)]
    raise ValueError("FEATURES must be 'accumulation', 'prune_distill' or 'sharded', got "
                     f"{features!r}")


def _resume(out: str, case: str) -> None:
    """`resume`, `resume_fsdp`: `resume_cases.train(case, ...)` (every training feature,
    data shuffled through `distribute(seed=...)`, this process's share of each global
    batch), with `ResumableCheckpoint(KTM_RESUME_DIR)` when that is set, a SIGKILL of
    this process at the end of batch `KTM_KILL_AT` when that is set, and a preemption
    notice (SIGTERM) to process 0 there when `KTM_NOTICE_AT` is set (the periodic saves
    then every 1000 updates: none mid-epoch); the final state
    (weights, optimizer variables, masks: gathered whole from every process) by sorted
    name, then the update count and the device count."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also under -P
    import resume_cases

    directory = os.environ.get("KTM_RESUME_DIR")
    stop_at, stop, every = None, "raise", resume_cases.EVERY
    if os.environ.get("KTM_KILL_AT"):
        stop_at, stop = int(os.environ["KTM_KILL_AT"]), "kill"
    elif os.environ.get("KTM_NOTICE_AT"):  # every process saves at a notice to process 0
        every = 1000
        if jax.process_index() == 0:
            stop_at, stop = int(os.environ["KTM_NOTICE_AT"]), "notice"
    model, callbacks, _ = resume_cases.train(case, directory, stop_at=stop_at, stop=stop,
                                             every=every)
    resumed = [c.resumed_from for c in callbacks if hasattr(c, "resumed_from")]
    if resumed and resumed[0] is not None:  # read by the test from this process's log
        print(f"resumed from update {resumed[0].update}", flush=True)
    arrays = resume_cases.state_arrays(
        model, callbacks, lambda value: np.asarray(multihost_utils.process_allgather(
            value, tiled=True)))
    iterations = int(np.asarray(model.optimizer.iterations.value.addressable_data(0)))
    np.savez(out, *(arrays[name] for name in sorted(arrays)), iterations=iterations,
             devices=jax.device_count())


def main(process_id: int, num_processes: int, devices: int, port: int, out: str,
         features: str) -> None:
    # Before JAX starts: this process's device count (the parent test runs
    # with 8), and XLA:CPU's pool size (see tests/conftest.py for why).
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ["NPROC"] = "16"
    os.environ["KERAS_BACKEND"] = "jax"
    import jax

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras
    import numpy as np

    if num_processes > 1:
        keras.distribution.initialize(job_addresses=f"127.0.0.1:{port}",
                                      num_processes=num_processes, process_id=process_id)
    if features in ("resume", "resume_fsdp"):
        _resume(out, {"resume": "cluster", "resume_fsdp": "cluster_fsdp"}[features])
        return
    rng = np.random.default_rng(0)
    x = rng.normal(size=(UPDATES * GLOBAL_BATCH, 16)).astype("float32")
    y = rng.integers(0, 8, UPDATES * GLOBAL_BATCH).astype("int32")
    # This process's rows of every global batch: its devices' shares.
    local = GLOBAL_BATCH // num_processes
    rows = np.concatenate([np.arange(step * GLOBAL_BATCH + process_id * local,
                                     step * GLOBAL_BATCH + (process_id + 1) * local)
                           for step in range(UPDATES)])

    if features == "sharded":
        from keras_tpu_mem.sharding import ShardedDataParallel

        distribution = ShardedDataParallel(devices=jax.devices(), auto_shard_dataset=False)
    else:
        distribution = keras.distribution.DataParallel(devices=jax.devices(),
                                                       auto_shard_dataset=False)
    with distribution.scope():
        callbacks = _callbacks(features, keras, np)
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((16,)),
                                  keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(8)])
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x[rows], y[rows], batch_size=local, epochs=1, shuffle=False, verbose=0,
                  callbacks=callbacks)
    if features == "sharded":
        from jax.experimental import multihost_utils

        # Split weights: gather every process's shards into the whole array.
        weights = [np.asarray(multihost_utils.process_allgather(v.value, tiled=True))
                   for v in model.weights]
        split = [v.path for v in model.weights
                 if "batch" not in tuple(v.value.sharding.spec)]
        assert split == [], f"weights not split over the cluster: {split}"
    else:
        # Replicated weights: this process's first device holds a full copy.
        weights = [np.asarray(v.value.addressable_data(0)) for v in model.weights]
    np.savez(out, *weights, iterations=int(np.asarray(
        model.optimizer.iterations.value.addressable_data(0))),
        devices=jax.device_count())


if __name__ == "__main__":
    pid, count, devices, port = (int(a) for a in sys.argv[1:5])
    main(pid, count, devices, port, sys.argv[5], sys.argv[6])
