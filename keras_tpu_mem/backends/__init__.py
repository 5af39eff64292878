"""The backend seam: the one place that knows which Keras backend runs.

Keras keeps each backend under `keras/src/backend/<name>/` and writes layers,
callbacks and optimizers once against `keras.ops`. This package does the same:
what differs between TensorFlow and JAX lives in `backends/tensorflow/` and
`backends/jax/` (plus `_compat/` for other projects' private names), one module
per concern with the same functions in both; everything else — the features,
the monitors, the planner, the report, the strategy wrapper's front — is
written once and asks `current()` for the running backend's half:

```python
from keras_tpu_mem import backends

backend = backends.current()          # raises naming TensorFlow and JAX elsewhere
backend.devices.memory_stats(device)  # keras_tpu_mem/backends/<name>/devices.py
```

`base.Backend` lists the concerns and what each module offers. A backend's
modules import only `_compat`, `_utils` and the framework: never the neutral
modules above them (which import this package), so the seam adds no import
cycle.
"""

from __future__ import annotations

from keras_tpu_mem.backends.base import SUPPORTED, Backend

_BACKENDS: dict[str, Backend] = {}


def get(name: str) -> Backend:
    """The adapter of the backend called `name` ("tensorflow" or "jax")."""
    if name not in SUPPORTED:
        raise ValueError(f"`name` must be one of {', '.join(map(repr, SUPPORTED))}, "
                         f"got {name!r}.")
    backend = _BACKENDS.get(name)
    if backend is None:
        backend = _BACKENDS[name] = Backend(name)
    return backend


def current(what: str = "keras_tpu_mem") -> Backend:
    """The adapter of the Keras backend this process runs.

    Args:
        what: What needs it, for the error where Keras runs another backend.

    Raises:
        RuntimeError: Keras runs a backend other than TensorFlow or JAX.
    """
    import keras

    name = keras.backend.backend()
    if name not in SUPPORTED:
        raise RuntimeError(
            f"{what} needs the Keras TensorFlow or JAX backend, but Keras is running on "
            f"{name!r}. Set KERAS_BACKEND=tensorflow or KERAS_BACKEND=jax before "
            "importing keras.")
    return get(name)


def running() -> Backend | None:
    """The adapter of the Keras backend this process runs, or None where Keras runs
    a backend without one (then only what needs no backend works, e.g. arrays)."""
    import keras

    name = keras.backend.backend()
    return get(name) if name in SUPPORTED else None


__all__ = ["SUPPORTED", "Backend", "current", "get", "running"]
