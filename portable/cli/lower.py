"""`portable lower SPEC --target T ... --out DIR`: capture (or load), apply passes, save, lower.

Stages: capture/load -> passes -> save `DIR/program.portable` -> lower each target into
`DIR/<target with ':' -> '_'>/` -> with `--compile`, neuronx-cc on the neuron targets
(compiling.py) -> optional parity against cpu -> `DIR/manifest.json`. Everything is
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
from ..api import lower as lower_program
from ..backends import Target, get_backend, registry
from ..errors import BackendError
from ..ir.program import Program, ProgramKind
from .compiling import COMPILED_BACKENDS, CompileOutcome, compile_targets, require_compiler
from .exit_codes import EPILOG, ExitCode
from .load_spec import Source, load_plan, resolve, with_plan
from .manifest import FORMAT, FORMAT_VERSION, file_records, toolchain, write_manifest
from .output import check_destination, staging
from .parity import ParityOutcome, run_parity
from .progress import Progress
from .table import format_bytes

if TYPE_CHECKING:
    from ..passes import Pass

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
        help="backend[:variant], repeatable; `all` = every registered backend",
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
        help="run neuronx-cc on the neuron targets' programs (needs it on PATH; exit 7 if not)",
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
        help="cuda targets: also write an AOTInductor package (needs a CUDA device here)",
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
    _check_aot(args, targets)
    passes = _parse_passes(args.passes)
    compiler = require_compiler(targets) if args.compile else None
    check_destination(args.out, force=args.force)  # fail before a long capture, again at commit
    plan = load_plan(args.plan) if args.plan else None
    source = resolve(args.spec)
    to_compile = [t for t in targets if t.backend in COMPILED_BACKENDS] if compiler else []
    total = 2 + bool(passes) + len(targets) + len(to_compile) + bool(args.parity)
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
        lowered = [
            _lower_one(program, t, tmp, progress, _backend_options(args, t)) for t in targets
        ]
        compiled = None
        if compiler is not None:
            compiled = compile_targets(
                lowered, targets, tmp, args.out, progress, version=compiler, jobs=args.compile_jobs
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
        return Target(target.backend, caps.default_variant)
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
            out[i] = Target(target.backend, None)
        else:
            variants = dict.fromkeys(have.split(",") + target.variant.split(","))
            out[i] = Target(target.backend, ",".join(variants))
    return out


def _backend_options(args: argparse.Namespace, target: Target) -> object | None:
    if target.backend == "cuda" and args.aot:
        from ..backends.cuda import CudaOptions

        return CudaOptions(aot=True)
    return None


def _check_aot(args: argparse.Namespace, targets: list[Target]) -> None:
    """--aot needs a cuda target and a CUDA device: say so before a long capture."""
    if not args.aot:
        return
    import torch

    if not any(t.backend == "cuda" for t in targets):
        raise BackendError(
            "--aot writes AOTInductor packages for cuda targets; none was given",
            fix="add --target cuda (or drop --aot)",
        )
    if not torch.cuda.is_available():
        raise BackendError(
            "--aot compiles an AOTInductor package for the CUDA device present; this machine "
            "has none",
            fix="drop --aot here (the kernels' PTX/cubin and the .pt2 are written without it), "
            "or run the same command on a GPU machine",
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
    """Apply the passes in order; one manifest record per pass. After `mx-quantize`, the
    quantization error of each quantized operand is measured on the spec's example inputs (the
    batch with --train) and stored in the record as `layers` (None without examples)."""
    from ..passes import PassManager

    applied, lines = [], []
    with progress.stage("passes", f"applying {len(passes)} pass(es)"):
        for p in passes:
            program, (report,) = PassManager([p]).run(program)
            record = {"spec": p.spec(), **report.to_json()}
            lines.append(report.summary())
            if report.name == "mx-quantize":
                lines += [f"  {note}" for note in report.notes]
                if report.changed:
                    lines += _mx_error_table(program, record, source, training)
            applied.append(record)
    progress.note("\n".join(lines))
    return program, applied


def _mx_error_table(
    program: Program, record: dict[str, Any], source: Source | None, training: bool
) -> list[str]:
    """Fill `record["layers"]` with mx-quantize's per-operand SQNR; the table's lines."""
    from ..passes.mx_quantize import mx_error_report
    from .table import format_table

    if source is None or source.spec is None:
        record["layers"] = None
        return ["  SQNR not measured: an archive has no example inputs"]
    inputs = source.spec.batch() if training else source.spec.inputs()
    rows = mx_error_report(program, inputs)
    layers: dict[str, dict[str, Any]] = {}
    for row in rows:
        layer = layers.setdefault(
            row["module"], {"module": row["module"], "gemms": [], "operands": []}
        )
        if row["gemm"] not in layer["gemms"]:
            layer["gemms"].append(row["gemm"])
        layer["operands"].append({k: v for k, v in row.items() if k != "module"})
    record["layers"] = list(layers.values())
    cells = [(r["module"], r["gemm"], r["operand"], r["dim"], _db(r["sqnr_db"])) for r in rows]
    header = ["module", "GEMM", "operand", "dim", "SQNR dB"]
    return format_table(header, cells, indent="  ").splitlines()


def _db(value: float | None) -> str:
    return "exact" if value is None else f"{value:.1f}"


def _lower_one(
    program: Program, target: Target, root: Path, progress: Progress, options: object | None
) -> dict[str, Any]:
    folder = root / target_dir(target)
    folder.mkdir()
    with progress.stage(f"lower:{target}", f"lowering for {target}"):
        lower_program(program, str(target), folder, options)
    ok, why = get_backend(target.backend).can_execute_here()
    return {
        "target": str(target),
        "dir": folder.name,
        "can_execute_here": ok,
        "reason": why or None,
        "files": file_records(root, folder),
        "compile": None,  # lower --compile: compiling.py
    }


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
