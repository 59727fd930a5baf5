"""`portable backends`, `portable passes`, `portable ops`: what this installation provides.

Each prints a table, or with `--json` one JSON list of objects (the fields below). A built-in
backend whose optional packages are missing is listed with them (`missing`) and the
`pip install` that adds them (`install`); a backend or pass plug-in that fails to load is listed
with its `error`. Neither stops the listing.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import PortableError
from .table import format_table

if TYPE_CHECKING:
    from ..backends import Backend, Capabilities

__all__ = ["add_parsers", "backends", "ops", "passes"]

Row = dict[str, Any]


def backends() -> list[Row]:
    """Per backend: name, program_kinds, variants, ops (count), writes_artifacts,
    can_execute_here, reason (why not, or null), missing (optional packages not installed) and
    install (the `pip install` that adds them, or null). A backend whose capabilities cannot be
    known without the missing packages has null program_kinds, variants, ops, writes_artifacts;
    a plug-in that fails to load is `{name, error, can_execute_here: false, reason}`."""
    from ..backends import get_backend, registry

    rows: list[Row] = []
    for name in registry.names():
        try:
            rows.append(_backend_row(name, get_backend(name)))
        except PortableError as exc:  # a plug-in that cannot be loaded or asked
            rows.append(
                {"name": name, "error": str(exc), "can_execute_here": False, "reason": exc.what}
            )
    return rows


def _backend_row(name: str, backend: Backend) -> Row:
    missing = backend.missing()
    ok, why = backend.can_execute_here()
    caps = backend.capabilities()
    capabilities = _capability_fields(caps)
    if missing and not caps.listed_without_requires:
        # claims only true with the missing packages (xla's and neuron's op lists are JAX's)
        capabilities = dict.fromkeys(capabilities)
    return {
        "name": name,
        **capabilities,
        "can_execute_here": ok,
        "reason": why or None,
        "missing": list(missing),
        "install": backend.requirements.install if missing and backend.requirements else None,
    }


def _capability_fields(caps: Capabilities) -> Row:
    from ..opset import opset_table

    return {
        "program_kinds": sorted(k.value for k in caps.program_kinds),
        "variants": list(caps.variants),
        "ops": len(opset_table()) if caps.ops is None else len(caps.ops),
        "writes_artifacts": caps.writes_artifacts,
    }


def passes() -> list[Row]:
    """Per pass: name, summary (first docstring line), options (name, type, default, required)."""
    from ..passes import registry

    rows: list[Row] = []
    for name in registry.names():
        try:
            cls = registry.get(name)
        except PortableError as exc:
            rows.append({"name": name, "error": str(exc), "summary": exc.what, "options": []})
            continue
        doc = inspect.getdoc(cls) or ""
        rows.append(
            {"name": name, "summary": doc.splitlines()[0] if doc else "", "options": _options(cls)}
        )
    return rows


def ops() -> list[Row]:
    """Per opset entry: name, dtypes, shape (rule name), semantics, signature (torch schema)."""
    from ..opset import opset_table

    return [
        {
            "name": d.name,
            "dtypes": d.dtypes,
            "shape": d.shape,
            "semantics": d.semantics,
            "signature": d.signature,
        }
        for d in opset_table().values()
    ]


def _options(cls: type) -> list[Row]:
    hints = typing.get_type_hints(cls)
    out = []
    for field in dataclasses.fields(cls):
        hint = hints.get(field.name, field.type)
        required = (
            field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        )
        out.append(
            {
                "name": field.name,
                "type": hint.__name__ if isinstance(hint, type) else str(hint),
                "default": None if field.default is dataclasses.MISSING else field.default,
                "required": required,
            }
        )
    return out


def _option_text(o: Row) -> str:
    return f"{o['name']}: {o['type']}" + ("" if o["required"] else f" = {o['default']!r}")


def _yes(value: Any) -> str:
    return "yes" if value else "no"


# command -> (collect rows, help, table columns, row -> cells)
_LISTINGS: dict[str, tuple[Callable[[], list[Row]], str, list[str], Callable[[Row], list[Any]]]] = {
    "backends": (
        backends,
        "list backends, their capabilities and whether they run here",
        ["name", "program kinds", "variants", "ops", "runs here", "reason"],
        lambda r: [
            r["name"],
            ", ".join(r.get("program_kinds") or []) or "-",
            ", ".join(r.get("variants") or []) or "-",
            r.get("ops") or "-",
            _yes(r["can_execute_here"]),
            r.get("reason") or "",
        ],
    ),
    "passes": (
        passes,
        "list passes with their options",
        ["name", "options", "summary"],
        lambda r: [
            r["name"],
            "; ".join(_option_text(o) for o in r["options"]) or "-",
            r["summary"],
        ],
    ),
    "ops": (
        ops,
        "list the opset: name, dtypes, shape rule, semantics",
        ["name", "dtypes", "shape", "semantics"],
        lambda r: [r["name"], r["dtypes"], r["shape"], r["semantics"]],
    ),
}


def add_parsers(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    for name, (collect, help_text, columns, cells) in _LISTINGS.items():
        p = sub.add_parser(name, parents=parents, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="print one JSON list")
        p.set_defaults(run=_runner(collect, columns, cells))


def _runner(
    collect: Callable[[], list[Row]], columns: list[str], cells: Callable[[Row], list[Any]]
) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        rows = collect()
        print(
            json.dumps(rows, indent=2, default=str)
            if args.json
            else format_table(columns, [cells(r) for r in rows])
        )
        return 0

    return run
