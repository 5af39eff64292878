"""Distillation (keras_tpu_mem.distillation.callback) in the JAX engine.

References: the KL term in float64 numpy, the live teacher's training.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from test_distillation_loss_jax import np64_kl

from keras_tpu_mem.distillation import cache_teacher_logits, prepare_student


# ------------------------------------------------- the JAX engine (issue 15 B)
def _fit_models(distribution, seed):
    from helpers import scope

    keras.utils.set_random_seed(seed)
    with scope(distribution):
        student = keras.Sequential([keras.Input((16,)),
                                    keras.layers.Dense(32, activation="relu", name="dense_s"),
                                    keras.layers.Dense(8, name="dense_s_out")])
        teacher = keras.Sequential([keras.Input((16,)),
                                    keras.layers.Dense(64, activation="relu", name="dense_t"),
                                    keras.layers.Dense(8, name="dense_t_out")])
        student.compile(optimizer=keras.optimizers.SGD(0.1),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return student, teacher


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX engine")
@pytest.mark.parametrize("case", ["dp8", "mp2x4"])
def test_jax_alpha_one_logged_loss_is_the_float64_kl(case):
    from helpers import make_distribution, scope, toy_data

    from keras_tpu_mem import Distillation

    distribution = make_distribution(case)
    student, teacher = _fit_models(distribution, seed=3)
    x, y = toy_data(32, classes=8)
    s_logits = np.asarray(student.predict(x, batch_size=32, verbose=0), np.float64)
    t_logits = np.asarray(teacher.predict(x, batch_size=32, verbose=0), np.float64)
    temperature = 3.0
    expected = temperature ** 2 * np.mean(np64_kl(s_logits, t_logits, temperature))
    with scope(distribution):
        history = student.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False,
                              callbacks=[Distillation(teacher, temperature=temperature,
                                                      alpha=1.0)])
    assert history.history["loss"][0] == pytest.approx(expected, rel=1e-4)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="the JAX engine")
def test_jax_cached_logits_give_the_live_teacher_weights():
    from helpers import make_distribution, max_abs_diff, scope, toy_data

    from keras_tpu_mem import Distillation

    distribution = make_distribution("dp8")
    x, y = toy_data(128, classes=8)
    weights = []
    for cached in (False, True):
        student, teacher = _fit_models(distribution, seed=5)
        with scope(distribution):
            if cached:
                data = cache_teacher_logits(teacher, (x, y), batch_size=32)
                # Keras' JAX fit builds the loss from the raw first batch before any
                # callback runs: the documented preparation step.
                prepare_student(student, data)
                student.fit(data, epochs=2, verbose=0, shuffle=False,
                            callbacks=[Distillation(None, temperature=2.0, alpha=0.5)])
            else:
                student.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False,
                            callbacks=[Distillation(teacher, temperature=2.0, alpha=0.5)])
        weights.append([np.asarray(w) for w in student.get_weights()])
    assert max_abs_diff(weights[0], weights[1]) < 1e-5
    assert max_abs_diff(weights[0], [np.asarray(w) for w in _fit_models(None, 5)[0]
                                     .get_weights()]) > 1e-3  # it trained
