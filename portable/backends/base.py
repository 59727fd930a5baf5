"""The backend protocol: stages, capabilities as data, options parsed from the target string.

    lower(program, target) -> Lowered         inspectable text / protos, no execution
    write(lowered, out_dir) -> Written        writes the artifacts under out_dir (if given)
    compile(written, toolchain, jobs)         runs the backend's toolchain on what was written
                     -> CompileReport         (`Capabilities.toolchain`; nothing for most backends)
    executable(written) -> Executable         loads it here (BackendError if it cannot run here)
    run(executable, *inputs)                  one call
    check(folder, archive) -> [CheckedProgram] re-checks written artifacts offline
                                              (`Capabilities.checks`; `portable check`)

A backend declares what it supports in `Capabilities`, plain data that imports nothing heavy;
tests check the claims against what really runs. Heavy imports (jax, triton, onnx) happen inside
the stages, never at import time. The optional packages a backend needs are its capabilities'
`requires` (and the `extra` of portable that installs them): without them the backend is still
registered and listed (with what is missing and the `pip install` that adds it), and every use of
it (`check_target`, and so `lower`) is refused with that message as a `BackendError`, checked
here once for every backend.

Options are a frozen dataclass (`options_type`) parsed from the target string with the pass-option
grammar (`cuda{aot=true}`, `neuron:trn3{fp64=error}`, see `options.py`).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from portable.errors import BackendError, LoweringError, PortableError
from portable.ir.program import Program, ProgramKind
from portable.ir.source import source_of
from portable.opset import lookup, op_name
from portable.runtime import Executable

from .builtins import get_backend, registry

__all__ = [
    "INTEGER_DTYPES",
    "Backend",
    "Capabilities",
    "CheckedProgram",
    "CompileReport",
    "Finding",
    "Lowered",
    "Requirements",
    "Target",
    "Toolchain",
    "CompilerMissingError",
    "Written",
]


@dataclasses.dataclass(frozen=True)
class Target:
    """`backend[:variant][{options}]`, e.g. `cpu`, `neuron:trn3`, `cuda:sm_100`,
    `cuda{aot=true}`. `options` is the text between the braces, parsed by the backend
    (`Backend.parse_options`); it is not part of the target's name (`str`), which names its
    folder and manifest entry."""

    backend: str
    variant: str | None = None
    options: str = ""

    @staticmethod
    def parse(text: str) -> Target:
        head, brace, rest = text.partition("{")
        if brace and not rest.rstrip().endswith("}"):
            raise BackendError(
                f"cannot parse target {text!r}: its options do not end with `}}`",
                fix="write backend[:variant]{key=value,...}",
            )
        backend, _, variant = head.partition(":")
        options = rest.rstrip()[:-1].strip() if brace else ""
        return Target(backend.strip(), variant.strip() or None, options)

    def with_variant(self, variant: str | None) -> Target:
        return dataclasses.replace(self, variant=variant)

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
    """What a backend claims, as data (building it imports none of `requires`)."""

    ops: frozenset[str] | None  # opset names it lowers; None means every op in the opset
    program_kinds: frozenset[ProgramKind]
    variants: tuple[str, ...] = ()  # accepted target variants; empty means none
    writes_artifacts: bool = True
    # a variant may list several (`cuda:sm_90,sm_100`); the CLI lowers a backend's targets together
    combines_variants: bool = False
    # the variant a bare target means (`neuron` is `neuron:trn3`); None: a bare target has none
    default_variant: str | None = None
    # the optional packages (importable names) every stage needs, and the extra of portable that
    # installs them (default: the backend's name)
    requires: tuple[str, ...] = ()
    extra: str | None = None
    # False: `portable backends` shows these claims only where `requires` is installed (xla's and
    # neuron's op lists are their JAX rule table's, which does not run without JAX)
    listed_without_requires: bool = True
    # the toolchain `compile` runs on the written artifacts (`lower --compile`); None: none
    toolchain: str | None = None
    # whether `check` re-checks written artifacts offline (`portable check`)
    checks: bool = False
    # whether it takes per-rank programs (`Program.is_per_rank`: spmd-partition's output over
    # more than one rank); check_program refuses them elsewhere
    per_rank: bool = False
    # opset name -> {dtype name ("bfloat16", "int64", "bool", ...) -> why this backend cannot
    # take the op on tensors of that dtype}: an op it lowers, but not in every dtype the opset
    # declares (ONNX Runtime's CPU kernels lack bfloat16 for most ops). check_program refuses a
    # node with such an input or result dtype before lowering, naming the backends that take it.
    dtype_gaps: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)

    def supports_op(self, name: str) -> bool:
        return self.ops is None or name in self.ops

    def dtype_gap(self, name: str, dtypes: Iterable[str]) -> tuple[str, str] | None:
        """(dtype, why) for the first of `dtypes` this backend cannot take `name` on, or None."""
        gaps = self.dtype_gaps.get(name, {})
        return next(((d, gaps[d]) for d in dtypes if d in gaps), None)


# the integer dtype names a `dtype_gaps` entry lists for a backend whose kernel takes floats only
INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint8")


# `Lowered.texts` entry with the lines a backend reports about its lowering (its decisions,
# one per line); `portable lower` prints them under the target
REPORT_TEXT = "report.txt"


@dataclasses.dataclass
class Lowered:
    program: Program
    target: Target
    texts: dict[str, str] = dataclasses.field(default_factory=dict)  # artifact name -> text
    payload: Any = None  # backend-private lowered form

    @property
    def report(self) -> str:
        """The backend's decisions about this lowering, one per line ("" when it has none)."""
        return self.texts.get(REPORT_TEXT, "")


