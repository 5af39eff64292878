"""Refusing, with a clear message, what only the TensorFlow backend offers.

`TPUStrategyWrapper` (tf.distribute) and TensorFlow's compiled-memory path have
no JAX counterpart behind them; they call `require_tensorflow_backend` first.
"""

from __future__ import annotations


def require_tensorflow_backend(what: str) -> None:
    """Raises a clear error when Keras runs on a backend other than TensorFlow.

    Args:
        what: What needs TensorFlow, for the message.

    Example:

    ```python
    require_tensorflow_backend("TPUStrategyWrapper")  # RuntimeError on JAX
    ```
    """
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            f"{what} needs the Keras TensorFlow backend (tf.distribute, TPUStrategy), "
            f"but Keras is running on {backend!r}. Set KERAS_BACKEND=tensorflow "
            "before importing keras."
        )


__all__ = ["require_tensorflow_backend"]
