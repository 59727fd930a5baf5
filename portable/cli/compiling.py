"""`lower --compile`: run each target's toolchain on the programs just written.

A backend with a toolchain declares it (`Capabilities.toolchain`, e.g. neuron's `neuronx-cc`) and
implements the `compile` stage. `require_toolchains` runs before capture: `--compile` needs at
least one target whose backend has a toolchain (PortableError, exit 3) and that toolchain on this
machine (`Backend.find_toolchain`; CompilerMissingError, exit 7), so a long capture is never
wasted. `compile_targets` runs `Backend.compile` on each such target's folder, refreshes its file
records (what the compiler wrote joins the output) and stores a `compile` record in its manifest
entry. A failed program does not stop the others and the output is still written (exit 8, like a
parity mismatch); messages name the final DIR, not the staging directory they were produced in.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..backends import Backend, Target, Toolchain, Written, get_backend, registry
from ..errors import PortableError
from .manifest import file_records
from .progress import Progress

__all__ = ["CompileOutcome", "compile_targets", "require_toolchains"]


@dataclasses.dataclass(frozen=True)
class CompileOutcome:
    ok: bool
    errors: list[str]  # one rendered compile error per failed program, paths under DIR


def compiles(backend: Backend) -> bool:
    """Whether `--compile` has something to do for this backend's targets."""
    return backend.capabilities().toolchain is not None


def require_toolchains(
    targets: list[Target], backends: dict[Target, Backend]
) -> dict[Target, Toolchain]:
    """The toolchain of each target that has one, after checking there is one."""
    chosen = [t for t in targets if compiles(backends[t])]
    if not chosen:
        raise PortableError(
            f"--compile compiles {_compiled_kinds()} targets, and none was given "
            f"(targets: {', '.join(map(str, targets))})",
            fix=_compile_fix(),
        )
    found: dict[str, Toolchain] = {}
    for target in chosen:
        if target.backend not in found:
            found[target.backend] = backends[target].find_toolchain()  # CompilerMissingError
    return {t: found[t.backend] for t in chosen}


def compile_targets(
    entries: list[dict[str, Any]],
    written: list[Written],
    targets: list[Target],
    backends: dict[Target, Backend],
    toolchains: dict[Target, Toolchain],
    progress: Progress,
    *,
    root: Path,
    out: Path,
    jobs: int | None,
) -> CompileOutcome:
    """Compile the targets among `entries` (manifest target records, written under `root`,
    which becomes `out`) that have a toolchain; add `compile` to each and refresh its `files`."""
    errors: list[str] = []
    for entry, done, target in zip(entries, written, targets, strict=True):
        toolchain = toolchains.get(target)
        if toolchain is None:
            continue
        what = f"compiling {target} with {toolchain.name} {toolchain.version}"
        with progress.stage(f"compile:{target}", what):
            report = backends[target].compile(done, toolchain, jobs)
        base = root.resolve()
        record = report.to_json()
        record["programs"] = [_final_paths(p, base, out) for p in record["programs"]]
        entry["compile"] = record
        entry["files"] = file_records(root, root / entry["dir"])
        for program in record["programs"]:
            status = "ok" if program["status"] == "pass" else program["status"]
            progress.note(f"{program['program']}: {status} ({program['seconds']:.1f}s)")
            if program["error"]:
                errors.append(f"{target}: {program['error']}")
    return CompileOutcome(not errors, errors)


def _compiling_backends() -> list[tuple[str, Backend]]:
    rows = []
    for name in registry.names():
        try:
            backend = get_backend(name)
            if compiles(backend):
                rows.append((name, backend))
        except PortableError:  # a plug-in that cannot be loaded (RegistryError)
            continue
    return rows


def _compiled_kinds() -> str:
    return " or ".join(name for name, _ in _compiling_backends()) or "no"


def _compile_fix() -> str:
    rows = _compiling_backends()
    if not rows:
        return "drop --compile: no registered backend has a toolchain"
    name, backend = rows[0]
    variant = backend.capabilities().default_variant
    if variant is None:
        return f"add --target {name}, or drop --compile"
    return f"add --target {name}:{variant} (or another {name} variant), or drop --compile"


def _final_paths(record: dict[str, Any], staging: Path, out: Path) -> dict[str, Any]:
    """Error messages were produced in the staging directory; name the final DIR instead."""
    if record["error"]:
        record["error"] = record["error"].replace(str(staging), str(out))
    return record
