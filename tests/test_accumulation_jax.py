"""GradientAccumulation on the JAX backend: the JAX matrix of docs/testing.md on 8 host devices.

JAX only: what these check is JAX's own (the batch the traced step sees, per device
inside shard_map; ModelParallel layouts; the compiled step's collectives). The
backend-neutral behaviours (refusals, micro-batch windows, resume, full-batch
equality on the default/jit/DataParallel matrix) are `test_accumulation.py`'s, run
on both backends.

Every exactness test compares against an independent reference: a plain
Keras `fit` (Keras' own JAX train step, no keras_tpu_mem callback) on the full
global batch, from the same initial weights.
"""

from __future__ import annotations

import re

import jax
import keras
import numpy as np
import pytest
from helpers import (
    RecordingDense,
    collectives_in_loop_bodies,
    compiled_text,
    count_opcode,
    make_distribution,
    max_abs_diff,
    mesh_mlp,
    scope,
    sparse_ce,
    toy_data,
)
from jax.sharding import PartitionSpec

import keras_tpu_mem as ktm
from keras_tpu_mem._compat import jax as jax_compat
from keras_tpu_mem.accumulation import GradientAccumulation

GLOBAL_BATCH = 32
STEPS = 4
UPDATES = 5
LR, DECAY = 1e-2, 0.9


def _optimizer(kind):
    schedule = keras.optimizers.schedules.ExponentialDecay(LR, decay_steps=1, decay_rate=DECAY)
    if kind == "adam":
        return keras.optimizers.Adam(schedule)
    return keras.optimizers.SGD(schedule, momentum=0.9)


def _fit(case, kind, callbacks, steps_per_execution=1, data=None, epochs=1):
    distribution = make_distribution(case)
    x, y = data if data is not None else toy_data(UPDATES * GLOBAL_BATCH, classes=8)
    with scope(distribution):
        model = mesh_mlp()
        model.compile(optimizer=_optimizer(kind), loss=sparse_ce(), metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
        # Builds metrics and optimizer outside the recorded trace (fit's own
        # symbolic build would trace the model with the whole batch).
        model.evaluate(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, verbose=0)
        RecordingDense.seen.clear()
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False,
                            verbose=0, callbacks=callbacks)
        seen = list(RecordingDense.seen)
    return model, history, seen


# (case, steps_per_execution) -> the batch a layer sees inside the step with
# GradientAccumulation(4) of a global 32: the micro-batch, globally (8) or per
# device inside shard_map (DataParallel(8): 32 / 8 / 4 = 1; ModelParallel's
# batch axis of 2: 32 / 2 / 4 = 4), never the whole batch (32, 4 or 16).
MATRIX = {("none", 1): (8, 32), ("dp8", 1): (1, 4), ("mp2x4", 1): (4, 16), ("dp8", 4): (1, 4)}


@pytest.mark.parametrize("kind", ["adam", "sgd_momentum"])
@pytest.mark.parametrize("case,spe", list(MATRIX), ids=[f"{c}-spe{s}" for c, s in MATRIX])
def test_matches_plain_full_batch_fit(case, spe, kind):
    plain, plain_history, plain_seen = _fit(case, kind, [], spe)
    ours, history, seen = _fit(case, kind, [GradientAccumulation(STEPS)], spe)

    assert max_abs_diff(plain.get_weights(), ours.get_weights()) <= 1e-5
    assert int(ours.optimizer.iterations) == UPDATES
    # The schedule counts updates, not micro-batches: decayed 5 times.
    np.testing.assert_allclose(float(ours.optimizer.learning_rate), LR * DECAY**UPDATES,
                               rtol=1e-6)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[key], plain_history.history[key],
                                   rtol=1e-5, atol=1e-6)
    micro, whole_per_shard = MATRIX[(case, spe)]
    assert {batch for batch, _ in seen} == {micro}, seen
    assert GLOBAL_BATCH not in {b for b, _ in seen} and whole_per_shard not in {b for b, _ in seen}
    # The plain reference really traced the whole batch (the record works).
    assert {batch for batch, _ in plain_seen} == {GLOBAL_BATCH}


def test_model_parallel_kernels_stay_sharded():
    model, _, _ = _fit("mp2x4", "adam", [GradientAccumulation(STEPS)])
    for layer in model.layers:
        assert layer.kernel.value.sharding.spec == PartitionSpec(None, "model"), layer.name


