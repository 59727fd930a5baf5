"""`train(config)`: prepare a job, run it under torchrun, and read what it wrote.

torchrun (through portable/distributed/agent.py) is the supervisor of every engine: it starts
`--nproc` ranks for cpu/cuda, or the one JAX controller for xla/neuron, and restarts them all
`max_restarts` times after a failure (the ranks resume from the last complete checkpoint
themselves). The launcher watches heartbeats (portable/distributed/job.py): a rank silent for
`timeout_s` (SIGSTOP, a wedged collective) is killed, which torchrun sees as a failure. Nothing
of a job outlives `train`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..distributed.agent import AGENT_EVENTS_ENV, read_failures
from ..distributed.diagnosis import job_error, read_reports
from ..distributed.job import Job
from ..distributed.launch import free_port
from ..errors import CheckpointError, JobError
from ..recipe import recipe_of
from ..safe_json import read_json
from .checkpoint import CheckpointStore
from .config import JobConfig
from .peaks import measure_cpu_peak
from .prepare import JOB_DIR, Prepared, check_identity, prepare_job, write_job
from .records import read_records

__all__ = ["TrainResult", "launch_job", "train"]

SHUTDOWN_S = 3  # torchrun: SIGTERM to SIGKILL when it stops the ranks of a failed attempt
STARTUP_MIN_S = 120.0  # a rank has at least this long to import torch and beat once


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a finished job left in RUN: its summary (RUN/job.json) and per-step metrics."""

    run: Path
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    wall_s: float

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]


def train(config: JobConfig, *, quiet: bool = True, source: Any = None) -> TrainResult:
    """Run the job `config` describes (see docs/training-jobs.md); returns when it ends.
    `source` (a `cli.load_spec.Source`) stands for `config.spec` when given."""
    run = Path(config.out)
    _check_out(run, config)
    prepared = prepare_job(config, source)
    _check_resumable(prepared, run)
    extra = {"resume_from": _resume_source(config), "epoch": _epoch(run, config)}
    extra["cpu_peak_flops"] = cpu_peak(prepared)
    write_job(prepared, run, extra)
    return launch_job(prepared, run, quiet=quiet)


def launch_job(
    prepared: Prepared,
    run: Path,
    *,
    quiet: bool = True,
    env: Mapping[str, str] | None = None,
) -> TrainResult:
    """Run the job written in RUN/.job under torchrun; raise the rank's error if it failed."""

    config = prepared.config
    processes = 1 if config.engine in ("xla", "neuron") else config.nproc
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="portable-train-report-") as folder:
        report = Path(folder)
        cmd = _command(run, report, processes, config)
        job = Job(
            cmd,
            report,
            nproc=processes,
            env=_environment(run, prepared, report, env),
            timeout_s=config.timeout_s,
            startup_s=max(config.timeout_s, STARTUP_MIN_S),
            capture_output=quiet,
        )
        with job:
            outcome = job.wait()
        hung = {r: dataclasses.asdict(h) for r, h in outcome.hung.items()}
        if hung:
            _append_hung(run, hung)
        if outcome.returncode != 0:
            failures = read_failures(report / "failures.json")
            error = job_error(
                processes, outcome, failures, read_reports(report), timeout_s=config.timeout_s
            )
            if error is not None:
                raise error
            raise JobError(f"the job ended with exit status {outcome.returncode}")
    return read_result(run, wall_s=time.time() - start)


def read_result(run: Path, *, wall_s: float = 0.0) -> TrainResult:
    doc = read_json(run / "job.json", JobError, fix="the job did not finish: see its events")
    if not isinstance(doc, dict) or not isinstance(doc.get("summary"), dict):
        raise JobError(f"{run / 'job.json'} has no summary", fix="re-run the job")
    return TrainResult(
        run,
        doc["summary"],
        read_records(run / "metrics.jsonl"),
        read_records(run / "events.jsonl"),
        wall_s,
    )


# --------------------------------------------------------------------------- helpers


def _check_out(run: Path, config: JobConfig) -> None:
    if not run.exists():
        return
    if not run.is_dir():
        raise JobError(f"--out {run} exists and is not a directory", fix="choose another --out")
    if config.resume:
        return
    if any(p.name != JOB_DIR for p in run.iterdir()):
        raise JobError(
            f"--out {run} holds an earlier job",
            fix="pass --resume to continue it, or choose another --out",
        )


