"""Start N ranks of a per-rank program with torch's launcher on this machine.

A *run directory* is what every rank reads (written by `prepare`, read by the worker):

    DIR/program.portable/    the per-rank program (a portable archive, with its `Program.spmd` layout;
                             its weights are the GLOBAL initial state)
    DIR/state.safetensors    optional: GLOBAL state by input placeholder name, used instead of
                             the archive's weights (e.g. a checkpoint)
    DIR/inputs.safetensors   GLOBAL user inputs (the batch), keyed by input placeholder name
    DIR/run.json             {"format": "portable-run-input", "format_version": 1, "steps": K}

`launch` runs torchrun (`torch.distributed.run`, through agent.py, which records how failed ranks
ended) with `-m portable.distributed.worker` on 127.0.0.1 with a free port (gloo on CPU, nccl when
CUDA is available), waits for it, and returns the results rank 0 wrote (`worker.py` documents the
output directory). The job is watched and ended whole (job.py): a rank that dies or makes no
progress for `timeout_s` ends it, and no process of it outlives it. A rank's PortableError is
raised again here with its type; any other failure as one RankFailedError that names the rank,
how it ended and the step it had reached (diagnosis.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from ..errors import InputError, PlanError, RegistryError
from ..ir.plan import Mesh, Plan
from ..ir.program import Program
from ..ir.spmd import SpmdLayout
from ..passes import registry
from ..passes.pipeline_split import split_stages
from .agent import read_failures
from .diagnosis import job_error, read_reports
from .job import Job

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "INPUT_FORMAT",
    "default_backend",
    "launch",
    "per_rank_program",
    "prepare",
]

INPUT_FORMAT = "portable-run-input"
INPUT_FORMAT_VERSION = 1
PROGRAM = "program.portable"
STATE = "state.safetensors"
INPUTS = "inputs.safetensors"
RUN = "run.json"
FAILURES = "failures.json"  # in the report folder: torchrun's per-rank failures (agent.py)

DEFAULT_TIMEOUT_S = 300.0  # seconds a rank may go without progress before the job is ended
STARTUP_MIN_S = 120.0  # a rank has at least this long to start (import torch) and beat once
SHUTDOWN_S = 3  # torchrun: SIGTERM to SIGKILL when it stops the other ranks of a failed job


def default_backend() -> str:
    """nccl when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def per_rank_program(program: Program) -> Program:
    """The per-rank program of `program` under its plan: the spmd-partition pass's output (found
    through the registry, as `-p` finds it), or, for a one-device plan, the program itself with a
    replicated layout. A pipelined step is partitioned over its plan's other axes (when it has
    any) and run as that per-rank step, carrying the whole plan: each rank cuts its stages from
    it (distributed/pipeline.py). It is cut here once first, so a step that cannot be cut fails
    before any process starts."""

    try:
        partition = registry.get("spmd-partition")
    except RegistryError as exc:
        raise PlanError(
            "the spmd-partition pass is not available in this installation",
            fix="install a portable version with portable.passes.spmd_partition",
        ) from exc
    if program.plan.pipeline is not None:
        plan = program.plan
        others = pipeline_free(plan)
        if others.mesh is not None and others.mesh.size > 1:
            # the other axes first: the per-rank step over them, then its stages
            per_rank = partition().apply(program.replace(plan=others)).program
            program = per_rank.replace(plan=plan)
        split_stages(program)
        return program
    if program.plan.is_single_device:
        mesh = program.plan.mesh or Mesh({})
        return program.replace(spmd=SpmdLayout.replicated(program.signature, mesh))
    return partition().apply(program).program


def pipeline_free(plan: Plan) -> Plan:
    """`plan` without its pipeline: the mesh of its other axes, the same rules and axes."""
    assert plan.pipeline is not None and plan.mesh is not None
    axis = plan.pipeline.axis
    mesh = Mesh([(name, size) for name, size in plan.mesh.axes if name != axis])
    return dataclasses.replace(plan, mesh=mesh if mesh.axes else None, pipeline=None)