def test_data_parallel_step_has_no_all_reduce_inside_the_micro_batch_loop():
    distribution = make_distribution("dp8")
    x, y = toy_data(GLOBAL_BATCH, classes=8)
    with distribution.scope():
        model = mesh_mlp()
        model.compile(optimizer="adam", loss=sparse_ce(), metrics=["accuracy"])
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0,
                  callbacks=[GradientAccumulation(STEPS)])
        text = compiled_text(model, (x, y))
    bodies = collectives_in_loop_bodies(text)
    assert bodies, "no while loop found in the compiled step"
    assert all(count == 0 for count in bodies.values()), bodies
    # The gradients are reduced after the loop, and no data moves between devices.
    assert count_opcode(text, "all-reduce") >= 1
    assert count_opcode(text, "all-to-all") == 0
    assert count_opcode(text, "collective-permute") == 0


def test_the_hlo_check_sees_an_all_reduce_inside_a_loop():
    # Control for the test above: a scan over micro-batches of the *global*
    # sharded array (what a plain `lax.scan` accumulation does) puts the
    # reduction inside the loop body, and the checker must see it.
    distribution = make_distribution("dp8")
    sharding = distribution.get_data_layout((GLOBAL_BATCH, 16)).backend_layout
    x = jax.device_put(np.ones((GLOBAL_BATCH, 16), "float32"), sharding)

    def summed(x):
        def body(total, micro):
            return total + micro.sum(axis=0), None

        return jax.lax.scan(body, jax.numpy.zeros(16), x.reshape(STEPS, -1, 16))[0]

    text = jax.jit(summed).lower(x).compile().as_text()
    assert any(count > 0 for count in collectives_in_loop_bodies(text).values())


def test_backup_and_restore_resumes_to_the_uninterrupted_weights(tmp_path):
    data = toy_data(UPDATES * GLOBAL_BATCH, classes=8)
    reference, _, _ = _fit("dp8", "adam", [GradientAccumulation(STEPS)], data=data, epochs=4)

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.optimizer.iterations.value == 12:  # inside epoch 3 of 4
                raise RuntimeError("preempted")

    distribution = make_distribution("dp8")
    x, y = data
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with distribution.scope():
        model = mesh_mlp()
        model.compile(optimizer=_optimizer("adam"), loss=sparse_ce(), metrics=["accuracy"])
        with pytest.raises(RuntimeError, match="preempted"):
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, shuffle=False, verbose=0,
                      callbacks=[backup, Interrupt(), GradientAccumulation(STEPS)])
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, shuffle=False, verbose=0,
                  callbacks=[backup, GradientAccumulation(STEPS)])
    assert int(model.optimizer.iterations) == 4 * UPDATES
    assert max_abs_diff(reference.get_weights(), model.get_weights()) <= 1e-6


def test_micro_batch_size_gives_the_same_split():
    by_steps, _, _ = _fit("dp8", "adam", [GradientAccumulation(STEPS)])
    by_size, _, seen = _fit("dp8", "adam", [GradientAccumulation(micro_batch_size=1)])
    assert max_abs_diff(by_steps.get_weights(), by_size.get_weights()) <= 1e-7
    assert {batch for batch, _ in seen} == {1}


def test_indivisible_per_replica_batch_is_refused_naming_the_numbers():
    x, y = toy_data(80, classes=8)
    with make_distribution("dp8").scope():
        model = mesh_mlp()
        model.compile(optimizer="adam", loss=sparse_ce())
        with pytest.raises(ValueError, match=r"per-replica batch of 5 \(global batch 40 over 8"):
            model.fit(x, y, batch_size=40, epochs=1, verbose=0,
                      callbacks=[GradientAccumulation(STEPS)])



def test_model_parallel_with_a_layer_output_layout():
    # A LayoutMap entry for a layer's output (Keras constrains the output to
    # it) naming the batch axis, which is manual inside the shard_map.
    x, y = toy_data(classes=8)
    weights = []
    for callbacks in ([], [GradientAccumulation(STEPS)]):
        distribution = make_distribution("mp2x4", {".*dense_in/output": ("batch", "model")})
        with distribution.scope():
            model = mesh_mlp()
            model.compile(optimizer="adam", loss=sparse_ce())
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks)
            weights.append(model.get_weights())
    assert max_abs_diff(*weights) <= 1e-5


# ------------------------------------------- dataset_yields="micro_batches"
MICRO = 8  # micro-batch size; 4 of them make the global batch of 32


def _adam():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=1, decay_rate=0.5)
    return keras.optimizers.Adam(schedule)


