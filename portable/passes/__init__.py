"""Passes: Program -> Program transformations, by name.

    from portable.passes import PassManager, parse_pipeline
    program, reports = PassManager(parse_pipeline("canonicalize,dce"), verify_each=True).run(program)

Built-ins are registered by name and imported lazily; third-party passes register through the
`portable.passes` entry-point group (the entry point names a `Pass` subclass). See
docs/passes/README.md.
"""

from __future__ import annotations

from typing import Any

from .base import Pass, PassReport, PassResult
from .manager import PassManager
from .registry import registry
from .spec import build_pass, parse_pass, parse_pipeline

__all__ = [
    "Pass",
    "PassManager",
    "PassReport",
    "PassResult",
    "get_pass",
    "parse_pass",
    "parse_pipeline",
    "registry",
]


def get_pass(name: str, **options: Any) -> Pass:
    """An instance of the pass registered as `name` (RegistryError if unknown; PassError for an
    unknown option or a value of the wrong type)."""
    return build_pass(registry.get(name), options)