def prepare(
    per_rank: Program,
    inputs: Mapping[str, torch.Tensor],
    directory: str | os.PathLike[str],
    *,
    state: Mapping[str, torch.Tensor] | None = None,
    steps: int = 1,
) -> Path:
    """Write a run directory: the per-rank program and the GLOBAL inputs (by placeholder name);
    `state` (GLOBAL, by placeholder name) replaces the program's own weights when given."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    per_rank.save(root / PROGRAM)
    if state is not None:
        safetensors.torch.save_file(_savable(state), root / STATE)
    safetensors.torch.save_file(_savable(inputs), root / INPUTS)
    doc = {"format": INPUT_FORMAT, "format_version": INPUT_FORMAT_VERSION, "steps": steps}
    (root / RUN).write_text(json.dumps(doc, indent=2) + "\n")
    return root


def launch(
    run_dir: str | os.PathLike[str],
    nproc: int,
    out: str | os.PathLike[str],
    *,
    steps: int | None = None,
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    quiet: bool = True,
) -> dict[str, Any]:
    """Run the per-rank program of `run_dir` on `nproc` local processes; return results.json.

    Rank 0 writes `out` (atomically). A rank that dies, or that makes no progress for
    `timeout_s` seconds (a collective waiting that long for its peers, or no heartbeat: a stopped
    or wedged process), ends the job in about that time, and every process of the job ends with
    it (job.py). Raises the PortableError a rank failed with, or RankFailedError naming the
    rank, how it ended (exit status, signal, silence) and the step it had reached."""
    if not timeout_s > 0:
        raise InputError(f"timeout_s must be positive, got {timeout_s}")
    backend = backend or default_backend()
    with tempfile.TemporaryDirectory(prefix="portable-run-report-") as folder:
        report = Path(folder)
        cmd = _command(Path(run_dir), nproc, Path(out), report, steps, backend, timeout_s)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        job = Job(
            cmd,
            report,
            nproc=nproc,
            env=env,
            timeout_s=timeout_s,
            startup_s=max(timeout_s, STARTUP_MIN_S),
            capture_output=quiet,
        )
        with job:
            outcome = job.wait()
        failures = read_failures(report / FAILURES)
        error = job_error(nproc, outcome, failures, read_reports(report), timeout_s=timeout_s)
        if error is not None:
            raise error
    return json.loads((Path(out) / "results.json").read_text())


def _command(
    run_dir: Path,
    nproc: int,
    out: Path,
    report: Path,
    steps: int | None,
    backend: str,
    timeout_s: float,
) -> list[str]:
    """torchrun (through agent.py, which records how failed ranks ended) running the worker."""
    agent = [sys.executable, "-m", "portable.distributed.agent", str(report / FAILURES)]
    torchrun = [
        *("--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts", "0"),
        *("--master-addr", "127.0.0.1", "--master-port", str(free_port())),
        *("--shutdown-timeout", str(SHUTDOWN_S), "--log-dir", str(report / "torchrun")),
    ]
    worker = ["-m", "portable.distributed.worker", "--program", str(run_dir), "--out", str(out)]
    worker += ["--backend", backend, "--report", str(report), "--timeout", f"{timeout_s:g}"]
    if steps is not None:
        worker += ["--steps", str(steps)]
    return [*agent, str(os.getpid()), *torchrun, *worker]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _savable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU contiguous tensors with a storage each (safetensors refuses shared memory)."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}


def read_global(
    path: Path, program: Program, *, state: bool, layout: SpmdLayout | None = None
) -> dict[str, torch.Tensor]:
    """The GLOBAL value of every state (or user) input by placeholder name: from `path` (a
    safetensors file written by launch.prepare), or the archive's weights for state when there
    is none; each checked against its global shape (the layout's, else the signature's)."""
    specs = program.signature.state_inputs if state else program.signature.user_inputs
    if state and not path.is_file():  # the archive's weights are the GLOBAL state
        tensors = {s.name: program.weights[s.key] for s in specs}
    else:
        tensors = safetensors.torch.load_file(path) if specs else {}
    out = {}
    for spec in specs:
        if spec.name not in tensors:
            raise InputError(
                f"{path.name} has no value for input `{spec.name}`",
                fix="write every input placeholder's GLOBAL value (launch.prepare does)",
            )
        value = tensors[spec.name]
        want = list(layout.input(spec.name).global_shape if layout else spec.spec.shape)
        if list(value.shape) != want:
            raise InputError(
                f"input `{spec.name}`: GLOBAL shape {list(value.shape)} in {path.name}, but the "
                f"program expects {want}",
                fix="pass the global value the program was captured with",
            )
        out[spec.name] = value
    return out
