"""`portable lower SPEC --target T ... --out DIR`: capture (or load), apply passes, save, lower.

Stages: capture/load -> passes -> save `DIR/program.portable` -> lower and write each target into
`DIR/<target with ':' -> '_'>/` -> with `--compile`, each target's toolchain (`Backend.compile`,
compiling.py) -> optional parity against cpu -> `DIR/manifest.json`. Nothing here names a
backend or a pass: what differs between them is in their capabilities, options and reports. Everything is
written into a temporary directory beside DIR and renamed into place at the end (output.py), so a
failure at any stage leaves DIR as it was. Targets and passes are checked before capture starts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..backends import Backend, Target, Written, backend_for, get_backend, registry
from ..errors import BackendError
from ..ir.program import Program, ProgramKind
from .compiling import CompileOutcome, compile_targets, require_toolchains
from .exit_codes import EPILOG, ExitCode
from .load_spec import Source, load_plan, resolve, with_plan
from .manifest import FORMAT, FORMAT_VERSION, file_records, toolchain, write_manifest
from .output import check_destination, staging
from .parity import ParityOutcome, run_parity
from .progress import Progress
from .table import format_bytes, format_table

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..passes import Pass, PassReport

__all__ = ["ARCHIVE", "add_parser", "run", "target_dir"]

ARCHIVE = "program.portable"


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "lower",
        parents=parents,
        help="capture a model (or load an archive), apply passes and lower it for targets",
        description="Capture SPEC (or load an archive), apply passes, save DIR/program.portable, "
        "lower it for each target into DIR/<target>/ and write DIR/manifest.json. DIR appears "
        "complete or not at all; foreign content is never overwritten.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "spec", metavar="SPEC", help="file.py:Name, pkg.module:Name, or an archive directory"
    )
    p.add_argument(
        "--target",
        "-t",
        action="append",
        required=True,
        metavar="T",
        help="backend[:variant][{options}] (`cuda{aot=true}`), repeatable; `all` = every "
        "registered backend",
    )
    p.add_argument(
        "--pass",
        "-p",
        dest="passes",
        action="append",
        default=[],
        metavar="P",
        help="pass or comma pipeline (`dce,canonicalize{k=v}`), repeatable, applied in order",
    )
    p.add_argument("--out", "-o", required=True, type=Path, metavar="DIR", help="output directory")
    p.add_argument(
        "--train", action="store_true", help="capture the training step (default: inference)"
    )
    p.add_argument(
        "--plan",
        default=None,
        metavar="PLAN",
        help="parallelism plan (plan.json or file.py:attr) attached before the passes; "
        "`-p spmd-partition` then makes the per-rank program",
    )
    p.add_argument(
        "--parity",
        action="store_true",
        help="compare the targets that run here against cpu on the example inputs",
    )
    p.add_argument("--rtol", type=float, default=None, help="parity relative tolerance")
    p.add_argument("--atol", type=float, default=None, help="parity absolute tolerance")
    p.add_argument(
        "--compile",
        action="store_true",
        help="run each target's toolchain on its programs (neuron: neuronx-cc, needed on PATH; "
        "exit 7 if not)",
    )
    p.add_argument(
        "--compile-jobs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="compilers run at once with --compile (default: one per program, at most one per CPU)",
    )
    p.add_argument(
        "--aot",
        action="store_true",
        help="set the `aot` option of the targets whose backend has one (cuda: also write an "
        "AOTInductor package; needs a CUDA device here)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace an earlier `portable lower` output in DIR"
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON document (status + manifest) to stdout"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no stage lines on stderr")
    p.set_defaults(run=run)


def target_dir(target: Target) -> str:
    """The folder name of a target's artifacts: `neuron:trn3` -> `neuron_trn3` (every character
    other than letters, digits, `.`, `_` and `-` becomes `_`, so a target never names a path).
    A backend that lowers several variants together writes one folder named after it
    (`cuda:sm_90,sm_100` -> `cuda`, with a folder per arch inside)."""
    if _combines(target.backend):
        return target.backend
    return re.sub(r"[^A-Za-z0-9._-]", "_", str(target))


def _combines(backend: str) -> bool:
    if backend not in registry.names():
        return False
    return get_backend(backend).capabilities().combines_variants


def run(args: argparse.Namespace) -> int:
    targets = parse_targets(args.target, training=args.train)
    backends = _backends(args, targets)
    passes = _parse_passes(args.passes)
    toolchains = require_toolchains(targets, backends) if args.compile else {}
    check_destination(args.out, force=args.force)  # fail before a long capture, again at commit
    plan = load_plan(args.plan) if args.plan else None
    source = resolve(args.spec)
    total = 2 + bool(passes) + len(targets) + len(toolchains) + bool(args.parity)
    progress = Progress(total, enabled=not (args.quiet or args.json))
    with staging(args.out, force=args.force) as tmp:
        verb = "loading" if source.archive is not None else "capturing"
        with progress.stage("capture" if source.spec else "load", f"{verb} {source.name}"):
            program = source.program(training=args.train)
            if plan is not None:
                program = with_plan(program, plan)
        applied: list[dict[str, Any]] = []
        if passes:
            program, applied = _apply_passes(program, passes, progress, source, args.train)
        with progress.stage("save", f"saving {ARCHIVE}"):
            program.save(tmp / ARCHIVE)
        written = [_lower_one(program, t, backends[t], tmp, progress) for t in targets]
        lowered = [entry for entry, _ in written]
        compiled = None
        if toolchains:
            compiled = compile_targets(
                lowered,
                [w for _, w in written],
                targets,
                backends,
                toolchains,
                progress,
                root=tmp,
                out=args.out,
                jobs=args.compile_jobs,
            )
        parity = None
        if args.parity:
            with progress.stage("parity", "checking parity against cpu"):
                parity = run_parity(
                    program,
                    source,
                    targets,
                    rtol=args.rtol,
                    atol=args.atol,
                    compare_eager=all(p.preserves_numerics for p in passes),
                )
        manifest = _manifest(args, source, program, tmp, applied, lowered, parity, progress)
        write_manifest(tmp, manifest)
    code = ExitCode.OK if parity is None or parity.ok else ExitCode.PARITY_MISMATCH
    if compiled is not None and not compiled.ok:
        code = ExitCode.COMPILE_FAILED
    _print_result(args, manifest, parity, code, compiled)
    return code


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_targets(texts: list[str], *, training: bool = False) -> list[Target]:
    """Expand `all` (every registered backend that takes the program's kind: with `training`,
    those that lower training steps), parse, check each backend is registered (RegistryError
    listing them) and usable here (BackendError naming its missing packages and the
    `pip install` that adds them) with that variant (BackendError listing its variants), give
    a bare target its backend's default variant (`neuron` is `neuron:trn3`), and drop repeats
    (first wins)."""
    every = registry.names()
    if any(text.strip() == "all" for text in texts):
        for name in every:
            _require(name, listed_by_all=True)
    if training:
        kind = ProgramKind.TRAINING_STEP
        every = [n for n in every if kind in get_backend(n).capabilities().program_kinds]
    names = [n for text in texts for n in (every if text.strip() == "all" else [text])]
    targets = [Target.parse(n) for n in names]
    for target in targets:
        _require(target.backend)
        get_backend(target.backend).check_target(target)  # unknown variants, before capture
    return _combine_variants(list(dict.fromkeys(_with_default_variant(t) for t in targets)))


def _require(name: str, *, listed_by_all: bool = False) -> None:
    """RegistryError for an unknown backend; BackendError for one whose packages are missing
    (for `all`, the fix also offers naming the usable targets instead)."""
    try:
        get_backend(name).require()
    except BackendError as exc:
        if not listed_by_all:
            raise
        usable = [n for n in registry.names() if not get_backend(n).missing()]
        raise BackendError(
            exc.what,
            fix=f"{exc.fix}; or name the targets instead of `all` (usable here: "
            f"{', '.join(usable)})",
        ) from None


def _with_default_variant(target: Target) -> Target:
    """A bare target as its backend's default variant (`neuron` -> `neuron:trn3`), so its folder
    and manifest name the variant it was lowered for."""
    caps = get_backend(target.backend).capabilities()
    if target.variant is None and caps.default_variant and not caps.combines_variants:
        return target.with_variant(caps.default_variant)
    return target


def _combine_variants(targets: list[Target]) -> list[Target]:
    """`cuda:sm_90`, `cuda:sm_100` -> one `cuda:sm_90,sm_100` (at the first one's place) for
    backends that lower several variants at once; a bare `cuda` means all of its variants."""
    out: list[Target] = []
    merged: dict[str, int] = {}
    for target in targets:
        if not _combines(target.backend):
            out.append(target)
            continue
        if target.backend not in merged:
            merged[target.backend] = len(out)
            out.append(target)
            continue
        i = merged[target.backend]
        have = out[i].variant
        if have is None or target.variant is None:
            out[i] = out[i].with_variant(None)
        else:
            variants = dict.fromkeys(have.split(",") + target.variant.split(","))
            out[i] = out[i].with_variant(",".join(variants))
    return out


def _backends(args: argparse.Namespace, targets: list[Target]) -> dict[Target, Backend]:
    """Each target's backend, built with the options of its string and of the flags that set
    options (`--aot`: `aot=true` where the backend has that option), each checked against this
    machine (`check_options`) before a long capture."""
    given: dict[str, Any] = {"aot": True} if args.aot else {}
    if args.aot:
        _check_aot(targets)
    backends = {t: backend_for(t, **given) for t in targets}
    for backend in backends.values():
        backend.check_options()
    return backends


def _check_aot(targets: list[Target]) -> None:
    """--aot with no target whose backend has an `aot` option was a mistake: say which
    backends have it."""
    if any("aot" in registry.get(t.backend).option_names() for t in targets):
        return
    having = [n for n in registry.names() if "aot" in registry.get(n).option_names()]
    raise BackendError(
        f"--aot writes AOTInductor packages for {' or '.join(having) or 'no'} targets; "
        "none was given",
        fix=f"add --target {having[0] if having else 'T'} (or drop --aot)",
    )


def _parse_passes(texts: list[str]) -> list[Pass]:
    if not texts:
        return []
    from ..passes import parse_pipeline

    return [p for text in texts for p in parse_pipeline(text)]


def _apply_passes(
    program: Program,
    passes: list[Pass],
    progress: Progress,
    source: Source | None = None,
    training: bool = False,
) -> tuple[Program, list[dict[str, Any]]]:
    """Apply the passes in order; one manifest record per pass. Each pass then measures what it
    can on the spec's example inputs (the batch with --train; none for an archive):
    `Pass.measure`'s lines and tables are printed under its summary and its fields join the
    record."""
    from ..passes import PassManager

    applied, lines = [], []
    inputs = _example_inputs(source, training)
    with progress.stage("passes", f"applying {len(passes)} pass(es)"):
        for p in passes:
            program, (report,) = PassManager([p]).run(program)
            report = p.measure(program, report, inputs)
            applied.append({"spec": p.spec(), **report.to_json(), **report.record})
            lines += [report.summary(), *_details(report)]
    progress.note("\n".join(lines))
    return program, applied


def _example_inputs(source: Source | None, training: bool) -> Callable[[], Any] | None:
    """The spec's example inputs, made when a pass asks for them (None for an archive)."""
    spec = source.spec if source is not None else None
    if spec is None:
        return None
    return spec.batch if training else spec.inputs


def _details(report: PassReport) -> list[str]:
    """The report's lines and tables, indented under its summary line."""
    out = [f"  {line}" for line in report.lines]
    for table in report.tables:
        out += format_table(list(table.header), list(table.rows), indent="  ").splitlines()
    return out


def _lower_one(
    program: Program, target: Target, backend: Backend, root: Path, progress: Progress
) -> tuple[dict[str, Any], Written]:
    """Lower and write one target into its folder; its manifest entry and what was written."""
    folder = root / target_dir(target)
    folder.mkdir()
    with progress.stage(f"lower:{target}", f"lowering for {target}"):
        lowered = backend.lower(program, Target(target.backend, target.variant))
        written = backend.write(lowered, folder)
    if lowered.report:  # the backend's decisions (neuron: each MX GEMM)
        progress.note(lowered.report)
    ok, why = backend.can_execute_here()
    entry = {
        "target": str(target),
        "dir": folder.name,
        "can_execute_here": ok,
        "reason": why or None,
        "files": file_records(root, folder),
        "compile": None,  # lower --compile: compiling.py
    }
    return entry, written


def _manifest(
    args: argparse.Namespace,
    source: Source,
    program: Program,
    root: Path,
    applied: list[dict[str, Any]],
    lowered: list[dict[str, Any]],
    parity: ParityOutcome | None,
    progress: Progress,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tool": {"name": "portable", "version": __version__},
        "toolchain": toolchain(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": ["portable", *args.argv],
        "source": {
            "spec": source.text,
            "kind": "archive" if source.archive is not None else "spec",
        },
        "program": {
            "name": program.name,
            "kind": program.kind.value,
            "content_hash": program.content_hash,
            "opset_version": program.opset_version,
            "archive": ARCHIVE,
            "files": file_records(root, root / ARCHIVE),
        },
        "passes": applied,
        "targets": lowered,
        "timings": dict(progress.timings),
        "parity": parity.record if parity is not None else None,
    }


_STATUS = {
    ExitCode.OK: "ok",
    ExitCode.PARITY_MISMATCH: "parity_mismatch",
    ExitCode.COMPILE_FAILED: "compile_failed",
}


def _print_result(
    args: argparse.Namespace,
    manifest: dict[str, Any],
    parity: ParityOutcome | None,
    code: int,
    compiled: CompileOutcome | None,
) -> None:
    for error in compiled.errors if compiled is not None else []:
        print(f"error: {error}", file=sys.stderr)
    if args.json:
        status = _STATUS[ExitCode(code)]
        doc = {
            "status": status,
            "exit_code": int(code),
            "out_dir": str(args.out),
            "manifest": manifest,
        }
        print(json.dumps(doc, indent=2))
        return
    prog = manifest["program"]
    print(
        f"wrote {args.out}: {prog['name']} ({prog['kind']}, opset {prog['opset_version']}, "
        f"hash {prog['content_hash'][:16]})"
    )
    for name, files in [(ARCHIVE, prog["files"])] + [
        (t["dir"] + "/", t["files"]) for t in manifest["targets"]
    ]:
        size = sum(f["size"] for f in files)
        print(f"  {name:<20} {len(files)} file(s), {format_bytes(size)}")
    for target in manifest["targets"]:
        if target.get("compile"):
            programs = target["compile"]["programs"]
            passed = sum(p["status"] == "pass" for p in programs)
            print(f"  compiled {target['target']}: {passed}/{len(programs)} program(s) passed")
    if parity is not None:
        print(parity.text, end="")
