"""Mask selection for `ktm.Pruning`: pure functions in `keras.ops`, one implementation
for every backend.

The same code runs inside the TensorFlow step (also under XLA and
MirroredStrategy) and inside a jitted JAX step: static shapes only, no Python
control flow on traced values, loops through `keras.ops.fori_loop`. Masks are
discrete, so the two backends give *identical* masks for the same weights and
target: every step below is either exact (bit patterns, counts, comparisons,
`top_k` of a few entries, max pooling) or one IEEE float32 operation per entry
(the division of AVG pooling). The one place the backends may round differently
is the float32 *sum* of AVG block pooling, whose reduction order is the
backend's: two pooled blocks within one ulp of the threshold could then be
ordered differently (MAX pooling and unstructured/N:M masks are exact).

Importing this module never imports TensorFlow or JAX: `apply_mask` asks the
running backend (`StepContext.masked`) only for a float mask, which
TensorFlow applies with its `multiply_no_nan` kernel.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_tpu_mem.backends.step import StepContext

ops = keras.ops

# Above +inf as an int32 bit pattern: count(bits >= this) is 0 for any array
# without NaN (magnitudes have none in a trained model).
_ABOVE_INF_BITS = 0x7F800001
# 31 halvings of [0, 0x7F800001) leave one bit pattern: the answer, exactly.
_BISECTION_PASSES = 31


def kth_largest(values, k):
    """The k-th largest entry of a non-negative float tensor, exactly, as float32.

    Bisection on the IEEE bit patterns (non-negative float32 values sort like
    their int32 bit patterns): 31 counting passes, no sort, no index buffer,
    static shapes (XLA- and `jax.jit`-friendly). Ties count with their
    multiplicity, as in a descending sort: with values `[3, 3, 1]`, k=2 gives 3.

    Args:
        values: A non-negative float tensor (any shape; cast to float32).
        k: An int scalar (Python or tensor) in `[1, values.size]`.

    Returns:
        A float32 scalar tensor: `sort(values.flatten())[::-1][k - 1]`.

    Example:

    ```python
    from keras_tpu_mem.pruning.masks import kth_largest
    kth_largest(keras.ops.abs(kernel), 10)   # the 10th largest magnitude
    ```
    """
    bits = _bitcast(ops.cast(values, "float32"), "int32")
    return _bitcast(_kth_largest_bits(bits, k), "float32")


def _bitcast(x, dtype):
    """`ops.view` of a 4-byte dtype as another, for any rank: Keras 3.12's TensorFlow
    `view` indexes the last dimension and fails on a scalar, so view it flat."""
    return ops.reshape(ops.view(ops.reshape(x, (-1,)), dtype), ops.shape(x))


def _kth_largest_bits(bits, k):
    """The k-th largest of int32 bit patterns of non-negative floats (see `kth_largest`)."""
    bits = ops.reshape(bits, (-1,))
    k = ops.cast(k, "int32")
    # Invariant: count(bits >= lo) >= k and count(bits >= hi) < k.
    lo = ops.convert_to_tensor(0, "int32")
    hi = ops.convert_to_tensor(_ABOVE_INF_BITS, "int32")

    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = ops.sum(ops.cast(ops.greater_equal(bits, mid), "int32")) >= k
        return ops.where(enough, mid, lo), ops.where(enough, hi, mid)

    lo, _ = ops.fori_loop(0, _BISECTION_PASSES, body, (lo, hi))
    return lo


def keep_count(size: int, sparsity):
    """How many of `size` entries tfmot's rule keeps: `max(round(size * (1 - s)), 1)`.

    Computed in float32 as tfmot does (`round` is half-to-even), clipped to
    `[1, size]`; an int32 scalar tensor.
    """
    sparsity = ops.cast(sparsity, "float32")
    kept = ops.round(ops.cast(size, "float32") * (ops.cast(1.0, "float32") - sparsity))
    k = ops.cast(ops.maximum(kept, ops.cast(1.0, "float32")), "int32")
    return ops.clip(k, 1, size)


def magnitude_mask(magnitudes, sparsity):
    """Keeps the largest `1 - sparsity` fraction of `magnitudes` (tfmot's rule).

    k = max(round(size * (1 - sparsity)), 1) entries are kept; the threshold is
    the k-th largest magnitude and every entry >= it is kept (ties kept, so a
    tie at the threshold can keep more than k), as in tfmot's `_update_mask`.
    Denormal magnitudes compare exactly (never flushed to zero), on every
    backend and device.

    Args:
        magnitudes: Non-negative float tensor (e.g. `abs(kernel)`), any shape.
        sparsity: Float scalar (Python or tensor) in [0, 1).

    Returns:
        `(mask, threshold)`: a bool tensor of `magnitudes`' shape and the
        float32 threshold.

    Example:

    ```python
    mask, threshold = magnitude_mask(keras.ops.abs(kernel), 0.8)  # keep 20%
    ```
    """
    bits = _bitcast(ops.cast(magnitudes, "float32"), "int32")
    size = int(np.prod(magnitudes.shape))
    threshold = _kth_largest_bits(bits, keep_count(size, sparsity))
    # Compared as bit patterns (the order of non-negative floats), not as
    # floats: TensorFlow's CPU kernels and TPUs flush denormals to zero in float
    # compares, which would keep every 0 tied with a denormal threshold on one
    # backend and not on another. Integers compare alike everywhere.
    return ops.greater_equal(bits, threshold), _bitcast(threshold, "float32")


def _block_counts(shape, block_size) -> np.ndarray:
    """Valid entries per aligned block of a rank-2 `shape` (partial edge blocks count less)."""
    height, width = shape
    bh, bw = block_size
    ph, pw = -height % bh, -width % bw
    counts = np.pad(np.ones((height, width), np.float32), [[0, ph], [0, pw]])
    return counts.reshape((height + ph) // bh, bh, (width + pw) // bw, bw).sum(axis=(1, 3))


def block_pool(magnitudes, block_size, pooling="AVG"):
    """Pools a rank-2 tensor over aligned `(bh, bw)` blocks.

    Blocks are aligned at index 0; a partial last block uses its valid entries
    only (AVG divides by their count; the zero padding cannot win a MAX of
    magnitudes).

    Args:
        magnitudes: Rank-2 non-negative float tensor.
        block_size: `(bh, bw)` ints.
        pooling: `"AVG"` or `"MAX"`.

    Returns:
        A `[ceil(h / bh), ceil(w / bw)]` tensor of `magnitudes`' dtype.
    """
    height, width = magnitudes.shape
    bh, bw = block_size
    ph, pw = -height % bh, -width % bw
    padded = ops.pad(magnitudes, [[0, ph], [0, pw]])
    blocks = ops.reshape(padded, ((height + ph) // bh, bh, (width + pw) // bw, bw))
    if pooling == "MAX":
        return ops.max(blocks, axis=(1, 3))
    counts = ops.convert_to_tensor(_block_counts((height, width), block_size),
                                   magnitudes.dtype)
    return ops.sum(blocks, axis=(1, 3)) / counts


def expand_blocks(block_values, block_size, shape):
    """Repeats each block's value over its `(bh, bw)` entries, cropped to `shape`."""
    bh, bw = block_size
    expanded = ops.repeat(ops.repeat(block_values, bh, axis=0), bw, axis=1)
    return expanded[: shape[0], : shape[1]]


def block_mask(weights, sparsity, block_size, pooling="AVG"):
    """Prunes whole `(bh, bw)` blocks of a rank-2 weight by pooled magnitude.

    Blocks are aligned at index 0; a partial last block is pooled over its valid
    entries. The blocks kept are those whose pooled magnitude is >= the k-th
    largest, k counted over blocks as `magnitude_mask` counts entries.

    Args:
        weights: Rank-2 float tensor.
        sparsity: Float scalar in [0, 1): the fraction of *blocks* pruned.
        block_size: `(bh, bw)` ints.
        pooling: `"AVG"` or `"MAX"`.

    Returns:
        `(mask, threshold)`: bool mask of `weights`' shape, float32 threshold on
        the pooled magnitudes.

    Example:

    ```python
    mask, _ = block_mask(kernel, 0.5, (4, 1), "MAX")   # half of the 4x1 blocks
    ```
    """
    magnitudes = ops.abs(ops.cast(weights, "float32"))
    pooled = block_pool(magnitudes, block_size, pooling)
    kept, threshold = magnitude_mask(pooled, sparsity)
    return expand_blocks(kept, block_size, tuple(weights.shape)), threshold


def m_by_n_mask(weights, m_by_n, axis):
    """N:M structured mask: in every aligned group of `n` consecutive entries
    along `axis`, the `m` smallest magnitudes are pruned (tfmot's
    `sparsity_m_by_n`).

    A partial last group keeps at most n - m entries (it is padded with zeros,
    which sort last). Ties keep the lower index, as tfmot's `top_k` (TensorFlow's
    and JAX's `top_k` both put the lower index first among equal values).

    Args:
        weights: Float tensor of rank >= 1.
        m_by_n: `(m, n)` ints, 0 < m < n.
        axis: The axis groups run along (the input-channel axis).

    Returns:
        A bool mask of `weights`' shape.

    Example:

    ```python
    mask = m_by_n_mask(dense.kernel, (2, 4), axis=0)   # 2:4 along the inputs
    ```
    """
    m, n = m_by_n
    magnitudes = ops.abs(ops.cast(weights, "float32"))
    rank = len(weights.shape)
    axis = axis % rank
    perm = [d for d in range(rank) if d != axis] + [axis]
    inverse = [int(i) for i in np.argsort(perm)]
    moved = ops.transpose(magnitudes, perm)
    length = weights.shape[axis]
    pad = -length % n
    padded = ops.pad(moved, [[0, 0]] * (rank - 1) + [[0, pad]])
    groups = ops.reshape(padded, (-1, n))
    _, keep = ops.top_k(groups, k=n - m)
    kept = ops.max(ops.one_hot(keep, n, dtype="int32"), axis=-2) > 0
    kept = ops.reshape(kept, tuple(padded.shape))[..., :length]
    return ops.transpose(kept, inverse)


def apply_mask(value, mask, ctx=None):
    """`value` with exact +0.0 where `mask` is off (False or 0), whatever it held.

    A bool mask selects (`where`), which XLA fuses into the optimizer's update.
    A float mask (the TensorFlow engine without XLA stores masks in the weight's
    dtype) is the step context's `masked`: TensorFlow multiplies with
    `multiply_no_nan`, about 3x faster there than its select kernel, and also
    exact +0.0 over inf/NaN; JAX selects with `where` for both. `ctx`: the step's
    context (`StepContext`) inside a step; None outside one.
    """
    if keras.backend.standardize_dtype(mask.dtype) == "bool":
        return ops.where(mask, value, ops.zeros((), value.dtype))
    return (ctx or StepContext.outside()).masked(value, mask)


def smallest_kept(value, mask, block_size=(1, 1), pooling="AVG"):
    """The magnitude threshold a mask amounts to: its smallest kept (pooled) magnitude.

    0.0 when the mask keeps nothing. Static shapes (a masked min, no gather).
    """
    magnitudes = ops.abs(ops.cast(value, "float32"))
    mask = ops.cast(mask, "bool")
    if tuple(block_size) != (1, 1):
        magnitudes = block_pool(magnitudes, block_size, pooling)
        mask = block_pool(ops.cast(mask, "float32"), block_size, "MAX") > 0
    inf = ops.convert_to_tensor(np.inf, "float32")
    smallest = ops.min(ops.where(mask, magnitudes, inf))
    return ops.where(ops.any(mask), smallest, ops.zeros((), "float32"))


__all__ = [
    "apply_mask",
    "block_mask",
    "block_pool",
    "expand_blocks",
    "keep_count",
    "kth_largest",
    "m_by_n_mask",
    "magnitude_mask",
    "smallest_kept",
]
