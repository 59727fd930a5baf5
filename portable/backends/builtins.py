"""The backend registry: the built-ins by name (imported lazily), plug-ins through the
`portable.backends` entry-point group; and building a backend from its name or target."""

from __future__ import annotations

from typing import TYPE_CHECKING

from portable.registry import Registry

if TYPE_CHECKING:
    from .base import Backend, Target

__all__ = ["backend_for", "get_backend", "registry"]

registry: Registry[type[Backend]] = Registry(
    "backend",
    "portable.backends",
    {
        "cpu": "portable.backends.cpu:CpuBackend",
        "xla": "portable.backends.xla:XlaBackend",
        "neuron": "portable.backends.neuron:NeuronBackend",
        "cuda": "portable.backends.cuda:CudaBackend",
        "onnx": "portable.backends.onnx:OnnxBackend",
    },
)


def get_backend(name: str, options: object | None = None) -> Backend:
    """An instance of the backend registered as `name` (RegistryError if unknown), built with
    its options object (e.g. `CudaOptions`, `NeuronOptions`) when one is given."""
    cls = registry.get(name)
    return cls() if options is None else cls(options)


def backend_for(target: Target, **given: object) -> Backend:
    """The backend of `target` built with the options its string carries (`cuda{aot=true}`) and
    `given` (command-line flags, for the option fields it has); BackendError for options it
    does not take."""
    cls = registry.get(target.backend)
    return get_backend(target.backend, cls.parse_options(target.options, **given))
