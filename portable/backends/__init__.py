"""Backends: lower a portable Program for a target and run it.

Built-ins are registered by name and imported lazily; third-party backends register through the
`portable.backends` entry-point group (the entry point names a `Backend` subclass).
"""

from __future__ import annotations

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

from .builtins import backend_for, get_backend, registry  # noqa: E402
