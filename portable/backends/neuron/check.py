"""`NeuronBackend.check`: the offline validator again, on artifacts written earlier.

For every `programs/<key>/` of a neuron target folder, the program's files are checked, and its
`model/graph.hlo` is read back and run through the validator (validate.py) with the target and
options recorded in the folder's `manifest.json`. Given the archive the program was lowered from
(same content hash), findings name graph nodes and user source lines, and the HBM estimate and the
HLO/signature interface are checked too.

File checks (errors): graph.hlo present and parseable; command.txt a `neuronx-cc compile` command
whose input exists, whose `--target` is the manifest's and whose int64 flags are pinned for that
target (`--implicit-integer-downcast=all`; `--native-int64=disabled` on trn2 and later only, and
never before trn2).
graph.hlo differing from the sha256 the manifest recorded is a warning (`artifact-modified`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from portable.errors import PortableError
from portable.ir.program import Program

from ..base import CheckedProgram
from .command import HLO_FILE, INT64_FLAGS, int64_flags
from .compile import COMMAND, COMPILER, read_command
from .findings import Finding, Severity, merge
from .fp64 import downcast_fp64
from .hlo import module_from_proto
from .options import NeuronOptions
from .targets import TARGETS, resolve_target
from .validate import validate, validate_lowered

__all__ = ["check_folder"]


def check_folder(folder: Path, archive: Program | None) -> list[CheckedProgram]:
    """One checked program per directory under `folder/programs/` (none: an empty list)."""
    manifest = _neuron_manifest(folder)
    checked = []
    for program_dir in _program_dirs(folder):
        findings, target = _check_program(program_dir, manifest, archive)
        checked.append(CheckedProgram(program_dir.name, program_dir, target, findings))
    return checked


def _check_program(
    program_dir: Path, manifest: dict[str, Any], archive: Program | None
) -> tuple[list[Finding], str | None]:
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
            Finding(
                Severity.WARNING,
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
    try:
        module = module_from_proto(proto)
    except Exception as exc:  # XLA's parser: a truncated or foreign file
        raise PortableError(f"graph.hlo is not a serialized HloModuleProto: {exc}") from exc
    fields = {f.name for f in dataclasses.fields(NeuronOptions)}
    options = NeuronOptions(**{k: v for k, v in manifest.get("options", {}).items() if k in fields})
    target = resolve_target(manifest.get("target", {}).get("variant"), options.topology)
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
    problems += _int64_problems(argv, variant)
    return [_artifact_error("artifact-command", f"{COMMAND}: {p}", fix) for p in problems]


def _int64_problems(argv: list[str], variant: str | None) -> list[str]:
    """The pinned int64 flags of `variant` missing from `argv`, and --native-int64 where the
    CLI reference does not allow it (before trn2)."""
    target = TARGETS.get(variant or "")
    wanted = int64_flags(target) if target is not None else INT64_FLAGS[1:]
    problems = []
    missing = [flag for flag in wanted if flag not in argv]
    if missing:
        problems.append(f"the int64 flags are not pinned ({', '.join(missing)} missing)")
    native = [a for a in argv if a.startswith("--native-int64")]
    if native and target is not None and not any(f.startswith("--native") for f in wanted):
        problems.append(f"{native[0]} is only available on trn2 and later, not {variant}")
    return problems


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
    return Finding(Severity.ERROR, code, what, fix or "lower again (`portable lower`)")