@dataclasses.dataclass
class Written:
    """What `write` produced: the artifacts under `out_dir` (none without one)."""

    lowered: Lowered
    files: list[Path] = dataclasses.field(default_factory=list)  # artifacts written
    payload: Any = None
    out_dir: Path | None = None


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """A compiler `compile` runs, as found on this machine."""

    name: str  # e.g. "neuronx-cc"
    version: str


class CompilerMissingError(PortableError):
    """`compile` was asked for, and the toolchain it needs is not installed here (`portable`
    exits 7)."""


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What `compile` did: one record per program (`program`, `status` ("pass" or why not),
    `seconds`, `error` (the rendered error, or None), and whatever else the backend records),
    with the number of compilers run at once. No programs: nothing to compile."""

    toolchain: Toolchain | None
    jobs: int
    programs: tuple[dict[str, Any], ...] = ()

    @property
    def ok(self) -> bool:
        return all(p["status"] == "pass" for p in self.programs)

    def to_json(self) -> dict[str, Any]:
        return {
            "compiler": self.toolchain.name if self.toolchain else None,
            "version": self.toolchain.version if self.toolchain else None,
            "jobs": self.jobs,
            "ok": self.ok,
            "programs": [dict(p) for p in self.programs],
        }


class Finding(Protocol):
    """One problem `check` found (the neuron validator's findings are one kind)."""

    @property
    def is_error(self) -> bool: ...  # False: a warning

    def render(self) -> str: ...  # lines for a terminal

    def to_json(self) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class CheckedProgram:
    """The findings of `check` on one written program."""

    key: str  # the program's name within its folder
    path: Path  # where its artifacts are
    target: str | None  # the variant it was written for, as recorded
    findings: Sequence[Finding]

    @property
    def errors(self) -> int:
        return sum(f.is_error for f in self.findings)

    @property
    def warnings(self) -> int:
        return len(self.findings) - self.errors


class Backend(abc.ABC):
    """A backend: the stages of the module docstring over its `capabilities()`.

    Subclasses set `name`, implement `capabilities`, `lower` and `executable`, and override
    `write` (default: each of `lowered.texts` as a file), `compile`/`find_toolchain` (with a
    `toolchain`), `check` (with `checks`), `check_options` and `options_type` where they have
    them. A subclass built with options takes them as its one constructor argument."""

    name: str = ""
    options_type: ClassVar[type | None] = None  # its options, a frozen dataclass (or None)

    def __init__(self, options: Any = None) -> None:
        self.options = options

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """The claims, as data: imports nothing of `requires`, never refused."""

    @property
    def requirements(self) -> Requirements | None:
        """The optional packages it needs (`Capabilities.requires`) and their `pip install`."""
        caps = self.capabilities()
        return Requirements(caps.requires, caps.extra or self.name) if caps.requires else None

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

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The fields of its `options_type` (none without one)."""
        from .options import fields_of

        return fields_of(cls)

    @classmethod
    def parse_options(cls, text: str = "", **given: Any) -> Any:
        """Its options from the text between a target's braces (`aot=true`), with `given`
        (flags of a command line) for the fields it has: None when there is neither, a
        BackendError for text or values it does not take."""
        from .options import parse_options

        return parse_options(cls, text, given)

    # stages ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def lower(self, program: Program, target: Target) -> Lowered: ...

    def write(self, lowered: Lowered, out_dir: Path | None = None) -> Written:
        """Write the artifacts under `out_dir` (nothing without one). By default each of
        `lowered.texts` is one file."""
        files = []
        if out_dir is not None:
            for name, text in lowered.texts.items():
                path = Path(out_dir) / name
                path.write_text(text)
                files.append(path)
        return Written(lowered, files, lowered.payload, out_dir)

    def compile(
        self, written: Written, toolchain: Toolchain | None = None, jobs: int | None = None
    ) -> CompileReport:
        """Run the toolchain (`find_toolchain()` unless given) on `written`, with at most `jobs`
        compilers at once (None: the backend's default); paths in the records are relative to
        the folder above the written one. Backends without a toolchain have nothing to compile
        (a report without programs)."""
        return self.compile_written(written, toolchain or self.find_toolchain(), jobs)

    def compile_written(
        self, written: Written, toolchain: Toolchain, jobs: int | None
    ) -> CompileReport:
        """`compile` for a backend with a toolchain; by default there is nothing to compile."""
        return CompileReport(toolchain, 0)

    def find_toolchain(self) -> Toolchain:
        """The toolchain of `Capabilities.toolchain` on this machine (CompilerMissingError
        saying how to install it when it is not here)."""
        raise CompilerMissingError(f"backend {self.name} has no toolchain to compile with")

    @abc.abstractmethod
    def executable(self, compiled: Written) -> Executable: ...

    def run(self, executable: Executable, *inputs: Any) -> Any:
        """Run one call (inference outputs, or one training step's StepResult)."""
        return executable(*inputs)

    def check(self, folder: Path, archive: Program | None = None) -> list[CheckedProgram]:
        """Re-check what `write` wrote under `folder` without the toolchain (`Capabilities.checks`);
        `archive` is the program it was lowered from, when known (findings then name its nodes
        and source lines). By default there is nothing to check."""
        return []

    def check_options(self) -> None:
        """Refuse, before any work, options this machine cannot honour (BackendError). By
        default every option can be honoured anywhere."""
        return None

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
        if program.is_per_rank and not caps.per_rank:
            raise _per_rank_refused(self.name, program)
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
                    fix=f"run this program on a backend that takes {name}: "
                    + (", ".join(takes_op(name)) or "(none)")
                    + "; similar ops this backend takes: "
                    + _alternatives(name, caps.ops or frozenset()),
                )
            gap = caps.dtype_gap(name, _node_dtypes(node))
            if gap is not None:
                dtype, why = gap
                src = source_of(node)
                raise LoweringError(
                    f"backend {self.name} does not take {name} on {dtype} tensors: {why}",
                    backend=self.name,
                    op=name,
                    module=src.module if src else None,
                    source=src.location() if src else None,
                    fix=f"cast to another dtype before this op, or run the program on a backend "
                    f"that takes it: {', '.join(takes_op(name, dtype)) or '(none)'}",
                )


def _node_dtypes(node: Any) -> list[str]:
    """The dtype names of a node's tensor inputs and its (first) result, as recorded at capture:
    the further results of a tuple op are its int64 indices or statistics (`max_pool2d_with_
    indices`, `sort`), which no dtype gap is about."""
    specs = [a.meta.get("tensor") for a in node.all_input_nodes]
    result = node.meta.get("tensor")
    specs += list(result[:1]) if isinstance(result, tuple) else [result]
    names = (str(getattr(s, "dtype", "")).removeprefix("torch.") for s in specs)
    return list(dict.fromkeys(n for n in names if n))


def takes_op(name: str, dtype: str | None = None) -> list[str]:
    """The registered backends whose capabilities claim opset op `name` (on `dtype` tensors)."""
    found = []
    for backend in registry.names():
        try:
            caps = get_backend(backend).capabilities()
        except Exception:  # noqa: BLE001 (a plug-in that cannot even state its claims)
            continue
        if caps.supports_op(name) and (dtype is None or caps.dtype_gap(name, [dtype]) is None):
            found.append(backend)
    return found


# the built-in backends whose capabilities declare `per_rank` (a test checks this against them;
# a plug-in's claim is its own Capabilities)
PER_RANK_BUILTINS = ("cpu", "neuron", "xla")


def _per_rank_refused(backend: str, program: Program) -> BackendError:
    """A per-rank program on a backend that runs single-device programs: lower the global
    program here, or the per-rank one where it runs."""
    size = program.spmd.size if program.spmd is not None else 1
    return BackendError(
        f"backend {backend} takes single-device programs; {program.name} is a per-rank program "
        f"over a mesh of {size} devices",
        fix="lower the program before `spmd-partition` (the global program) here, or the "
        "per-rank program on a backend that takes per-rank programs: "
        f"{', '.join(PER_RANK_BUILTINS)} (`portable run --nproc N` runs it as N cpu ranks)",
    )


def _alternatives(name: str, ops: frozenset[str]) -> str:
    stem = name.split(".")[1]
    close = sorted(o for o in ops if o.split(".")[1].startswith(stem[:4]))
    return ", ".join(close[:8]) or f"{len(ops)} ops (see `portable backends --json`)"
