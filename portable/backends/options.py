"""Backend options from a target string, in the grammar of pass options.

    cuda{aot=true}                 CudaOptions(aot=True)
    neuron:trn3{fp64=error}        NeuronOptions(fp64="error")

The text between the braces is read exactly as a pass's options are (`portable.passes.spec`:
`key=value` separated by commas, double quotes around values with `,{}="` or spaces, `none` for
None), against the fields of the backend's `options_type`, a frozen dataclass whose fields have
the option types of passes (bool, int, float, str, or `T | None`). One grammar for both: what
`--pass` accepts and what `--target` accepts are written and quoted the same way.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from portable.errors import BackendError, PassError
from portable.registry import Registry

if TYPE_CHECKING:
    from .base import Backend

__all__ = ["parse_options"]


def parse_options(backend: type[Backend], text: str, given: dict[str, Any]) -> Any:
    """`backend.options_type` from `text` (the target's `{...}`) and `given` (values of command
    line flags, applied where the options have that field); None when the backend has no
    options type and nothing was asked of it, or when neither text nor given fields apply."""
    cls = backend.options_type
    if cls is None:
        if text.strip():
            raise BackendError(
                f"backend {backend.name} takes no options (got {{{text}}})",
                fix=f"write the target without braces: {backend.name}",
            )
        return None
    fields = {f.name for f in dataclasses.fields(cls)}
    values = _parse(backend.name, cls, text) if text.strip() else {}
    # flags set what the text left at its default (`cuda{aot=false}` with --aot: aot)
    values.update({k: v for k, v in given.items() if k in fields and k not in values})
    return cls(**values) if values else None


def fields_of(backend: type[Backend]) -> frozenset[str]:
    """The option names a backend takes (none without an options type)."""
    cls = backend.options_type
    return frozenset(f.name for f in dataclasses.fields(cls)) if cls is not None else frozenset()


def _parse(name: str, cls: type, text: str) -> dict[str, Any]:
    """The options `text` sets to other than their defaults, converted by the pass-option grammar
    (its messages, about a backend instead of a pass)."""
    from portable.passes.spec import parse_pass

    # the grammar reads a pass class: the options class under the backend's name
    reader = type(cls.__name__, (cls,), {"name": name, "__module__": cls.__module__})
    registry: Registry[Any] = Registry("backend", "", {})
    registry.register(name, reader)
    try:
        parsed = parse_pass(f"{name}{{{text}}}", registry)
    except PassError as exc:
        raise BackendError(_about_backend(exc.what, name), fix=exc.fix) from None
    return {
        f.name: getattr(parsed, f.name)
        for f in dataclasses.fields(cls)
        if getattr(parsed, f.name) != f.default
    }


def _about_backend(what: str, name: str) -> str:
    return what.replace(f"of pass {name!r}", f"of backend {name!r}").replace(
        f"pass {name!r} has no option", f"backend {name!r} has no option"
    )
