"""`portable check DIR`: run the neuron offline validator again on written artifacts.

For every `DIR/neuron_*/programs/<key>/` (DIR is a `portable lower` output, or one neuron target
folder itself) the program's files are checked, and its `model/graph.hlo` is read back and run
through the validator of the neuron backend (`backends/neuron/validate.py`) with the target and
options recorded in that folder's `manifest.json`. When DIR holds the archive the program was
lowered from (`program.portable`, same content hash), findings name graph nodes and user source
lines, and the HBM estimate and the HLO/signature interface are checked too.

File checks (errors): graph.hlo present and parseable; command.txt a `neuronx-cc compile` command
whose input exists, whose `--target` is the manifest's and whose int64 flags are pinned.
graph.hlo differing from the sha256 the manifest recorded is a warning (`artifact-modified`).

Exit 0 when no program has an error finding (warnings are printed; `--strict` makes them count),
6 (CHECK_FINDINGS) otherwise; 3 when DIR holds no neuron program; 4 when the neuron backend's
packages (jax, which parses the HLO) are not installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PortableError
from .exit_codes import EPILOG, ExitCode

if TYPE_CHECKING:
    from ..backends.neuron.findings import Finding
    from ..ir.program import Program

__all__ = ["add_parser", "check_dir", "run"]

ARCHIVE = "program.portable"


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    folder: str  # the neuron target folder, relative to DIR ("neuron_trn3", or "." for DIR)
    key: str
    path: Path
    target: str | None
    findings: list[Finding]

    @property
    def errors(self) -> int:
        return sum(f.severity.value == "error" for f in self.findings)

    @property
    def warnings(self) -> int:
        return len(self.findings) - self.errors

    def to_json(self) -> dict[str, Any]:
        return {
            "folder": self.folder,
            "program": self.key,
            "path": self.path.as_posix(),
            "target": self.target,
            "errors": self.errors,
            "warnings": self.warnings,
            "findings": [f.to_json() for f in self.findings],
        }


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check",
        parents=parents,
        help="run the neuron offline validator on the programs of a lowered output",
        description="Check every program under DIR/neuron_*/programs/ (or DIR/programs/) with "
        "the neuron backend's offline validator: what neuronx-cc would reject, found without it.",
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
        where = report.path.as_posix()
        print(f"{where}: {report.errors} error(s), {report.warnings} warning(s)")
        for finding in report.findings:
            print("".join(f"  {line}\n" for line in finding.render().splitlines()), end="")
    verdict = "FINDINGS" if failed else "ok"
    print(
        f"checked {len(reports)} program(s) in {args.dir}: {errors} error(s), "
        f"{warnings} warning(s): {verdict}"
    )
    return code


def check_dir(out: Path) -> list[ProgramReport]:
    """One report per neuron program under `out` (PortableError if there is none; BackendError
    when the neuron backend's packages, which read and validate the HLO, are missing)."""
    from ..backends import get_backend

    get_backend("neuron").require()
    out = Path(out)
    folders = [out] if (out / "programs").is_dir() else sorted(out.glob("neuron_*/"))
    archive = _archive(out if folders != [out] else out.parent)
    reports = []
    for folder in folders:
        manifest = _neuron_manifest(folder)
        for program_dir in _program_dirs(folder):
            findings, target = _check_program(program_dir, manifest, archive)
            name = folder.relative_to(out).as_posix() if folder != out else "."
            reports.append(ProgramReport(name, program_dir.name, program_dir, target, findings))
    if not reports:
        raise PortableError(
            f"{out} holds no neuron program (no neuron_*/programs/<key>/ and no programs/<key>/)",
            fix="point at a `portable lower ... --target neuron:trn3 --out DIR` output",
        )
    return reports


# one program --------------------------------------------------------------------------------------


def _check_program(
    program_dir: Path, manifest: dict[str, Any], archive: Program | None
) -> tuple[list[Finding], str | None]:
    from ..backends.neuron.command import HLO_FILE
    from ..backends.neuron.findings import merge

    record = _program_record(manifest, program_dir.name)
    variant = manifest.get("target", {}).get("variant")
    findings = _command_findings(program_dir, variant)
    hlo = program_dir / HLO_FILE
    if not hlo.is_file():
        return findings + [_artifact_error("artifact-hlo", f"{HLO_FILE} is missing")], variant
    proto = hlo.read_bytes()
    recorded = record.get("hlo_sha256")
    if recorded and recorded != hashlib.sha256(proto).hexdigest():
        findings.append(
            _artifact_warning(
                "artifact-modified",
                f"{HLO_FILE} is not the file this output was lowered with (its sha256 differs "
                "from the neuron manifest's hlo_sha256)",
                "lower again if the change was not deliberate",
            )
        )
    try:
        findings += _validate_written(proto, manifest, record, archive)
    except PortableError as exc:
        findings.append(_artifact_error("artifact-hlo", str(exc).splitlines()[0]))
    return merge(findings), variant


def _validate_written(
    proto: bytes, manifest: dict[str, Any], record: dict[str, Any], archive: Program | None
) -> list[Finding]:
    """The validator on a written graph.hlo, in the backend's context: the recorded target and
    options, and (when the archive matches) the program as lowered, its kept inputs and memory
    estimate, and a per-rank program's rank layout and rank input (`validate_lowered`, the
    context NeuronBackend.lower validates in)."""
    from ..backends.neuron.fp64 import downcast_fp64
    from ..backends.neuron.hlo import module_from_proto
    from ..backends.neuron.options import NeuronOptions
    from ..backends.neuron.targets import resolve_target
    from ..backends.neuron.validate import validate, validate_lowered

    try:
        module = module_from_proto(proto)
    except Exception as exc:  # XLA's parser: a truncated or foreign file
        raise PortableError(f"graph.hlo is not a serialized HloModuleProto: {exc}") from exc
    target = resolve_target(manifest.get("target", {}).get("variant"))
    fields = {f.name for f in dataclasses.fields(NeuronOptions)}
    options = NeuronOptions(**{k: v for k, v in manifest.get("options", {}).items() if k in fields})
    program = archive
    if program is not None and program.content_hash != manifest.get("program", {}).get(
        "content_hash"
    ):
        program = None  # not the program this folder was lowered from: no node mapping
    if program is None:
        return validate(module, target, options)
    if options.fp64 == "downcast":
        program, _ = downcast_fp64(program)
    kept, rank = _kept(program, record), _rank_parameter(record)
    return validate_lowered(module, target, options, program, kept=kept, rank_parameter=rank)[0]


def _kept(program: Program, record: dict[str, Any]) -> list[int] | None:
    """Signature inputs that are HLO parameters, from the io spec (None: all of them)."""
    inputs = record.get("io_spec", {}).get("inputs")
    if inputs is None:
        return None
    index = {spec.name: k for k, spec in enumerate(program.signature.inputs)}
    return [index[i["name"]] for i in inputs if i.get("name") in index]


def _rank_parameter(record: dict[str, Any]) -> int | None:
    """The HLO parameter number of a per-rank program's int32 rank input (io spec role "rank"),
    or None when the program takes none."""
    inputs = record.get("io_spec", {}).get("inputs") or []
    ranks = [i.get("index") for i in inputs if isinstance(i, dict) and i.get("role") == "rank"]
    return ranks[0] if len(ranks) == 1 and isinstance(ranks[0], int) else None


def _command_findings(program_dir: Path, variant: str | None) -> list[Finding]:
    from ..backends.neuron.command import INT64_FLAGS
    from ..backends.neuron.compile import COMMAND, COMPILER, read_command

    fix = "lower again (`portable lower ... --target neuron`); command.txt is written by portable"
    try:
        argv = read_command(program_dir)
    except (OSError, PortableError) as exc:
        return [_artifact_error("artifact-command", f"{COMMAND}: {str(exc).splitlines()[0]}", fix)]
    problems = []
    if argv[:2] != [COMPILER, "compile"]:
        problems.append(f"it is not a `{COMPILER} compile` command")
    inputs = [a for a in argv[2:] if not a.startswith("-") and a.endswith(".hlo")]
    if len(inputs) != 1 or not (program_dir / inputs[0]).is_file():
        problems.append(f"its input {inputs or '(none)'} is not a file of the program")
    if variant is not None and f"--target={variant}" not in argv:
        problems.append(f"its --target is not the manifest's {variant}")
    missing = [flag for flag in INT64_FLAGS if flag not in argv]
    if missing:
        problems.append(f"the int64 flags are not pinned ({', '.join(missing)} missing)")
    return [_artifact_error("artifact-command", f"{COMMAND}: {p}", fix) for p in problems]


# files ------------------------------------------------------------------------------------------


def _archive(folder: Path) -> Program | None:
    path = folder / ARCHIVE
    if not (path / "program.json").is_file():
        return None
    from ..archive import load

    try:
        return load(path)
    except PortableError:
        return None  # a damaged archive only costs the node mapping; the HLO is still checked


def _neuron_manifest(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _program_record(manifest: dict[str, Any], key: str) -> dict[str, Any]:
    for record in manifest.get("programs", []):
        if isinstance(record, dict) and record.get("key") == key:
            return record
    return {}


def _program_dirs(folder: Path) -> list[Path]:
    """Every directory under `programs/` (one without command.txt or graph.hlo is a finding)."""
    root = folder / "programs"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _artifact_error(code: str, what: str, fix: str | None = None) -> Finding:
    from ..backends.neuron.findings import Finding, Severity

    return Finding(Severity.ERROR, code, what, fix or "lower again (`portable lower`)")


def _artifact_warning(code: str, what: str, fix: str) -> Finding:
    from ..backends.neuron.findings import Finding, Severity

    return Finding(Severity.WARNING, code, what, fix)
