"""Backends: lower a portable Program for a target and run it.

Built-ins are registered by name and imported lazily; third-party backends register through the
`portable.backends` entry-point group (the entry point names a `Backend` subclass).
"""

from __future__ import annotations

from portable.registry import Registry

from .base import (
    Backend,
    Capabilities,
    CheckedProgram,
    CompileReport,
    CompilerMissingError,
    Finding,
    Lowered,
    Target,
    Toolchain,
    Written,
)

__all__ = [
    "Backend",
    "Capabilities",
    "CheckedProgram",
    "CompileReport",
    "Finding",
    "Lowered",
    "Target",
    "Toolchain",
    "CompilerMissingError",
    "Written",
    "backend_for",
    "get_backend",
    "registry",
]

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
