"""`Distillation`: knowledge distillation as a callback on the student's own `fit`.

Two ways to get the teacher's logits into the student's train step:

* **live teacher** – `Distillation(teacher)`: the frozen teacher runs in
  inference mode inside the compiled step, on every replica (and on every
  micro-batch under `GradientAccumulation`);
* **cached logits** – `cache_teacher_logits(teacher, dataset)` runs the teacher
  once and returns a dataset whose elements carry its logits next to each
  example (optionally saved to disk, `load_teacher_logits(path)` reads them
  back); `Distillation()` (no teacher) reads them from the batch. The teacher is
  then not part of the training program at all: its weights take no
  accelerator memory.

Element structure of a cached dataset: `(data, logits)`, where `data` is the
original element unchanged (`x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`)
and `logits` is a dict with one of two layouts:

* `{"ktm_teacher_logits": [..., classes]}` (all classes), or
* `{"ktm_teacher_top_k_values": [..., k], "ktm_teacher_top_k_indices": [..., k]}`.

The logits travel inside each element, so `shuffle`, `batch`, `unbatch`,
`repeat`, `cache` and `tpu.distribute(...)` keep them with their examples.

Modules, one job each: `callback` (`Distillation`), `loss` (the KL term),
`checks` (arguments and models), `placement` (where the teacher's variables
live), `elements` (the element structure above), `cache` (the cache API),
`arrays` (the cache of arrays), `teacher_logits` (`TeacherLogits`, what it
returns), `npz` (its file), `directory` (the cache of a tf.data.Dataset),
`structure` (nests of arrays). What tf.distribute does is
`devices.placement`'s, what tf.data does `keras_tpu_mem.tf_data`'s.
"""

from keras_tpu_mem.distillation.cache import (
    cache_teacher_logits,
    load_teacher_logits,
    prepare_student,
    strip_teacher_logits,
)
from keras_tpu_mem.distillation.callback import Distillation
from keras_tpu_mem.distillation.elements import LOGITS_KEY, TOP_K_INDICES_KEY, TOP_K_VALUES_KEY
from keras_tpu_mem.distillation.loss import distillation_kl
from keras_tpu_mem.distillation.teacher_logits import TeacherLogits

__all__ = [
    "LOGITS_KEY",
    "TOP_K_INDICES_KEY",
    "TOP_K_VALUES_KEY",
    "Distillation",
    "TeacherLogits",
    "cache_teacher_logits",
    "distillation_kl",
    "load_teacher_logits",
    "prepare_student",
    "strip_teacher_logits",
]
