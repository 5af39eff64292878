"""The element structure of a cached dataset: `(data, logits)`.

`data` is the original element unchanged (`x`, `(x,)`, `(x, y)` or
`(x, y, sample_weight)`) and `logits` a dict with one of two layouts:

* `{LOGITS_KEY: [..., classes]}` (all classes), or
* `{TOP_K_VALUES_KEY: [..., k], TOP_K_INDICES_KEY: [..., k]}`.

`Distillation.split_extras` recognises such elements in the student's batches;
the caches (`cache_teacher_logits`, `load_teacher_logits`, `TeacherLogits`)
make them.
"""

from __future__ import annotations

LOGITS_KEY = "ktm_teacher_logits"
TOP_K_VALUES_KEY = "ktm_teacher_top_k_values"
TOP_K_INDICES_KEY = "ktm_teacher_top_k_indices"
KEYS = frozenset((LOGITS_KEY, TOP_K_VALUES_KEY, TOP_K_INDICES_KEY))


def is_cached_element(data) -> bool:
    """Whether `data` (an element, or a tf.data element spec) is `(data, logits)`."""
    return (
        isinstance(data, tuple)
        and len(data) == 2
        and isinstance(data[1], dict)
        and bool(data[1])
        and set(data[1]) <= KEYS
    )


def teacher_arrays(logits=None, *, top_k_values=None, top_k_indices=None):
    """The element's `logits` dict: of all `logits`, or of the teacher's top k."""
    if logits is not None:
        return {LOGITS_KEY: logits}
    return {TOP_K_VALUES_KEY: top_k_values, TOP_K_INDICES_KEY: top_k_indices}


__all__ = ["KEYS", "LOGITS_KEY", "TOP_K_INDICES_KEY", "TOP_K_VALUES_KEY", "is_cached_element",
           "teacher_arrays"]
