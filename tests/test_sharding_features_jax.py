"""Every feature at once under `ShardedDataParallel()` (issue 21's floor), on digits:
Pruning + Distillation (a live teacher, laid out by the same distribution) +
MixedBFloat16 + GradientAccumulation train to the accuracy a plain fit reaches, each
kernel ends at its target sparsity, and the masks are split like their kernels.
Accuracy is a numpy forward pass of the float32 weights; sparsity is counted."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_tpu_mem.accumulation import GradientAccumulation
from keras_tpu_mem.distillation import Distillation
from keras_tpu_mem.engine import Engine
from keras_tpu_mem.precision import MixedBFloat16
from keras_tpu_mem.pruning import ConstantSparsity, Pruning
from keras_tpu_mem.sharding import ShardedDataParallel, sharded_dim

pytestmark = pytest.mark.slow  # two fits of tens of epochs on 8 host devices


def _mlp(hidden, seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(hidden, activation="relu", name="hidden"),
                              keras.layers.Dense(16, name="logits")])
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _accuracy(model, x, y):
    h = np.maximum(x @ np.asarray(model.layers[0].kernel) + np.asarray(model.layers[0].bias), 0)
    logits = h @ np.asarray(model.layers[1].kernel) + np.asarray(model.layers[1].bias)
    return float(np.mean(np.argmax(logits, 1) == y))


def test_pruning_distillation_bf16_and_accumulation_together(digits):
    (x, y), (xv, yv) = digits
    n = len(x) // 64 * 64
    x, y = x[:n], y[:n]
    distribution = ShardedDataParallel()
    with distribution.scope():
        teacher = _mlp(256, seed=1)
        teacher.fit(x, y, batch_size=64, epochs=10, verbose=0)
        student = _mlp(128, seed=2)
        pruning = Pruning(ConstantSparsity(0.5, begin_step=20, frequency=10))
        student.fit(x, y, batch_size=64, epochs=25, verbose=0, shuffle=False, callbacks=[
            pruning, Distillation(teacher, temperature=2.0, alpha=0.5), MixedBFloat16(),
            GradientAccumulation(2)])
    assert _accuracy(teacher, xv, yv) >= 0.9
    assert _accuracy(student, xv, yv) >= 0.85
    for layer in student.layers:
        zeros = float(np.mean(np.asarray(layer.kernel) == 0))
        assert abs(zeros - 0.5) <= 0.01, (layer.name, zeros)
        assert sharded_dim(layer.kernel) is not None, layer.name  # the state stays split
    masks = Engine.of(student).feature_state(pruning).masks
    for weight, mask in zip(pruning._weights, masks, strict=True):
        assert mask.sharding == weight.variable.value.sharding, weight.path
    assert sharded_dim(teacher.layers[0].kernel) is not None


def test_out_of_memory_under_data_parallel_recommends_splitting_the_state():
    """An OOM whose cure is sharding: the replicated state alone exceeds the budget,
    so the explanation's search ends at a ShardedDataParallel and says how to apply it."""
    import jax
    from helpers import compile_adam, issue_mlp

    from keras_tpu_mem.engine import EngineCallback
    from keras_tpu_mem.planning import StepOutOfMemoryError, compiled_memory, set_oom_device
    from keras_tpu_mem.sharding import reshard

    class InjectedOOM(EngineCallback):
        name = "injected_oom"
        armed = True

        def transform_loss(self, loss, ctx):
            if InjectedOOM.armed:
                InjectedOOM.armed = False  # the explanation's compiles trace it again
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory.")
            return loss

    data_parallel = keras.distribution.DataParallel()
    x = np.zeros((1024, 512), "float32")
    y = np.zeros((1024,), "int32")
    with data_parallel.scope():
        model = compile_adam(issue_mlp())
        replicated = compiled_memory(model, 1024, hlo_text=False)
        budget = int(0.5 * replicated.total_bytes)
        set_oom_device(f"{budget}B")
        try:
            with pytest.raises(StepOutOfMemoryError) as info:
                model.fit(x, y, batch_size=1024, epochs=1, verbose=0,
                          callbacks=[InjectedOOM()])
        finally:
            set_oom_device(None)
    message = str(info.value)
    rec = info.value.plan.recommendation
    assert rec is not None and rec.sharding is not None, message
    assert "ShardedDataParallel(shard=" in message and "ktm.reshard(model" in message
    distribution = rec.distribution()
    reshard(model, distribution)
    with distribution.scope():
        check = compiled_memory(model, 1024, callbacks=rec.callbacks(), hlo_text=False)
    assert check.total_bytes <= budget


def test_cached_teacher_logits_train_as_under_data_parallel():
    """Distillation from cached logits (no teacher in the step) under the state split
    over 8 devices gives DataParallel's student (same logits, same initial weights)."""
    from helpers import max_weight_diff, small_model, toy_data

    from keras_tpu_mem.distillation import cache_teacher_logits, prepare_student

    x, y = toy_data(classes=10)
    teacher = small_model(seed=3)
    cached = cache_teacher_logits(teacher, (x, y), batch_size=32)
    init = small_model().get_weights()

    def distil(distribution):
        with distribution.scope():
            student = small_model()
            student.set_weights(init)
            student.compile(optimizer=keras.optimizers.Adam(1e-2),
                            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            prepare_student(student, cached)
            student.fit(cached, epochs=1, verbose=0, shuffle=False,
                        callbacks=[Distillation(temperature=2.0, alpha=0.5)])
        return student

    reference = distil(keras.distribution.DataParallel())
    sharded = distil(ShardedDataParallel())
    assert int(sharded.optimizer.iterations) == 5
    assert max_weight_diff(sharded, reference) <= 1e-5
    assert sharded_dim(sharded.layers[0].kernel) is not None
