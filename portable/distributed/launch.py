"""Start N ranks of a per-rank program with torch's launcher on this machine.

A *run directory* is what every rank reads (written by `prepare`, read by the worker):

    DIR/program.portable/    the per-rank program (a portable archive, with program.metadata["spmd"];
                             its weights are the GLOBAL initial state)
    DIR/state.safetensors    optional: GLOBAL state by input placeholder name, used instead of
                             the archive's weights (e.g. a checkpoint)
    DIR/inputs.safetensors   GLOBAL user inputs (the batch), keyed by input placeholder name
    DIR/run.json             {"format": "portable-run-input", "format_version": 1, "steps": K}

`launch` runs `python -m torch.distributed.run --nproc-per-node N ... -m portable.distributed.worker`
on 127.0.0.1 with a free port (gloo on CPU, nccl when CUDA is available), waits for it, and
returns the results rank 0 wrote (`worker.py` documents the output directory). A rank that fails
with a PortableError writes it to a report folder; `launch` raises it again here with its type.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from .. import errors
from ..errors import BackendError, PortableError
from ..ir.program import Program

__all__ = ["INPUT_FORMAT", "default_backend", "launch", "prepare"]

INPUT_FORMAT = "portable-run-input"
INPUT_FORMAT_VERSION = 1
PROGRAM = "program.portable"
STATE = "state.safetensors"
INPUTS = "inputs.safetensors"
RUN = "run.json"


def default_backend() -> str:
    """nccl when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


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
    timeout_s: float | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """Run the per-rank program of `run_dir` on `nproc` local processes; return results.json.

    Rank 0 writes `out` (atomically). Raises the PortableError a rank failed with, or
    BackendError when the launcher or a rank fails otherwise (with the tail of its output)."""
    backend = backend or default_backend()
    with tempfile.TemporaryDirectory(prefix="portable-run-report-") as report:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--max-restarts",
            "0",
            "-m",
            "portable.distributed.worker",
            "--program",
            str(run_dir),
            "--out",
            str(out),
            "--backend",
            backend,
            "--report",
            report,
        ]
        if steps is not None:
            cmd += ["--steps", str(steps)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            proc = subprocess.run(
                cmd,
                env=env,
                stdout=subprocess.PIPE if quiet else None,
                stderr=subprocess.STDOUT if quiet else None,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            raise BackendError(
                f"torch.distributed.run did not finish within {timeout_s:g}s",
                fix="raise the timeout, or look for a rank that hangs in a collective",
            ) from exc
        failure = _rank_failure(Path(report))
        if failure is not None:
            raise failure
        if proc.returncode != 0:
            tail = (proc.stdout or "")[-4000:]
            raise BackendError(
                f"torch.distributed.run exited with {proc.returncode}",
                details=tail or None,
                fix="run it again without --quiet/--json to see every rank's output",
            )
    return json.loads((Path(out) / "results.json").read_text())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_failure(report: Path, rank: int, exc: PortableError) -> None:
    """Record a rank's PortableError (type, fields) for the launcher to raise again."""
    doc = {
        "rank": rank,
        "type": type(exc).__name__,
        "what": exc.what,
        "fix": exc.fix,
        "op": exc.op,
        "details": exc.details,
    }
    tmp = report / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(report / f"rank{rank}.json")


def _rank_failure(report: Path) -> PortableError | None:
    files = sorted(report.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        return None
    doc = json.loads(files[0].read_text())
    from ..cli import exit_codes

    cls = getattr(errors, doc["type"], None) or getattr(exit_codes, doc["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, PortableError)):
        cls = PortableError
    ranks = ", ".join(p.stem[4:] for p in files)
    what = f"rank {doc['rank']}: {doc['what']}"
    if len(files) > 1:
        what += f" (ranks that failed: {ranks})"
    fields = {"op": doc.get("op"), "details": doc.get("details"), "fix": doc.get("fix")}
    try:
        return cls(what, **fields)
    except TypeError:  # a subclass with required fields of its own (PassError, LoweringError)
        return PortableError(f"{doc['type']}: {what}", **fields)


def _savable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU contiguous tensors with a storage each (safetensors refuses shared memory)."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
