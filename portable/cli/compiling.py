"""`lower --compile`: run neuronx-cc on the programs of the `neuron` targets just lowered.

`require_compiler(targets)` runs before capture: `--compile` needs at least one `neuron` target
(PortableError, exit 3) and `neuronx-cc` on PATH (CompilerMissingError, exit 7), so a long
capture is never wasted. `compile_targets` compiles each neuron target's programs in parallel
(`portable.backends.neuron.compile.compile_all`), refreshes the target's file records (the NEFFs
and logs join the output) and stores a `compile` record in its manifest entry. A failed program
does not stop the others and the output is still written (exit 8, like a parity mismatch);
messages name the final DIR, not the staging directory they were produced in.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..backends import Target
from ..errors import PortableError
from .exit_codes import CompilerMissingError
from .manifest import file_records
from .progress import Progress

__all__ = ["COMPILED_BACKENDS", "CompileOutcome", "compile_targets", "require_compiler"]

COMPILED_BACKENDS = ("neuron",)  # backends whose artifacts `--compile` hands to a compiler


@dataclasses.dataclass(frozen=True)
class CompileOutcome:
    ok: bool
    errors: list[str]  # one rendered NeuronCompileError per failed program, paths under DIR


def require_compiler(targets: list[Target]) -> str:
    """The compiler version, after checking `--compile` has something to do and a compiler."""
    if not any(t.backend in COMPILED_BACKENDS for t in targets):
        raise PortableError(
            "--compile compiles neuron targets, and none was given "
            f"(targets: {', '.join(map(str, targets))})",
            fix="add --target neuron:trn3 (or another neuron variant), or drop --compile",
        )
    from ..backends.neuron.compile import COMPILER, neuronx_cc_available

    ok, version = neuronx_cc_available()
    if not ok:
        raise CompilerMissingError(
            f"--compile needs the Neuron compiler: {version}",
            fix=f"install {COMPILER} from AWS's Neuron pip repository (the PyPI package of that "
            "name is a placeholder) and put it on PATH; or drop --compile: the output holds "
            "everything needed, and DIR/<neuron target>/scripts/compile.sh compiles it on a host "
            "with the compiler",
        )
    return version


def compile_targets(
    entries: list[dict[str, Any]],
    targets: list[Target],
    root: Path,
    out: Path,
    progress: Progress,
    *,
    version: str,
    jobs: int | None,
) -> CompileOutcome:
    """Compile the neuron targets among `entries` (manifest target records, written under
    `root`, which becomes `out`); add `compile` to each and refresh its `files`."""
    from ..backends.neuron.compile import COMPILER, compile_all, default_jobs, find_programs

    errors: list[str] = []
    for entry, target in zip(entries, targets, strict=True):
        if target.backend not in COMPILED_BACKENDS:
            continue
        folder = root / entry["dir"]
        workers = jobs or default_jobs(len(find_programs(folder)))
        with progress.stage(f"compile:{target}", f"compiling {target} with {COMPILER} {version}"):
            results = compile_all(folder, jobs=workers)
        base = root.resolve()
        entry["compile"] = {
            "compiler": COMPILER,
            "version": version,
            "jobs": workers,
            "ok": all(r.ok for r in results),
            "programs": [_final_paths(r.to_json(base), base, out) for r in results],
        }
        entry["files"] = file_records(root, folder)
        for record in entry["compile"]["programs"]:
            status = "ok" if record["status"] == "pass" else record["status"]
            progress.note(f"{record['program']}: {status} ({record['seconds']:.1f}s)")
            if record["error"]:
                errors.append(f"{target}: {record['error']}")
    return CompileOutcome(not errors, errors)


def _final_paths(record: dict[str, Any], staging: Path, out: Path) -> dict[str, Any]:
    """Error messages were produced in the staging directory; name the final DIR instead."""
    if record["error"]:
        record["error"] = record["error"].replace(str(staging), str(out))
    return record