def cpu_peak(prepared: Prepared) -> float:
    """The job's CPU peak FLOP/s, measured here before any rank runs (a rank measuring it
    itself would time its matmuls against its peers' and XLA's threads): cpu ranks run one
    thread each (OMP_NUM_THREADS=1), the xla/neuron controller every host thread."""
    import torch

    config = prepared.config
    compute = recipe_of(prepared.program.metadata).precision.compute_dtype
    if config.engine in ("xla", "neuron"):
        return measure_cpu_peak(compute)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_cpu_peak(compute) * config.nproc
    finally:
        torch.set_num_threads(threads)


def _check_resumable(prepared: Prepared, run: Path) -> None:
    """The checkpoint the job will resume from is one of this program (before any rank runs)."""
    config = prepared.config
    candidates = []
    if config.resume:
        candidates.append(CheckpointStore(run / "checkpoints").latest())
    source = _resume_source(config)
    if source is not None:
        candidates.append(CheckpointStore(Path(source).parent).verify(source))
    for checkpoint in candidates:
        if checkpoint is not None:
            check_identity(checkpoint, prepared.identity)


def _resume_source(config: JobConfig) -> str | None:
    """The checkpoint --resume-from names (a step-<N>/ folder, or a RUN: its latest)."""
    if config.resume_from is None:
        return None
    path = Path(config.resume_from)
    if (path / "checkpoints").is_dir():
        latest = CheckpointStore(path / "checkpoints").latest()
        if latest is None:
            raise CheckpointError(
                f"{path} has no complete checkpoint",
                fix="pass a run that saved one (--ckpt-every, or its last step)",
            )
        return str(latest.path.resolve())
    checkpoint = CheckpointStore(path.parent).verify(path)  # CheckpointError when it is not one
    return str(checkpoint.path.resolve())


def _epoch(run: Path, config: JobConfig) -> float:
    """The job's clock: kept from the earlier start when resuming in the same RUN."""
    if config.resume and (run / JOB_DIR / "job.json").is_file():
        try:
            doc = read_json(run / JOB_DIR / "job.json", JobError, fix="")
            if isinstance(doc.get("epoch"), int | float):
                return float(doc["epoch"])
        except JobError:
            pass
    return time.time()


def _command(run: Path, report: Path, processes: int, config: JobConfig) -> list[str]:

    agent = [sys.executable, "-m", "portable.distributed.agent", str(report / "failures.json")]
    torchrun = [
        *("--nnodes", "1", "--nproc-per-node", str(processes)),
        *("--max-restarts", str(config.max_restarts)),
        # c10d rendezvous: each restart is a fresh round (the static one reuses the first
        # attempt's store keys, so a restarted group would try to reach the dead ranks)
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"),
        *("--rdzv-id", f"portable-{os.getpid()}-{time.time_ns()}"),
        *("--shutdown-timeout", str(SHUTDOWN_S), "--log-dir", str(report / "torchrun")),
        *("--monitor-interval", "0.1"),
    ]
    worker = ["-m", "portable.jobs.worker", "--job-folder", str(run), "--report", str(report)]
    worker += ["--timeout", f"{config.timeout_s:g}"]
    return [*agent, str(os.getpid()), *torchrun, *worker]


def _environment(
    run: Path, prepared: Prepared, report: Path, extra: Mapping[str, str] | None
) -> dict[str, str]:

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cache = run / ".cache"
    env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    env.setdefault("PORTABLE_JAX_CACHE", str(cache / "jax"))
    if prepared.config.engine in ("xla", "neuron"):
        env.pop("OMP_NUM_THREADS", None)  # one controller: every host thread
        flags = env.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            flags += f" --xla_force_host_platform_device_count={max(prepared.world, 1)}"
        env["XLA_FLAGS"] = flags.strip()
    env[AGENT_EVENTS_ENV] = str(run / "restarts.jsonl")
    env.update(extra or {})
    return env


def _append_hung(run: Path, hung: Mapping[int, Any]) -> None:
    import json

    with (run / "hung.jsonl").open("a") as f:
        for rank, h in hung.items():
            f.write(json.dumps({"rank": rank, **{k: v for k, v in h.items() if k != "beat"}}))
            f.write("\n")
