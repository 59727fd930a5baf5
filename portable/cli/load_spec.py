"""Resolve a SPEC argument to a `@portable` model or a saved program.

SPEC is one of:
- `path/to/file.py:Name`: the file is imported by path under a module name derived from the
  resolved path (its folder is on `sys.path` while it runs, as for a script);
- `pkg.module:Name`: imported with `importlib.import_module`;
- a directory holding `program.json`: a saved archive, read with `portable.load`.

`Name` may be dotted (`Outer.model`). It must carry a `ModelSpec` (`@portable`). Every failure
is a CaptureError (exit 3) naming what was looked for and what was found.

A PLAN argument (`--plan`) is resolved the same way: `plan.json` (`Plan.to_json` form) or
`file.py:attr` naming a `Plan` or a zero-argument function returning one (PlanError otherwise).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import sys
import types
from pathlib import Path

from ..capture import ModelSpec, capture_spec, spec_of
from ..errors import CaptureError, PlanError, PortableError
from ..ir.plan import Plan
from ..ir.program import Program
from ..safe_json import read_json

__all__ = ["Source", "load_plan", "resolve", "with_plan"]

_FORMS = "file.py:Name, pkg.module:Name, or an archive directory (holding program.json)"


@dataclasses.dataclass(frozen=True)
class Source:
    """What SPEC named: exactly one of `spec` (a `@portable` model) or `archive` (a directory)."""

    text: str
    spec: ModelSpec | None = None
    archive: Path | None = None

    @property
    def name(self) -> str:
        return self.spec.name if self.spec is not None else str(self.archive)

    def program(self, *, training: bool, plan: Plan | None = None) -> Program:
        """Capture the spec (training step or inference) under `plan` (the spec's own when
        None: a pipeline's micro-batches set the step's accumulation), or load the archive."""
        if self.spec is not None:
            return capture_spec(self.spec, training=training, plan=plan)
        assert self.archive is not None  # invariant of resolve(), not user input
        from ..archive import load

        program = load(self.archive)
        if training and program.kind.value != "training_step":
            raise CaptureError(
                f"--train asks for a training step, but {self.archive} holds a program of kind "
                f"{program.kind.value}",
                fix="drop --train (an archive's kind is fixed), or pass the model's SPEC",
            )
        return program


def resolve(text: str) -> Source:
    """Parse SPEC and import what it names (no capture yet)."""
    path = Path(text)
    if path.is_dir():
        if not (path / "program.json").is_file():
            raise CaptureError(
                f"{text} is a directory but not a portable archive (no program.json)",
                fix=f"SPEC is {_FORMS}",
            )
        return Source(text, archive=path)
    where, sep, attr = text.rpartition(":")
    if not sep or not where or not attr:
        raise CaptureError(f"cannot read SPEC {text!r}", fix=f"SPEC is {_FORMS}")
    module = _import_file(Path(where)) if _is_path(where) else _import_module(where)
    obj = _getattr_path(module, attr, where)
    spec = spec_of(obj)
    if spec is None:
        raise CaptureError(
            f"`{attr}` in {where} (a {type(obj).__name__}) is not decorated with @portable",
            fix="decorate it with @portable(example_inputs=...)" + _decorated_hint(module),
        )
    return Source(text, spec=spec)


def _is_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _import_file(path: Path) -> types.ModuleType:
    if not path.is_file():
        raise CaptureError(f"no such file: {path}", fix=f"SPEC is {_FORMS}")
    resolved = path.resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:10]
    name = f"_portable_spec_{_identifier(resolved.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, resolved)
    if loader_spec is None or loader_spec.loader is None:
        raise CaptureError(f"cannot import {path} as Python", fix="SPEC's file must end in .py")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up while it runs
    sys.path.insert(0, str(resolved.parent))
    try:
        loader_spec.loader.exec_module(module)
    except PortableError:
        del sys.modules[name]
        raise
    except Exception as exc:  # the user's file may raise anything while it runs
        del sys.modules[name]
        raise _import_failed(str(path), exc) from exc
    finally:
        if str(resolved.parent) in sys.path:
            sys.path.remove(str(resolved.parent))
    return module


def _import_module(name: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and name.startswith(exc.name):
            raise CaptureError(
                f"no module named {exc.name!r} (from SPEC module {name!r})",
                fix="check the spelling, install the package, or give a file path: path/to/file.py:Name",
            ) from exc
        raise _import_failed(name, exc) from exc
    except PortableError:
        raise
    except Exception as exc:  # the user's module may raise anything on import
        raise _import_failed(name, exc) from exc


def _import_failed(where: str, exc: BaseException) -> CaptureError:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    source = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else None
    return CaptureError(
        f"importing {where} raised {type(exc).__name__}: {exc}",
        source=source,
        fix="fix the error in that file (run with --debug for the traceback)",
    )


def _getattr_path(module: types.ModuleType, attr: str, where: str) -> object:
    obj: object = module
    for depth, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = where if depth == 0 else f"{where}:{'.'.join(attr.split('.')[:depth])}"
            raise CaptureError(
                f"{owner} has no attribute {part!r}",
                fix="name a @portable class or factory" + _decorated_hint(module),
            )
        obj = getattr(obj, part)
    return obj


def _decorated_hint(module: types.ModuleType) -> str:
    names = sorted(n for n, v in vars(module).items() if spec_of(v) is not None)
    return (
        f"; @portable objects there: {', '.join(names)}"
        if names
        else "; it has no @portable objects"
    )


def _identifier(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def load_plan(text: str) -> Plan:
    """A Plan from `plan.json` (Plan.to_json form) or `file.py:attr` / `pkg.mod:attr`."""
    path = Path(text)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise PlanError(f"no such plan file: {path}", fix="PLAN is plan.json or file.py:attr")
        data = read_json(path, PlanError, fix="write it with Plan.to_json()")
        try:
            return Plan.from_json(data)
        except PlanError as exc:
            raise PlanError(
                f"{path}: {exc.what}",
                fix=exc.fix
                or 'write it with Plan.to_json(): {"mesh": {"dp": 2}, "batch_axes": ["dp"]}',
            ) from exc
    where, sep, attr = text.rpartition(":")
    if not sep or not where or not attr:
        raise PlanError(f"cannot read PLAN {text!r}", fix="PLAN is plan.json or file.py:attr")
    module = _import_file(Path(where)) if _is_path(where) else _import_module(where)
    obj = _getattr_path(module, attr, where)
    if callable(obj) and not isinstance(obj, Plan):
        obj = obj()
    if not isinstance(obj, Plan):
        raise PlanError(
            f"{text} is a {type(obj).__name__}, not a Plan",
            fix="name a portable.Plan or a zero-argument function returning one",
        )
    return obj


def with_plan(program: Program, plan: Plan) -> Program:
    """`program` carrying `plan`, validated against its tensors (PlanError with the arithmetic)."""
    plan.validate(program.tensor_shapes())
    return program.replace(plan=plan)