def _fit_micro(case, *, spe=1, steps=STEPS, data=None, batch_size=MICRO, callbacks=(),
               mode="micro_batches", metrics=("accuracy",)):
    """A fit with GradientAccumulation(steps, dataset_yields=mode) (None: a plain fit)."""
    x, y = data if data is not None else toy_data(UPDATES * GLOBAL_BATCH, classes=8)
    distribution = make_distribution(case)
    with scope(distribution):
        model = mesh_mlp()
        model.compile(optimizer=_adam(), loss=sparse_ce(), metrics=list(metrics),
                      steps_per_execution=spe)
        model.evaluate(x[:batch_size], y[:batch_size], batch_size=batch_size, verbose=0)
        RecordingDense.seen.clear()
        own = [] if mode is None else [GradientAccumulation(steps, dataset_yields=mode)]
        history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0,
                            callbacks=[*own, *callbacks])
        seen = list(RecordingDense.seen)
    return model, history, seen


# case -> the batch a layer sees inside the pulled step: the micro-batch of 8,
# per device inside shard_map (DataParallel(8): 1; ModelParallel's batch axis
# of 2: 4).
PULLED = {("none", 1): 8, ("dp8", 1): 1, ("mp2x4", 1): 4, ("none", 2): 8, ("dp8", 2): 1,
          ("dp8", 8): 1}


@pytest.mark.parametrize("case,spe", list(PULLED), ids=[f"{c}-spe{s}" for c, s in PULLED])
def test_micro_batches_equal_full_batch(case, spe):
    """Issue 17's floor: 160 examples as micro-batches of 8, steps=4 == plain fit at 32."""
    reference, ref_history, _ = _fit_micro(case, mode=None, batch_size=GLOBAL_BATCH)
    model, history, seen = _fit_micro(case, spe=spe)
    assert max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-6
    assert int(model.optimizer.iterations) == UPDATES
    # The schedule decayed once per update (decay_steps=1, rate 0.5), not per micro-batch.
    np.testing.assert_allclose(float(model.optimizer.learning_rate), 0.01 * 0.5**UPDATES,
                               rtol=1e-6)
    # Metrics update on every micro-batch: the mean of equal micro-batch losses
    # (one window, one set of weights) is the full batch's loss.
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[key], ref_history.history[key],
                                   rtol=1e-5, atol=1e-6)
    assert {batch for batch, _ in seen} == {PULLED[(case, spe)]}, seen


@pytest.mark.slow
def test_micro_batches_run_eagerly_match_full_batch():
    """run_eagerly: the pulled steps unjitted (shard_map runs eagerly too).

    Two updates of 2 micro-batches (4 eager micro-batch steps, not 20: an eager
    shard_map compiles each of its operations, over a thousand XLA compiles for 8
    steps): a second window still follows an applied one, so an accumulator the
    first left behind would show."""
    updates, steps = 2, 2
    data = toy_data(updates * steps * MICRO, classes=8)
    x, y = data
    reference, _, _ = _fit_micro("dp8", mode=None, batch_size=steps * MICRO, data=data)
    assert int(reference.optimizer.iterations) == updates
    with make_distribution("dp8").scope():
        model = mesh_mlp()
        model.compile(optimizer=_adam(), loss=sparse_ce(), run_eagerly=True)
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0,
                  callbacks=[GradientAccumulation(steps, dataset_yields="micro_batches")])
    assert not hasattr(model.train_function.pulled_steps[True], "lower")  # not jitted
    assert int(model.optimizer.iterations) == updates
    assert max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-6


def test_micro_batches_window_of_an_interrupted_fit_does_not_leak():
    """A fit stopped 2 micro-batches into a window leaves nothing behind: the next
    fit equals a plain full-batch fit from the same (unchanged) weights."""
    data = toy_data(UPDATES * GLOBAL_BATCH, classes=8)
    reference, _, _ = _fit_micro("dp8", mode=None, batch_size=GLOBAL_BATCH, data=data)

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                raise RuntimeError("preempted")

    x, y = data
    with make_distribution("dp8").scope():
        model = mesh_mlp()
        model.compile(optimizer=_adam(), loss=sparse_ce())
        accumulate = GradientAccumulation(STEPS, dataset_yields="micro_batches")
        with pytest.raises(RuntimeError, match="preempted"):
            model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0,
                      callbacks=[accumulate, Interrupt()])
        assert int(model.optimizer.iterations) == 0
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0, callbacks=[accumulate])
    assert int(model.optimizer.iterations) == UPDATES
    assert max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-6


_ALL_REDUCE = re.compile(r"=\s*(\(.*?\)|\S+)\s+all-reduce(?:-start)?\(")


