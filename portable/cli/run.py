"""`portable run SPEC --nproc N [--steps K] [--plan PLAN] [--out DIR] [--json]`: a smoke test
of a per-rank program (training jobs are `portable train`, portable/cli/train.py).

Runs a model on N local processes with torch.distributed (gloo on CPU, nccl with CUDA):
1. SPEC and PLAN are resolved and `plan.check_world_size(N)` is checked; nothing has started;
2. the training step (the spec has a loss_fn; `--inference` for one forward call) is captured
   on this process, or the archive is loaded, and the plan attached;
3. the spmd-partition pass makes the per-rank program; it and the GLOBAL state and inputs are
   saved in a temporary run directory (portable/distributed/launch.py);
4. torch's launcher starts N workers (portable/distributed/worker.py) that shard, run K steps
   and gather; rank 0 writes the results: DIR/results.json (losses, ...) and
   DIR/state.safetensors (final GLOBAL state) or DIR/outputs.safetensors (inference).
   A rank that dies, or makes no progress for --timeout seconds, ends the job with every process
   of it, and the error names the rank, how it ended and the step it had reached
   (portable/distributed/job.py, diagnosis.py).

PLAN is a JSON file in `Plan.to_json()` form, or `file.py:attr` naming a Plan or a zero-argument
callable returning one; default: the spec's (or archive's) own plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CaptureError, InputError
from ..ir.plan import Plan
from ..ir.program import Program, ProgramKind
from .exit_codes import EPILOG, ExitCode, OutputConflictError
from .load_spec import Source, load_plan, resolve, with_plan
from .progress import Progress
from .table import format_table

if TYPE_CHECKING:
    import torch

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "run",
        parents=parents,
        help="smoke-test a per-rank program (inference, or steps on the example batch) on N "
        "processes; training jobs: portable train",
        description="Capture SPEC, partition it by PLAN into a per-rank program and run it on "
        "N local processes (torch.distributed: gloo on CPU, nccl with CUDA): one inference call, "
        "or K training steps on the spec's example batch. Prints the loss of each step; with "
        "--out writes DIR/results.json and the final GLOBAL state. For a training job (real "
        "data, checkpoints, resume, metrics) use `portable train`.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spec", metavar="SPEC", help="file.py:Name, pkg.module:Name, or an archive")
    p.add_argument("--nproc", type=_positive_int, required=True, metavar="N", help="processes")
    p.add_argument("--steps", type=_positive_int, default=1, metavar="K", help="training steps")
    p.add_argument(
        "--plan",
        default=None,
        metavar="PLAN",
        help="plan.json (Plan.to_json form) or file.py:attr (a Plan or a callable returning one)",
    )
    p.add_argument("--inference", action="store_true", help="run one forward call, not training")
    p.add_argument(
        "--inputs",
        type=Path,
        default=None,
        metavar="FILE",
        help="safetensors of GLOBAL inputs by input name (default: the spec's examples)",
    )
    p.add_argument("--out", "-o", type=Path, default=None, metavar="DIR", help="results folder")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: auto")
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="seconds a rank may go without progress (a collective waiting for the others, or "
        "no heartbeat: a stopped or wedged process) before the job is ended (default 300)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document to stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no stage lines on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..distributed.launch import launch, per_rank_program, prepare

    source = resolve(args.spec)
    plan = load_plan(args.plan) if args.plan is not None else _own_plan(source)
    plan.check_world_size(args.nproc, "portable run --nproc")  # before anything starts
    _check_out(args.out)
    progress = Progress(5, enabled=not (args.quiet or args.json))
    training = not args.inference
    if training and args.steps > 1 and not (args.quiet or args.json):
        print(
            "note: portable run repeats the example batch and keeps nothing until the end; "
            "for a training job use portable train (data, checkpoints, resume, metrics)",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory(prefix="portable-run-") as tmp:
        with progress.stage("capture", f"capturing {source.name}"):
            program = with_plan(_program(source, training, plan), plan)
        with progress.stage("partition", f"partitioning for {_mesh_text(plan)}"):
            per_rank = per_rank_program(program)
        with progress.stage("save", "saving the per-rank program and global inputs"):
            inputs = _global_inputs(source, program, args.inputs, training)
            run_dir = prepare(per_rank, inputs, Path(tmp) / "run", steps=args.steps)
        out = args.out if args.out is not None else Path(tmp) / "out"
        with progress.stage("launch", f"running {args.nproc} process(es)"):
            results = launch(
                run_dir,
                args.nproc,
                out,
                steps=args.steps,
                backend=args.backend,
                timeout_s=args.timeout,
                quiet=args.json or args.quiet,
            )
        with progress.stage("report", "reading results"):
            doc = {"status": "ok", "exit_code": 0, "out_dir": str(args.out) if args.out else None}
            doc["results"] = results
    _print(args, doc)
    return ExitCode.OK


def _own_plan(source: Source) -> Plan:
    if source.spec is not None:
        plan = source.spec.plan
        return plan if isinstance(plan, Plan) else Plan()
    from ..archive import load

    assert source.archive is not None  # resolve() gives a spec or an archive
    return load(source.archive).plan


def _program(source: Source, training: bool, plan: Plan) -> Program:
    if source.spec is not None:
        if training and not source.spec.trainable:
            raise CaptureError(
                f"`{source.spec.name}` has no loss_fn, so it has no training step",
                fix="pass --inference, or give @portable a loss_fn and example_batch",
            )
        return source.program(training=training, plan=plan)
    program = source.program(training=False)
    if training != (program.kind is ProgramKind.TRAINING_STEP):
        raise CaptureError(
            f"{source.archive} holds a {program.kind.value} program",
            fix="pass --inference for an inference archive (and leave it out for a training step)",
        )
    return program


def _global_inputs(
    source: Source, program: Program, path: Path | None, training: bool
) -> dict[str, torch.Tensor]:
    """The program's user inputs by name: from `path` (safetensors), else the spec's examples."""
    users = program.signature.user_inputs
    if path is not None:
        import safetensors.torch

        tensors = safetensors.torch.load_file(path)
        missing = [u.name for u in users if u.name not in tensors]
        if missing:
            raise InputError(
                f"{path} has no value for input(s) {', '.join(missing)}",
                fix=f"store every input by name: {', '.join(u.name for u in users)}",
            )
        return {u.name: tensors[u.name] for u in users}
    if source.spec is None:
        raise InputError(
            f"{source.archive} is an archive: it has no example inputs",
            fix="pass --inputs FILE.safetensors with the GLOBAL inputs by input name",
        )
    values = source.spec.batch() if training else source.spec.inputs()
    return {u.name: v for u, v in zip(users, values, strict=True)}


def _check_out(out: Path | None) -> None:
    if out is None or not out.exists():
        return
    if not out.is_dir() or any(out.iterdir()):
        raise OutputConflictError(
            f"{out} exists and is not an empty directory",
            fix="choose another --out, or move that directory away",
        )


def _mesh_text(plan: Plan) -> str:
    return " x ".join(f"{n}={s}" for n, s in plan.mesh.axes) if plan.mesh else "one device"


def _print(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    results = doc["results"]
    mesh = " x ".join(f"{k}={v}" for k, v in results["mesh"].items()) or "one device"
    print(
        f"ran {results['program']['name']} on {results['world_size']} process(es) "
        f"({results['backend']}, mesh {mesh})"
    )
    losses = results.get("losses") or []
    if losses:
        print(format_table(["step", "loss"], [(i + 1, f"{v:.6f}") for i, v in enumerate(losses)]))
    if args.out is not None:
        print(f"wrote {args.out}: {', '.join(results['files'].values())}")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
