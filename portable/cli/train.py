"""`portable train SPEC --data DATA --steps N --out RUN [...]` and `portable drill ... --kill
RANK@STEP [--signal KILL|STOP]`: a training job on one fleet's engine (portable/jobs/).

The flags map one to one to `portable.jobs.JobConfig` fields (docs/training-jobs.md); `portable
drill` takes the same ones plus the fault, runs the job under torchrun's elastic restarts with
that rank killed or stopped at that step, runs the uninterrupted job beside it, and writes
RUN/drill.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..errors import JobError
from ..jobs.config import HealthPolicy, JobConfig
from ..jobs.drill import drill as drill_job
from ..jobs.fault import parse_fault
from ..jobs.launch import train
from .exit_codes import EPILOG, ExitCode

__all__ = ["add_parsers", "config_from_args"]


def add_parsers(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "train",
        parents=parents,
        help="run a training job: data, checkpoints, metrics, on the cpu/xla/cuda/neuron engine",
        description="Capture SPEC's training step on DATA's batches, partition it by PLAN and "
        "run N steps on ENGINE (cpu: torchrun + gloo; cuda: torchrun + NCCL; xla/neuron: one "
        "JAX controller), writing RUN/metrics.jsonl, RUN/checkpoints/step-<N>/ (DCP) and "
        "RUN/job.json. --resume continues from RUN's latest complete checkpoint under any plan "
        "or engine.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _job_arguments(p)
    p.set_defaults(run=run_train)
    d = sub.add_parser(
        "drill",
        parents=parents,
        help="failure drill: kill or stop a rank mid-job, recover from checkpoint, measure it",
        description="Run SPEC's job under torchrun's elastic restarts with rank RANK killed "
        "(--signal KILL) or frozen (--signal STOP) at step STEP, and the same job "
        "uninterrupted in RUN/baseline; write RUN/drill.json: detection, restart, reload and "
        "recompile times, steps lost, recovery time, and whether the recovered job matches.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _job_arguments(d)
    d.add_argument("--kill", required=True, metavar="RANK@STEP", help="e.g. 1@120")
    d.add_argument("--signal", choices=("KILL", "STOP"), default="KILL")
    d.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="RUN",
        help="an uninterrupted run of the same job to compare with (default: run one)",
    )
    d.set_defaults(run=run_drill)


def _job_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="file.py:Name, pkg.module:Name, or an archive")
    p.add_argument("--data", required=True, metavar="DATA", help="token file (.bin/.npy)")
    p.add_argument("--steps", type=int, required=True, metavar="N")
    p.add_argument("--out", "-o", required=True, metavar="RUN", help="the job's folder")
    p.add_argument("--plan", default=None, metavar="PLAN", help="plan.json or file.py:attr")
    p.add_argument("--nproc", type=int, default=1, metavar="P", help="torch.distributed ranks")
    p.add_argument("--engine", choices=("cpu", "xla", "cuda", "neuron"), default="cpu")
    p.add_argument("--ckpt-every", type=int, default=None, metavar="K")
    p.add_argument("--ckpt-async", action="store_true", help="write checkpoints while training")
    p.add_argument("--keep", type=int, default=None, metavar="K", help="keep the last K")
    p.add_argument("--resume", action="store_true", help="continue RUN's latest checkpoint")
    p.add_argument("--resume-from", default=None, metavar="CKPT", help="another run's step")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="data order and dropout")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default=None, help="of a .bin file")
    p.add_argument("--batch", type=int, default=None, metavar="B", help="global batch")
    p.add_argument("--seq", type=int, default=None, metavar="S", help="tokens per sample")
    p.add_argument("--eval-data", default=None, metavar="FILE")
    p.add_argument("--eval-every", type=int, default=None, metavar="K")
    p.add_argument("--eval-batches", type=int, default=4, metavar="N")
    p.add_argument("--target-loss", type=float, default=None, metavar="L")
    p.add_argument("--price-per-hour", type=float, default=None, metavar="USD")
    p.add_argument("--init-from", default=None, metavar="HF_DIR", help="save_pretrained folder")
    p.add_argument("--trace-steps", default="", metavar="K,K", help="steps to trace (Chrome)")
    p.add_argument("--on-nonfinite", choices=("stop", "skip", "rollback"), default="stop")
    p.add_argument("--on-spike", choices=("stop", "skip", "rollback"), default="stop")
    p.add_argument("--spike-factor", type=float, default=None, metavar="F")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="silent-rank limit")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R")
    p.add_argument("--json", action="store_true", help="print one JSON document to stdout")
    p.add_argument("--quiet", "-q", action="store_true", help="no job output on the terminal")


def config_from_args(args: argparse.Namespace, **changes: Any) -> Any:

    try:
        trace = tuple(int(s) for s in args.trace_steps.split(",") if s.strip())
    except ValueError as exc:
        raise JobError(f"--trace-steps {args.trace_steps!r}", fix="e.g. --trace-steps 3,4") from exc
    health = HealthPolicy(
        on_nonfinite=args.on_nonfinite, on_spike=args.on_spike, spike_factor=args.spike_factor
    )
    fields: dict[str, Any] = {
        "spec": args.spec,
        "data": args.data,
        "steps": args.steps,
        "out": str(args.out),
        "plan": args.plan,
        "nproc": args.nproc,
        "engine": args.engine,
        "ckpt_every": args.ckpt_every,
        "ckpt_async": args.ckpt_async,
        "keep": args.keep,
        "resume": args.resume,
        "resume_from": args.resume_from,
        "seed": args.seed,
        "data_dtype": args.dtype,
        "batch": args.batch,
        "seq": args.seq,
        "eval_data": args.eval_data,
        "eval_every": args.eval_every,
        "eval_batches": args.eval_batches,
        "target_loss": args.target_loss,
        "price_per_hour": args.price_per_hour,
        "init_from": args.init_from,
        "trace_steps": trace,
        "health": health,
        "timeout_s": args.timeout,
        "max_restarts": args.max_restarts,
    }
    fields.update(changes)
    return JobConfig(**fields)


def run_train(args: argparse.Namespace) -> int:
    result = train(config_from_args(args), quiet=args.quiet or args.json)
    summary = result.summary
    if args.json:
        print(json.dumps({"status": "ok", "exit_code": 0, "run": str(result.run), **summary}))
        return ExitCode.OK
    mean = _steady_mean([m["tokens_per_s"] for m in result.metrics])
    first = result.metrics[0]["step"] if result.metrics else summary["steps"]
    span = f"steps {first}-{summary['steps']}" if first > 1 else f"{summary['steps']} steps"
    print(
        f"trained {span} on {summary['engine']} "
        f"({summary['device']['count']} device(s)): final loss {summary['final_loss']:.6f}, "
        f"{mean:,.0f} tokens/s, wrote {result.run}"
    )
    return ExitCode.OK


def run_drill(args: argparse.Namespace) -> int:
    fault = parse_fault(args.kill, args.signal)
    report = drill_job(config_from_args(args), fault, baseline=args.baseline, quiet=True)
    if args.json:
        print(json.dumps({"status": "ok", "exit_code": 0, **report}))
        return ExitCode.OK
    rows = [f"  {k}: {v}" for k, v in report.items() if not isinstance(v, dict | list)]
    print(f"drill {fault} on {args.engine}: wrote {Path(args.out) / 'drill.json'}")
    print("\n".join(rows))
    return ExitCode.OK if report["matches_uninterrupted"] else ExitCode.PARITY_MISMATCH


def _steady_mean(values: list[Any]) -> float:
    numbers = [v for v in values if isinstance(v, int | float)]
    steady = numbers[2:] or numbers
    return sum(steady) / len(steady) if steady else 0.0
