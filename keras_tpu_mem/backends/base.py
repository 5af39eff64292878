"""The adapter's contract: which concerns a backend serves, and how they load.

A `Backend` is a name and a set of concern modules,
`keras_tpu_mem/backends/<name>/<concern>.py`, loaded on first use
(`backend.devices`, `backend.summary`, ...), so that asking for device memory
never imports the training step. Both backends offer the same functions in a
concern's module: the contract is that concern's protocol in
`keras_tpu_mem.backends.contracts` (`CONCERNS`; checked by
`tests/test_backends_contracts.py`). A concern one backend does not have
(`contracts.ONLY_ON`) raises `NotImplementedError` naming the backend and the concern.
"""

from __future__ import annotations

import importlib
import importlib.util

#: The Keras backends that have a training engine and an adapter.
SUPPORTED = ("tensorflow", "jax")


class Backend:
    """One backend's half of the package, concern by concern.

    Attributes:
        name: Keras' name of the backend (`keras.backend.backend()`).
        label: How messages name it ("TensorFlow", "JAX").
    """

    def __init__(self, name: str):
        self.name = name
        self.label = {"tensorflow": "TensorFlow", "jax": "JAX"}[name]

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    def has(self, concern: str) -> bool:
        """Whether this backend serves `concern` (has the module
        `backends/<name>/<concern>.py`): how a caller asks for a concern that only
        one backend needs, instead of the other backend carrying a stub."""
        return importlib.util.find_spec(f"{__package__}.{self.name}.{concern}") is not None

    def compiles_for_tpu(self) -> bool:
        """Whether this backend compiles a TPU slice's step in-process (JAX, through
        libtpu's compile-only devices: `tpu_topology`); TensorFlow plans its models'
        JAX lowering in a subprocess instead."""
        return self.has("tpu_topology")

    def shards_state(self) -> bool:
        """Whether this backend lays model state out over devices: `keras.distribution`
        shards variables only on JAX (on TensorFlow, `tf.distribute` mirrors them, and
        the `sharding` concern refuses each request, naming JAX)."""
        return self.name == "jax"

    def __getattr__(self, concern: str):
        if concern.startswith("_"):
            raise AttributeError(concern)
        module_name = f"{__package__}.{self.name}.{concern}"
        if importlib.util.find_spec(module_name) is None:
            raise NotImplementedError(
                f"keras_tpu_mem has no {concern!r} for the Keras {self.label} backend.")
        module = importlib.import_module(module_name)
        self.__dict__[concern] = module  # later lookups skip __getattr__
        return module
