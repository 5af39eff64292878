"""Pruning masks against an independent numpy reference, on the active backend.

The same test bodies run on TensorFlow and on JAX (conftest's BOTH_BACKENDS):
both backends are compared with the
same numpy reference on the same kernels, so their masks are identical to each
other through it, without one process needing both frameworks. Masks are
discrete: every comparison is exact.

The numpy reference is written from tfmot's rules, not from our code: k =
max(round(size * (1 - s)), 1) in float32 (round half to even), the threshold is
the k-th largest magnitude of a descending sort, every entry >= it is kept;
blocks are pooled over their valid entries; N:M keeps the n - m largest of every
aligned group, the lower index first among equal magnitudes.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

from keras_tpu_mem.pruning.masks import (
    apply_mask,
    block_mask,
    kth_largest,
    m_by_n_mask,
    magnitude_mask,
    smallest_kept,
)

BACKEND = keras.backend.backend()

# ------------------------------------------------------------ reference


def np_keep_count(size, sparsity):
    kept = np.round(np.float32(size) * (np.float32(1.0) - np.float32(sparsity)))
    return int(min(max(kept, 1), size))


def np_kth_largest(values, k):
    return np.sort(np.asarray(values, np.float32), axis=None)[::-1][k - 1]


def np_magnitude_mask(magnitudes, sparsity):
    magnitudes = np.asarray(magnitudes, np.float32)
    threshold = np_kth_largest(magnitudes, np_keep_count(magnitudes.size, sparsity))
    return magnitudes >= threshold, threshold


def np_block_pool(magnitudes, block, pooling):
    (h, w), (bh, bw) = magnitudes.shape, block
    nh, nw = -(-h // bh), -(-w // bw)
    pooled = np.zeros((nh, nw), np.float32)
    for i in range(nh):
        for j in range(nw):
            part = magnitudes[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw]
            pooled[i, j] = part.max() if pooling == "MAX" else (
                np.float32(part.sum(dtype=np.float32)) / np.float32(part.size))
    return pooled


def np_block_mask(weights, sparsity, block, pooling):
    pooled = np_block_pool(np.abs(weights.astype(np.float32)), block, pooling)
    keep, threshold = np_magnitude_mask(pooled, sparsity)
    expanded = np.kron(keep, np.ones(block, bool))[:weights.shape[0], :weights.shape[1]]
    return expanded, threshold


def np_m_by_n_mask(weights, m_by_n, axis):
    m, n = m_by_n
    moved = np.moveaxis(np.abs(weights.astype(np.float32)), axis, -1)
    mask = np.zeros(moved.shape, bool)
    for start in range(0, moved.shape[-1], n):
        group = moved[..., start:start + n]
        # Rank in a descending order, the lower index first among ties.
        ranks = np.argsort(np.argsort(-group, axis=-1, kind="stable"), axis=-1, kind="stable")
        mask[..., start:start + n] = ranks < (n - m)
    return np.moveaxis(mask, -1, axis)


# --------------------------------------------------------------- kernels


def _tricky(shape, seed):
    """Random normal weights with zeros, denormals, huge values and exact ties."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    flat = w.reshape(-1)
    size = flat.size
    flat[: size // 10] = 0.0  # already pruned entries
    flat[size // 10: size // 10 + 3] = np.float32(1e-40)  # denormals
    flat[size // 10 + 3] = np.float32(3e38)
    flat[size // 5: size // 5 + size // 8] = -flat[size // 2]  # a run of equal magnitudes
    return rng.permutation(flat).reshape(shape)


UNSTRUCTURED = [
    ((37, 29), 0.0), ((37, 29), 0.3), ((37, 29), 0.5), ((37, 29), 0.8), ((37, 29), 0.99),
    ((3, 3, 8, 16), 0.7), ((10,), 0.25), ((6,), 0.25), ((1000,), 0.9), ((64, 32), 0.6),
]
BLOCKS = [
    ((8, 6), (2, 3), "AVG", 0.5), ((9, 7), (2, 2), "AVG", 0.5), ((9, 7), (4, 3), "MAX", 0.5),
    ((5, 16), (1, 4), "MAX", 0.4), ((64, 32), (4, 1), "MAX", 0.75), ((48, 40), (1, 8), "AVG", 0.6),
]
M_BY_N = [
    ((16, 6), (2, 4), 0), ((3, 3, 8, 5), (2, 4), 2), ((3, 8, 12), (2, 4), 1), ((10, 3), (2, 4), 0),
    ((64, 10), (1, 4), 0), ((24, 7), (4, 8), 0), ((16, 5), (2, 4), -2),
]


def _compile(fn):
    """`fn` compiled as the training step compiles it on this backend."""
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn, jit_compile=True)


MODES = ["eager", "compiled"]


def _maybe_compiled(fn, mode):
    return fn if mode == "eager" else _compile(fn)


def _np(x):
    return keras.ops.convert_to_numpy(x)


# ----------------------------------------------------------------- tests


def test_kth_largest_is_exact_with_ties_zeros_and_denormals():
    values = np.abs(_tricky((1001,), 0))
    fn = _compile(lambda v, k: kth_largest(v, k))
    for k in (1, 2, 3, 9, 10, 100, 500, 800, 900, 901, 950, 1000, 1001):
        expected = np_kth_largest(values, k)
        got = _np(fn(values, np.int32(k)))
        assert got.dtype == np.float32
        assert got.view(np.int32) == expected.view(np.int32), k


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape, sparsity", UNSTRUCTURED)
def test_magnitude_mask_equals_numpy(shape, sparsity, mode):
    weights = _tricky(shape, 1)
    magnitudes = np.abs(weights)
    fn = _maybe_compiled(lambda m, s: magnitude_mask(m, s), mode)
    mask, threshold = fn(magnitudes, np.float32(sparsity))
    expected, expected_threshold = np_magnitude_mask(magnitudes, sparsity)
    assert _np(threshold).view(np.int32) == expected_threshold.view(np.int32)
    np.testing.assert_array_equal(_np(mask), expected)
    assert _np(mask).sum() >= np_keep_count(magnitudes.size, sparsity)  # ties kept


def test_keep_count_rounds_half_to_even_like_tfmot():
    # 10 * 0.75 = 7.5 -> 8; 6 * 0.75 = 4.5 -> 4 (float32, half to even).
    ones = np.ones
    assert _np(magnitude_mask(ones(10, np.float32) * np.arange(10), 0.25)[0]).sum() == 8
    assert _np(magnitude_mask(ones(6, np.float32) * np.arange(6), 0.25)[0]).sum() == 4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape, block, pooling, sparsity", BLOCKS)
def test_block_mask_equals_numpy(shape, block, pooling, sparsity, mode):
    weights = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    bh, bw = block
    # Two blocks with the same contents: equal pooled magnitudes, both kept or not.
    weights[bh:2 * bh, :bw] = weights[:bh, :bw]
    fn = _maybe_compiled(lambda w, s: block_mask(w, s, block, pooling), mode)
    mask, threshold = fn(weights, np.float32(sparsity))
    expected, expected_threshold = np_block_mask(weights, sparsity, block, pooling)
    np.testing.assert_array_equal(_np(mask), expected)
    assert _np(threshold).view(np.int32) == expected_threshold.view(np.int32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape, m_by_n, axis", M_BY_N)
def test_m_by_n_mask_equals_numpy(shape, m_by_n, axis, mode):
    weights = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    weights.reshape(-1)[::7] = 0.5  # ties inside groups: the lower index is kept
    weights.reshape(-1)[::11] = 0.0
    fn = _maybe_compiled(lambda w: m_by_n_mask(w, m_by_n, axis), mode)
    np.testing.assert_array_equal(_np(fn(weights)), np_m_by_n_mask(weights, m_by_n, axis))


@pytest.mark.parametrize("shape, axis", [((16, 6), 0), ((3, 3, 8, 5), 2), ((12, 9), 0)])
def test_two_by_four_leaves_two_zeros_in_every_group_of_four(shape, axis):
    weights = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    pruned = _np(apply_mask(weights, m_by_n_mask(weights, (2, 4), axis)))
    moved = np.moveaxis(pruned, axis, -1)
    for start in range(0, moved.shape[-1] - moved.shape[-1] % 4, 4):
        assert np.all(np.sum(moved[..., start:start + 4] == 0, axis=-1) >= 2)


@pytest.mark.parametrize("mask_dtype", ["bool", "float32"])
def test_apply_mask_writes_exact_zeros_over_non_finite_values(mask_dtype):
    value = np.array([np.inf, -np.inf, np.nan, -2.0, 3.0], np.float32)
    mask = np.array([0, 0, 0, 0, 1]).astype(mask_dtype)
    out = _np(_compile(apply_mask)(value, mask))
    np.testing.assert_array_equal(out, [0, 0, 0, 0, 3])
    assert not np.signbit(out[:4]).any()  # +0.0, not -0.0


def test_smallest_kept_is_the_threshold():
    weights = _tricky((37, 29), 5)
    mask, threshold = magnitude_mask(np.abs(weights), 0.6)
    assert _np(smallest_kept(weights, mask)) == _np(threshold)
    blocks, block_threshold = block_mask(weights, 0.5, (2, 2), "MAX")
    assert _np(smallest_kept(weights, blocks, (2, 2), "MAX")) == _np(block_threshold)
    assert _np(smallest_kept(weights, np.zeros((37, 29), bool))) == 0.0


def test_bfloat16_weights_give_the_float32_mask_of_their_values():
    weights = keras.ops.cast(_tricky((32, 16), 6), "bfloat16")
    as_float = _np(keras.ops.cast(weights, "float32"))
    expected, _ = np_magnitude_mask(np.abs(as_float), 0.5)
    np.testing.assert_array_equal(_np(magnitude_mask(keras.ops.abs(weights), 0.5)[0]),
                                  expected)
    np.testing.assert_array_equal(_np(m_by_n_mask(weights, (2, 4), 0)),
                                  np_m_by_n_mask(as_float, (2, 4), 0))


# ------------------------------------------- TensorFlow only (also under XLA)
# Marked `tensorflow_only` (deselected on JAX): they call the masks on tf tensors
# inside tf.function; TensorFlow is imported inside each test so that importing
# this module on JAX never imports it.


@pytest.mark.tensorflow_only("the masks on tf tensors, under tf.function")
def test_kth_largest_exact():
    import tensorflow as tf

    rng = np.random.default_rng(0)
    values = np.abs(rng.standard_normal(1001)).astype("float32")
    values[:50] = 0.0  # pruned entries
    values[50:60] = 1e-40  # denormals
    values[60] = 3e38
    values[61:70] = values[100]  # ties
    ordered = np.sort(values)[::-1]
    fn = tf.function(kth_largest, jit_compile=True)
    for k in (1, 2, 9, 10, 500, 940, 941, 950, 951, 1001):
        assert float(fn(tf.constant(values), tf.constant(k))) == ordered[k - 1], k


@pytest.mark.tensorflow_only("the masks on tf tensors, under tf.function")
@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.8, 0.99])
def test_magnitude_mask_matches_numpy(sparsity):
    import tensorflow as tf

    weights = np.random.default_rng(1).standard_normal((37, 29)).astype("float32")
    magnitudes = np.abs(weights)
    k = max(int(np.round(magnitudes.size * (1 - np.float32(sparsity)))), 1)
    threshold = np.sort(magnitudes, axis=None)[::-1][k - 1]
    mask, got = magnitude_mask(tf.constant(magnitudes), tf.constant(sparsity, tf.float32))
    assert float(got) == threshold
    np.testing.assert_array_equal(mask.numpy(), magnitudes >= threshold)
    assert int(mask.numpy().sum()) == k


@pytest.mark.tensorflow_only("the masks on tf tensors, under tf.function")
@pytest.mark.parametrize("shape, block, pooling", [
    ((8, 6), (2, 3), "AVG"), ((9, 7), (2, 2), "AVG"), ((9, 7), (4, 3), "MAX"),
    ((5, 16), (1, 4), "MAX"),
])
def test_block_mask_matches_numpy(shape, block, pooling):
    import tensorflow as tf

    weights = np.random.default_rng(2).standard_normal(shape).astype("float32")
    bh, bw = block
    nh, nw = -(-shape[0] // bh), -(-shape[1] // bw)
    pooled = np.zeros((nh, nw), np.float64)
    for i in range(nh):
        for j in range(nw):
            part = np.abs(weights[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw])
            pooled[i, j] = part.max() if pooling == "MAX" else part.mean()
    k = max(int(np.round(pooled.size * 0.5)), 1)
    keep_blocks = pooled >= np.sort(pooled, axis=None)[::-1][k - 1]
    expected = np.kron(keep_blocks, np.ones(block, bool))[:shape[0], :shape[1]]
    mask, _ = block_mask(tf.constant(weights), tf.constant(0.5), block, pooling)
    np.testing.assert_array_equal(mask.numpy(), expected)


@pytest.mark.tensorflow_only("the masks on tf tensors, under tf.function")
@pytest.mark.parametrize("shape, axis", [((16, 6), 0), ((3, 3, 8, 5), 2), ((3, 8, 12), 1),
                                         ((10, 3), 0)])
def test_m_by_n_mask_groups(shape, axis):
    import tensorflow as tf

    weights = np.random.default_rng(3).standard_normal(shape).astype("float32")
    mask = m_by_n_mask(tf.constant(weights), (2, 4), axis).numpy()
    moved_w = np.moveaxis(np.abs(weights), axis, -1)
    moved_m = np.moveaxis(mask, axis, -1)
    length = shape[axis]
    for start in range(0, length, 4):
        group_w = moved_w[..., start:start + 4]
        group_m = moved_m[..., start:start + 4]
        keep = min(2, group_w.shape[-1])
        assert np.all(group_m.sum(-1) == keep)
        # The kept ones are the largest of their group.
        ranks = np.argsort(np.argsort(-group_w, axis=-1, kind="stable"), axis=-1)
        np.testing.assert_array_equal(group_m, ranks < keep)


@pytest.mark.tensorflow_only("the masks on tf tensors, under tf.function")
@pytest.mark.parametrize("mask_dtype", ["bool", "float32"])
def test_masking_writes_exact_zeros_over_non_finite_values(mask_dtype):
    import tensorflow as tf

    value = tf.constant([np.inf, np.nan, -np.inf, -3.0, np.nan, 2.0])
    mask = tf.cast(tf.constant([False, False, False, False, True, True]), mask_dtype)
    out = apply_mask(value, mask).numpy()
    np.testing.assert_array_equal(out[:4], [0.0, 0.0, 0.0, 0.0])
    assert not np.signbit(out[:4]).any()  # +0.0, not -0.0
    assert np.isnan(out[4]) and out[5] == 2.0