def _all_reduce_shapes(text):
    """The result shapes of every all-reduce in a compiled module, e.g. ['f32[]', 'f32[16,32]']."""
    shapes = []
    for line in text.splitlines():
        match = _ALL_REDUCE.search(line)
        if match:
            shapes += re.findall(r"\w+\[[\d,]*\]", match.group(1))
    return shapes


def _fitted_pulled_steps(model, x, y) -> dict:
    """`{apply: compiled}`: the two jitted steps of the fit `model` ran with pulled
    micro-batches, lowered on its own state, fresh accumulators and its first
    micro-batch, and compiled (in the active distribution's scope)."""
    function = model.train_function
    state = jax_compat.jax_state(model)
    data = jax_compat.distribute_data((x[:MICRO], y[:MICRO]))
    return {apply: function.pulled_steps[apply].lower(
                state, function.zero_accumulators(), data).compile()
            for apply in (False, True)}


def test_micro_batches_data_parallel_reduce_gradients_only_in_the_applying_step():
    x, y = toy_data(GLOBAL_BATCH, classes=8)
    with make_distribution("dp8").scope():
        model = mesh_mlp()
        model.compile(optimizer="adam", loss=sparse_ce(), metrics=["accuracy"])
        model.fit(x, y, batch_size=MICRO, verbose=0,
                  callbacks=[GradientAccumulation(STEPS, dataset_yields="micro_batches")])
        texts = {apply: compiled.as_text()
                 for apply, compiled in _fitted_pulled_steps(model, x, y).items()}
    weight_shapes = {f"f32[{','.join(map(str, w.shape))}]" for w in model.trainable_weights}
    accumulating, applying = (_all_reduce_shapes(texts[a]) for a in (False, True))
    # The accumulating step reduces no gradient: its only collective is the
    # metrics' scalar totals and counts (loss tracker, accuracy).
    assert not weight_shapes & set(accumulating), accumulating
    assert set(accumulating) <= {"f32[]"}, accumulating
    # The applying step reduces every weight's gradient (once).
    assert weight_shapes <= set(applying), applying
    for text in texts.values():
        assert count_opcode(text, "all-to-all") == 0
        assert count_opcode(text, "collective-permute") == 0
        assert count_opcode(text, "all-gather") == 0


def _total(analysis) -> int:
    """A `memory_analysis()`'s total, as `CompiledMemory.total_bytes` reads it."""
    return (analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
            + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)


def test_compiled_memory_of_micro_batches_is_the_applying_step_fit_jits():
    """`compiled_memory(model, micro, callbacks=[GradientAccumulation(k,
    dataset_yields="micro_batches")])` under `DataParallel(8)` holds what `fit`'s own
    jitted applying step holds, lowered on its arrays, and the accumulating steps no more
    (what the planned step holds against Keras' step: test_accumulation.py)."""
    x, y = toy_data(GLOBAL_BATCH, classes=8)
    with make_distribution("dp8").scope():
        model = mesh_mlp()
        model.compile(optimizer="adam", loss=sparse_ce())
        accumulate = GradientAccumulation(STEPS, dataset_yields="micro_batches")
        planned = ktm.compiled_memory(model, MICRO, callbacks=[accumulate])
        model.fit(x, y, batch_size=MICRO, verbose=0, callbacks=[accumulate])
        ran = {apply: compiled.memory_analysis()
               for apply, compiled in _fitted_pulled_steps(model, x, y).items()}
    assert planned.pulled and planned.total_bytes == _total(ran[True])
    assert _total(ran[False]) <= planned.total_bytes


def test_micro_batches_compose_with_pruning_like_global_batches():
    """Pruning's after_update runs after applying steps only: both modes train alike."""
    from keras_tpu_mem import Pruning
    from keras_tpu_mem.pruning.schedules import ConstantSparsity

    def pruning():
        return Pruning(ConstantSparsity(0.5, begin_step=2, frequency=1))

    micro, _, _ = _fit_micro("dp8", callbacks=[pruning()], metrics=())
    full, _, _ = _fit_micro("dp8", mode="global_batches", batch_size=GLOBAL_BATCH,
                            callbacks=[pruning()], metrics=())
    assert int(micro.optimizer.iterations) == UPDATES
    assert max_abs_diff(micro.get_weights(), full.get_weights()) <= 1e-5
    kernel = np.asarray(micro.layers[0].kernel.value)
    np.testing.assert_allclose(np.mean(kernel == 0), 0.5, atol=0.01)
