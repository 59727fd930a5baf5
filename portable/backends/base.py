"""The backend protocol: three stages, capabilities as data.

    lower(program, target) -> Lowered        inspectable text / protos, no execution
    compile(lowered, out_dir) -> Compiled    writes artifacts under out_dir (if given)
    executable(compiled) -> Executable       loads it here (BackendError if it cannot run here)
    run(executable, *inputs)                 one call

A backend declares what it supports in `Capabilities`; tests check the claims against what really
runs. Heavy imports (jax, triton, onnx) happen inside the backend's methods, never at import time.
The optional packages a backend needs are declared as `Requirements`: without them the backend is
still registered and listed (with what is missing and the `pip install` that adds it), and every
use of it (`capabilities`, `lower`) is refused with that message as a `BackendError`.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any, ClassVar

from portable.errors import BackendError, LoweringError
from portable.ir.program import Program, ProgramKind
from portable.ir.source import source_of
from portable.opset import lookup, op_name
from portable.runtime import Executable

__all__ = ["Backend", "Capabilities", "Compiled", "Lowered", "Requirements", "Target"]


@dataclasses.dataclass(frozen=True)
class Target:
    """`backend[:variant]`, e.g. `cpu`, `neuron:trn3`, `cuda:sm_100`."""

    backend: str
    variant: str | None = None

    @staticmethod
    def parse(text: str) -> Target:
        backend, _, variant = text.partition(":")
        return Target(backend.strip(), variant.strip() or None)

    def __str__(self) -> str:
        return f"{self.backend}:{self.variant}" if self.variant else self.backend


@dataclasses.dataclass(frozen=True)
class Requirements:
    """The optional packages a backend imports (`modules`, importable names) and the extra of
    `portable` that installs them."""

    modules: tuple[str, ...]
    extra: str

    @property
    def install(self) -> str:
        return f"pip install 'portable[{self.extra}]'"

    def missing(self) -> tuple[str, ...]:
        """The modules that cannot be found here (found without importing them)."""
        return tuple(m for m in self.modules if not _findable(m))


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import; a broken spec
        return False


@dataclasses.dataclass(frozen=True)
class Capabilities:
    ops: frozenset[str] | None  # opset names it lowers; None means every op in the opset
    program_kinds: frozenset[ProgramKind]
    variants: tuple[str, ...] = ()  # accepted target variants; empty means none
    writes_artifacts: bool = True
    # a variant may list several (`cuda:sm_90,sm_100`); the CLI lowers a backend's targets together
    combines_variants: bool = False
    # the variant a bare target means (`neuron` is `neuron:trn3`); None: a bare target has none
    default_variant: str | None = None

    def supports_op(self, name: str) -> bool:
        return self.ops is None or name in self.ops


@dataclasses.dataclass
class Lowered:
    program: Program
    target: Target
    texts: dict[str, str] = dataclasses.field(default_factory=dict)  # artifact name -> text
    payload: Any = None  # backend-private lowered form


@dataclasses.dataclass
class Compiled:
    lowered: Lowered
    files: list[Path] = dataclasses.field(default_factory=list)  # artifacts written
    payload: Any = None


class Backend(abc.ABC):
    name: str = ""
    requirements: ClassVar[Requirements | None] = None  # optional packages it needs

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    def can_execute_here(self) -> tuple[bool, str]:
        """(True, "") or (False, why) for this machine; by default, whether the optional
        packages are installed."""
        why = self.unavailable()
        return not why, why

    def missing(self) -> tuple[str, ...]:
        """The optional packages this backend needs that are not installed (none: usable)."""
        return self.requirements.missing() if self.requirements is not None else ()

    def unavailable(self) -> str:
        """Why this backend cannot be used in this installation ("" when it can): the missing
        packages and the `pip install` that adds them."""
        missing = self.missing()
        if not missing or self.requirements is None:
            return ""
        verb = "is" if len(missing) == 1 else "are"
        return f"{', '.join(missing)} {verb} not installed ({self.requirements.install})"

    def require(self) -> None:
        """Refuse to be used without the optional packages this backend needs (BackendError
        naming them, its fix the `pip install` that adds them)."""
        missing = self.missing()
        if missing and self.requirements is not None:
            raise BackendError(
                f"backend {self.name} needs {', '.join(missing)}, not installed here",
                fix=self.requirements.install,
            )

    @abc.abstractmethod
    def lower(self, program: Program, target: Target) -> Lowered: ...

    @abc.abstractmethod
    def compile(self, lowered: Lowered, out_dir: Path | None = None) -> Compiled: ...

    @abc.abstractmethod
    def executable(self, compiled: Compiled) -> Executable: ...

    def run(self, executable: Executable, *inputs):
        """Run one call (inference outputs, or one training step's StepResult)."""
        return executable(*inputs)

    # shared checks --------------------------------------------------------------------------

    def check_target(self, target: Target) -> None:
        """Refuse a backend whose packages are missing and target variants it does not have
        (what can be checked before a program exists)."""
        self.require()
        caps = self.capabilities()
        variants = (
            target.variant.split(",")
            if caps.combines_variants and target.variant
            else [target.variant]
        )
        if target.variant is not None and any(v not in caps.variants for v in variants):
            raise BackendError(
                f"unknown target {target}",
                fix=f"variants of {self.name}: {', '.join(caps.variants) or '(none)'}",
            )

    def check_program(self, program: Program, target: Target) -> None:
        """Refuse a backend whose packages are missing, and program kinds, target variants and
        ops this backend does not support."""
        self.check_target(target)
        caps = self.capabilities()
        if program.kind not in caps.program_kinds:
            raise BackendError(
                f"backend {self.name} does not take {program.kind.value} programs",
                fix=f"it takes: {', '.join(sorted(k.value for k in caps.program_kinds))}",
            )
        for node in program.graph.nodes:
            if node.op != "call_function" or lookup(node.target) is None:
                continue
            name = op_name(node.target)
            if not caps.supports_op(name):
                src = source_of(node)
                raise LoweringError(
                    f"backend {self.name} has no rule for {name}",
                    backend=self.name,
                    op=name,
                    module=src.module if src else None,
                    source=src.location() if src else None,
                    fix="supported here: "
                    + _alternatives(name, caps.ops or frozenset())
                    + "; or run this program on another backend (`portable backends`)",
                )


def _alternatives(name: str, ops: frozenset[str]) -> str:
    stem = name.split(".")[1]
    close = sorted(o for o in ops if o.split(".")[1].startswith(stem[:4]))
    return ", ".join(close[:8]) or f"{len(ops)} ops (see `portable backends --json`)"
