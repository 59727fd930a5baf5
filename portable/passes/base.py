"""`Pass`: the unit of program transformation, and what it reports.

A pass is a frozen dataclass whose fields are its options; the same object is built from Python
(`Canonicalize(disable="clone")`) and from the CLI string (`canonicalize{disable=clone}`, see
`spec.py`). Contract of `apply(program) -> PassResult`:

- it may assume `program` is valid IR (`portable.verify` passes) and must return valid IR;
- it never mutates `program`: it rewrites a copy (`program.replace()` deep-copies the graph), or
  returns `program` itself when it changes nothing;
- every node it creates carries `meta["tensor"]` (its shape and dtype) and `meta["source"]`
  (copied from the node it replaces), so the verifier and error messages keep working.
"""

from __future__ import annotations

import abc
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from portable.errors import PassError
from portable.ir.program import Program

__all__ = ["OPTION_TYPES", "Pass", "PassReport", "PassResult", "ReportTable"]

# The option types a pass field may have (each also as `T | None`).
OPTION_TYPES: tuple[type, ...] = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class ReportTable:
    """A table a report carries for people: the CLI prints it under the pass's summary line."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True)
class PassReport:
    """What one application of a pass did: `counts` maps a pattern or action to how often it
    fired (e.g. `{"reshape-chain": 3, "dead-code": 5}`); `changed` is whether the graph changed.

    What `Pass.measure` adds on example inputs: `lines` and `tables` printed under the summary
    (in that order), and `record`, fields the `portable lower` manifest's record of the pass
    gains (e.g. mx-quantize's `layers`). `to_json` is the pass's record without them."""

    name: str
    options: dict[str, Any]
    changed: bool
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    lines: tuple[str, ...] = ()
    tables: tuple[ReportTable, ...] = ()
    record: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "pass": self.name,
            "options": dict(self.options),
            "changed": self.changed,
            "counts": dict(self.counts),
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        """One line: `canonicalize: changed (reshape-chain=3, dead-code=5)`."""
        counts = ", ".join(f"{k}={v}" for k, v in self.counts.items() if v)
        state = "changed" if self.changed else "unchanged"
        return f"{self.name}: {state}" + (f" ({counts})" if counts else "")


@dataclasses.dataclass(frozen=True)
class PassResult:
    program: Program
    report: PassReport


@dataclasses.dataclass(frozen=True)
class Pass(abc.ABC):
    """Base of all passes. Subclasses are `@dataclasses.dataclass(frozen=True)`, set `name`, and
    declare options as fields of a type in `OPTION_TYPES` (or `T | None`) with a default.

    Option values are type-checked at construction (PassError on a wrong type); a subclass with
    its own `__post_init__` calls `super().__post_init__()` first."""

    name: ClassVar[str]
    # False for passes that change the numbers on purpose (quantization): the program is then no
    # longer compared with the eager model it was captured from (`portable lower --parity`)
    preserves_numerics: ClassVar[bool] = True

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            expected = option_type(hints[field.name])
            if value is None and optional(hints[field.name]):
                continue
            if expected is float and type(value) is int:
                object.__setattr__(self, field.name, float(value))
            elif type(value) is not expected:
                raise PassError(
                    f"option {field.name!r} of pass {self.name!r} must be {type_name(hints[field.name])}, "
                    f"got {value!r} ({type(value).__name__})",
                    pass_name=self.name,
                )

    @abc.abstractmethod
    def apply(self, program: Program) -> PassResult:
        """Transform `program` (see the module docstring for the contract)."""

    def measure(
        self,
        program: Program,
        report: PassReport,
        inputs: Callable[[], Sequence[Any]] | None,
    ) -> PassReport:
        """`report` with what can be measured on the program the pass returned, run on example
        inputs (`inputs()`, the user inputs or a training step's batch; None when there are none,
        as for an archive): lines, tables and manifest fields for tools that show reports
        (`portable lower`). By default nothing is measured."""
        return report

    def options(self) -> dict[str, Any]:
        """Every option by field name, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spec(self) -> str:
        """The canonical string form: `parse_pass(p.spec()) == p`."""
        return format_pass(self)

    def report(
        self, changed: bool, counts: dict[str, int] | None = None, notes: list[str] | None = None
    ) -> PassReport:
        return PassReport(self.name, self.options(), changed, dict(counts or {}), list(notes or []))


def optional(hint: Any) -> bool:
    """Whether a field type hint is `T | None`."""
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(
        None
    ) in typing.get_args(hint)


def option_type(hint: Any) -> type:
    """`T` for a hint `T` or `T | None`; TypeError for a type options cannot have."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if optional(hint) else [hint]
    if len(args) != 1 or args[0] not in OPTION_TYPES:
        raise TypeError(
            f"pass options must be one of {[t.__name__ for t in OPTION_TYPES]} (or T | None), got {hint}"
        )
    return args[0]


def type_name(hint: Any) -> str:
    name = option_type(hint).__name__
    return f"{name} | None" if optional(hint) else name


# The canonical string form (the grammar is portable.passes.spec's): bare words need no quotes.
_BARE = re.compile(r"[A-Za-z0-9_.+\-/:]+")


def format_pass(p: Pass) -> str:
    """Canonical string form: the name, then the options that differ from their defaults."""
    items = []
    for field in dataclasses.fields(p):
        value = getattr(p, field.name)
        if (
            field.default is not dataclasses.MISSING
            and value == field.default
            and type(value) is type(field.default)
        ):
            continue
        items.append(f"{field.name}={_format_value(value)}")
    return p.name + ("{" + ",".join(items) + "}" if items else "")


def _format_value(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if _BARE.fullmatch(text) and text != "none":
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
