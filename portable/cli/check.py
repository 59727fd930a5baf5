"""`portable check DIR`: the offline checks of each backend again, on written artifacts.

DIR is a `portable lower` output, or one target folder of one. The targets of the output's
`manifest.json` whose backend checks its artifacts (`Capabilities.checks`; neuron: the offline
validator and file checks, backends/neuron/check.py) are checked with `Backend.check`, which
returns the findings per program. When the output holds the archive the program was lowered
from (`program.portable`), the backend is given it (neuron's findings then name graph nodes and
user source lines).

Exit 0 when no program has an error finding (warnings are printed; `--strict` makes them count),
6 (CHECK_FINDINGS) otherwise; 3 when DIR holds no program such a backend wrote; 4 when a
backend's optional packages are not installed (neuron: jax, which parses the HLO).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PortableError
from .exit_codes import EPILOG, ExitCode
from .manifest import read_manifest

if TYPE_CHECKING:
    from ..backends import Backend, CheckedProgram
    from ..ir.program import Program

__all__ = ["add_parser", "check_dir", "run"]

ARCHIVE = "program.portable"


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    folder: str  # the target folder, relative to DIR ("neuron_trn3", or "." for DIR)
    checked: CheckedProgram

    @property
    def errors(self) -> int:
        return self.checked.errors

    @property
    def warnings(self) -> int:
        return self.checked.warnings

    def to_json(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "program": self.checked.key,
            "path": self.checked.path.as_posix(),
            "target": self.checked.target,
            "errors": self.errors,
            "warnings": self.warnings,
            "findings": [f.to_json() for f in self.checked.findings],
        }


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check",
        parents=parents,
        help="run the backends' offline checks (neuron: its validator) on a lowered output",
        description="Check every program under DIR's target folders with its backend's offline "
        "checks (neuron: what neuronx-cc would reject, found without it).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", metavar="DIR", type=Path, help="a `portable lower` output directory")
    p.add_argument("--strict", action="store_true", help="warnings count as findings too")
    p.add_argument("--json", action="store_true", help="print one JSON document to stdout")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    reports = check_dir(args.dir)
    errors = sum(r.errors for r in reports)
    warnings = sum(r.warnings for r in reports)
    failed = errors > 0 or (args.strict and warnings > 0)
    code = ExitCode.CHECK_FINDINGS if failed else ExitCode.OK
    if args.json:
        doc = {
            "status": "findings" if failed else "ok",
            "exit_code": int(code),
            "dir": str(args.dir),
            "errors": errors,
            "warnings": warnings,
            "programs": [r.to_json() for r in reports],
        }
        print(json.dumps(doc, indent=2))
        return code
    for report in reports:
        where = report.checked.path.as_posix()
        print(f"{where}: {report.errors} error(s), {report.warnings} warning(s)")
        for finding in report.checked.findings:
            print("".join(f"  {line}\n" for line in finding.render().splitlines()), end="")
    verdict = "FINDINGS" if failed else "ok"
    print(
        f"checked {len(reports)} program(s) in {args.dir}: {errors} error(s), "
        f"{warnings} warning(s): {verdict}"
    )
    return code


def check_dir(out: Path) -> list[ProgramReport]:
    """One report per program under `out` that a checking backend wrote (PortableError if there
    is none; BackendError when such a backend's optional packages are missing)."""
    out = Path(out)
    folders = _target_folders(out)
    for backend, _ in folders:
        backend.require()
    archive = _archive(out if folders and folders[0][1] != out else out.parent)
    reports = []
    for backend, folder in folders:
        name = folder.relative_to(out).as_posix() if folder != out else "."
        reports += [ProgramReport(name, c) for c in backend.check(folder, archive)]
    if not reports:
        names = _checking_backends()
        kinds = " or ".join(n for n, _ in names) or "checked"
        example = f"{names[0][0]}:{names[0][1]}" if names and names[0][1] else "T"
        raise PortableError(
            f"{out} holds no {kinds} program (no such target folder with programs in a "
            "`portable lower` output, and not one such folder)",
            fix=f"point at a `portable lower ... --target {example} --out DIR` output",
        )
    return reports


def _target_folders(out: Path) -> list[tuple[Backend, Path]]:
    """The (backend, folder) of each checked target: those of `out`'s manifest, or `out` itself
    when its parent's manifest lists it."""
    manifest = read_manifest(out)
    if manifest is not None:
        entries, root = manifest.get("targets", []), out
    else:
        parent = read_manifest(out.parent) or {}
        entries = [t for t in parent.get("targets", []) if t.get("dir") == out.name]
        root = out.parent
    folders = []
    for entry in entries:
        backend = _checker(entry.get("target"))
        if backend is not None and isinstance(entry.get("dir"), str):
            folders.append((backend, root / entry["dir"]))
    return folders


def _checker(target: object) -> Backend | None:
    """The backend of a manifest's target when it checks its artifacts (None otherwise)."""
    from ..backends import Target, get_backend, registry

    if not isinstance(target, str):
        return None
    name = Target.parse(target).backend
    if name not in registry.names():
        return None
    backend = get_backend(name)
    return backend if backend.capabilities().checks else None


def _checking_backends() -> list[tuple[str, str | None]]:
    """(name, default variant) of the registered backends that check their artifacts."""
    from ..backends import get_backend, registry

    rows = []
    for name in registry.names():
        try:
            caps = get_backend(name).capabilities()
        except PortableError:  # a plug-in that cannot be loaded
            continue
        if caps.checks:
            rows.append((name, caps.default_variant))
    return rows


def _archive(folder: Path) -> Program | None:
    path = folder / ARCHIVE
    if not (path / "program.json").is_file():
        return None
    from ..archive import load

    try:
        return load(path)
    except PortableError:
        return None  # a damaged archive only costs the node mapping; the files are still checked
