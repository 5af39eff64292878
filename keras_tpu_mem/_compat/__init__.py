"""The one place where keras_tpu_mem reaches into Keras, TensorFlow and JAX internals.

Everything here is a private API of another project: it can move or vanish in
any release. Each accessor names the versions that have it, and
`tests/test_compat*.py` call every one by name, so a Keras or framework
upgrade that removes one fails there first, with the accessor's name, instead
of somewhere inside a training run.

* `keras_tpu_mem._compat.keras`: Keras internals, any backend.
* `keras_tpu_mem._compat.tensorflow`: TensorFlow and Keras' TensorFlow trainer.
* `keras_tpu_mem._compat.jax`: JAX and Keras' JAX trainer.
* `keras_tpu_mem._compat.profiler`: the profiler's converters (xprof, TensorFlow).

Where a public API does the same job (`keras.tree`,
`keras.utils.unpack_x_y_sample_weight`, `keras.dtype_policies.DTypePolicyMap`,
`keras.backend.standardize_dtype`, `keras.ops.is_tensor`), the package uses
the public API and nothing is added here.
"""
