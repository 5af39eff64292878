"""TensorFlow's half of the backend seam (see `keras_tpu_mem.backends`)."""
