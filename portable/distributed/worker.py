"""One rank of a per-rank program: `torchrun --nproc-per-node N -m portable.distributed.worker
--program DIR --out OUT [--steps K]` (DIR is a run directory, see launch.py).

Per rank, in order:
1. the per-rank program is loaded from `DIR/program.portable` (`portable.load`; no pickle) and the
   world size torchrun set is checked against its plan's mesh (PlanError with the arithmetic)
   before any data is read or any process group exists;
2. `init_process_group` (gloo, or nccl with one GPU per local rank) and one group per mesh axis
   group (`TorchCollectives`);
3. GLOBAL state (the archive's weights, or DIR/state.safetensors) and inputs are read from
   safetensors and sharded by the program's layout (`Program.spmd`, each input's Sharding);
4. the program runs with the cpu backend's executable under `collective_runtime(...)`: K training
   steps, the updated state threaded on each rank through the signature's aliasing, or one
   inference call;
5. every rank's local results are all-gathered as tensors (no pickled objects), and rank 0
   reassembles the GLOBAL values with `unshard` and writes OUT atomically (temp dir + rename):

    OUT/results.json       {"format": "portable-run-output", "losses": [...], "world_size", ...}
    OUT/state.safetensors  training: final GLOBAL state, keyed by weight key ("fc1.weight")
    OUT/outputs.safetensors inference: GLOBAL outputs, keyed by output name

A PortableError on a rank is written to `--report DIR/rank<r>.json` (when given) for the launcher,
printed as `error: ...`, and the rank exits with 3; any other exception reaches torchrun's error
file (`@record`). With `--report`, the rank also beats into `DIR/rank<r>.beat.json` (heartbeat.py:
phase, step, pid). Every collective, and joining the process group, waits at most `--timeout`
seconds (default 300) for the other ranks, then fails with a CollectiveError. A rank dies with its
parent, torchrun (lifetime.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..errors import ArchiveError, PortableError
from ..ir.plan import Mesh
from ..ir.program import Program, ProgramKind
from ..ir.sharding import Sharding, shard, unshard
from ..ir.signature import InputKind, OutputKind
from ..ir.spmd import SpmdLayout
from . import launch as run_dir
from .agent import AGENT_PID_ENV
from .diagnosis import write_failure
from .heartbeat import Heartbeat
from .lifetime import die_with_parent
from .pipeline_worker import run_pipeline_rank
from .runtime import TorchCollectives, collective

if TYPE_CHECKING:
    from ..runtime import Executable

__all__ = ["OUTPUT_FORMAT", "main", "run_rank"]

OUTPUT_FORMAT = "portable-run-output"
OUTPUT_FORMAT_VERSION = 1


@record  # an exception that is not a PortableError reaches torchrun's error file, then the message
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    agent = os.environ.get(AGENT_PID_ENV)
    die_with_parent(int(agent) if agent else None)  # no rank outlives the launcher
    rank = int(os.environ.get("RANK", "0"))
    beat = None
    if args.report is not None:
        beat = Heartbeat(args.report, rank, interval=min(1.0, args.timeout / 10)).start()
    try:
        options = {"steps": args.steps, "backend": args.backend, "timeout_s": args.timeout}
        run_rank(args.program, args.out, at=beat.at if beat else None, **options)
    except PortableError as exc:
        if args.report is not None:
            write_failure(Path(args.report), rank, exc)
        print(f"error: [rank {rank}] {exc}", file=sys.stderr)
        return 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if beat is not None:
            beat.stop()
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m portable.distributed.worker",
        description="One rank of a per-rank portable program (start it with torchrun).",
    )
    p.add_argument("--program", required=True, type=Path, metavar="DIR", help="run directory")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="rank 0 writes here")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: run.json)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    p.add_argument("--report", type=Path, default=None, help="folder for failures and heartbeats")
    p.add_argument(
        "--timeout",
        type=float,
        default=run_dir.DEFAULT_TIMEOUT_S,
        metavar="S",
        help="seconds a collective waits for the other ranks",
    )
    return p


def _no_beat(phase: str, step: int | None = None, steps: int | None = None) -> None:
    pass


def run_rank(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    steps: int | None = None,
    backend: str | None = None,
    timeout_s: float = run_dir.DEFAULT_TIMEOUT_S,
    at: Callable[..., None] | None = None,
) -> None:
    """Run this process's rank (env from torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    Every collective waits at most `timeout_s` for the other ranks (CollectiveError after);
    `at(phase, step, steps)` is told where the rank is (heartbeat.py)."""
    at = at or _no_beat
    root = Path(directory)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend or run_dir.default_backend()
    program, steps = _loaded_program(root, steps)
    if program.plan.pipeline is not None:
        _run_pipeline(root, Path(out), program, steps, backend, timeout, at)
        return
    layout = _checked_layout(root, program)
    mesh = layout.mesh
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    at("init")
    with collective("joining the process group", timeout):
        dist.init_process_group(
            backend, timeout=timeout, device_id=device if backend == "nccl" else None
        )
    rank = dist.get_rank()
    collectives = TorchCollectives(mesh, timeout)

    at("shard")
    timings: dict[str, float] = {}
    start = time.perf_counter()
    state = _local(root / run_dir.STATE, program, layout, rank, state=True, device=device)
    inputs = _local(root / run_dir.INPUTS, program, layout, rank, state=False, device=device)
    timings["shard_s"] = time.perf_counter() - start

    exe = _executable(program, state, device)
    start = time.perf_counter()
    losses, outputs = _steps(exe, program, inputs, steps, collectives, at)
    timings["run_s"] = time.perf_counter() - start

    at("gather")
    start = time.perf_counter()
    with collective("gathering the results", timeout):
        results = _gather(program, layout, exe.state, losses, outputs)
    timings["gather_s"] = time.perf_counter() - start
    if rank == 0:
        assert results is not None
        at("write")
        doc = {
            **_header(program, backend, mesh),
            "steps": steps if program.kind is ProgramKind.TRAINING_STEP else 1,
            **results.pop("doc"),
            "timings": {k: round(v, 4) for k, v in timings.items()},
        }
        _write_out(Path(out), doc, results)
    at("done")
    with collective("the final barrier", timeout):
        dist.barrier()


def _loaded_program(root: Path, steps: int | None) -> tuple[Program, int]:
    """The program of run directory `root` and the step count, its plan checked against the
    world size torchrun set before any data is read."""
    from ..archive import load

    config = _read_run(root)
    steps = config.get("steps", 1) if steps is None else steps
    program = load(root / run_dir.PROGRAM)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    program.plan.check_world_size(world, "torchrun (WORLD_SIZE)")
    return program, steps


def _run_pipeline(
    root: Path,
    out: Path,
    program: Program,
    steps: int,
    backend: str,
    timeout: datetime.timedelta,
    at: Callable[..., None],
) -> None:
    """A pipelined step's rank (pipeline_worker.py); rank 0 writes OUT."""
    results = run_pipeline_rank(
        program, root / run_dir.STATE, root / run_dir.INPUTS, steps, backend, timeout, at
    )
    if dist.get_rank() == 0:
        at("write")
        assert program.plan.mesh is not None  # a pipeline plan has its mesh
        doc = {
            **_header(program, backend, program.plan.mesh),
            "steps": steps,
            **results.pop("doc"),
        }
        doc["timings"] = {"run_s": doc.pop("run_s")}
        _write_out(out, doc, results)
    at("done")
    with collective("the final barrier", timeout):
        dist.barrier()


def _header(program: Program, backend: str, mesh: Mesh) -> dict[str, Any]:
    """What results.json says first: its format, the program, the backend and the mesh."""
    return {
        "format": OUTPUT_FORMAT,
        "format_version": OUTPUT_FORMAT_VERSION,
        "program": program.identity(),
        "kind": program.kind.value,
        "backend": backend,
        "world_size": dist.get_world_size(),
        "mesh": mesh.to_json(),
    }


def _checked_layout(root: Path, program: Program) -> SpmdLayout:
    """The per-rank program's layout, checked against its plan."""
    layout = _layout(program)
    if program.plan.mesh is not None and program.plan.mesh != layout.mesh:
        raise ArchiveError(
            f"{root / run_dir.PROGRAM}: the spmd layout's mesh {layout.mesh.to_json()} differs "
            f"from the plan's {program.plan.mesh.to_json()}",
            fix="re-run the spmd-partition pass",
        )
    return layout


def _steps(
    exe: Executable,
    program: Program,
    inputs: Mapping[str, torch.Tensor],
    steps: int,
    collectives: TorchCollectives,
    at: Callable[..., None],
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """K training steps (the losses) or one inference call (the outputs by name)."""
    from ..opset.collectives import collective_runtime

    users = [inputs[i.name] for i in program.signature.user_inputs]
    losses: list[torch.Tensor] = []
    outputs: dict[str, torch.Tensor] = {}
    with collective_runtime(collectives):
        if program.kind is ProgramKind.TRAINING_STEP:
            for step in range(1, steps + 1):
                at("step", step, steps)
                losses.append(exe(*users).loss.detach().reshape(()))
        else:
            at("inference")
            values = exe(*users)
            values = values if isinstance(values, tuple) else (values,)
            names = [o.name for o in program.signature.outputs if o.kind is OutputKind.OUTPUT]
            outputs = dict(zip(names, values, strict=True))
    return losses, outputs


# --------------------------------------------------------------------------- inputs


def _read_run(root: Path) -> dict[str, Any]:
    path = root / run_dir.RUN
    if not path.is_file():
        raise ArchiveError(
            f"{root} is not a run directory (no {run_dir.RUN})",
            fix="pass the folder `portable run` (or launch.prepare) wrote",
        )
    doc = json.loads(path.read_text())
    if doc.get("format") != run_dir.INPUT_FORMAT:
        raise ArchiveError(f"{path}: format {doc.get('format')!r}, expected {run_dir.INPUT_FORMAT}")
    return doc


def _layout(program: Program) -> SpmdLayout:
    if program.spmd is None:
        raise ArchiveError(
            f"{program.name} is not a per-rank program (it has no spmd layout)",
            fix="apply the spmd-partition pass first (portable run does)",
        )
    return program.spmd


def _local(
    path: Path,
    program: Program,
    layout: SpmdLayout,
    rank: int,
    *,
    state: bool,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """This rank's local value of every state (or user) input: the GLOBAL value from `path`
    sharded by the input's Sharding."""
    values = run_dir.read_global(path, program, state=state, layout=layout)
    return {
        name: shard(value, layout.input(name).sharding, layout.mesh, rank).to(device)
        for name, value in values.items()
    }


def _executable(
    program: Program, state: Mapping[str, torch.Tensor], device: torch.device
) -> Executable:
    """The cpu backend's executable of the per-rank program with this rank's local state."""
    import portable

    by_target = {s.key: state[s.name] for s in program.signature.state_inputs}
    local = program.replace(weights={**program.weights, **by_target})
    if device.type != "cpu":
        _move_graph(local, device)
    return portable.compile(local, backend="cpu")


def _move_graph(program: Program, device: torch.device) -> None:
    """Ops that create tensors (arange, full, ...) on the capture device create them on `device`."""
    gm = program.graph_module
    for node in gm.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device):
            node.kwargs = {**node.kwargs, "device": device}
    gm.to(device)
    gm.recompile()


# --------------------------------------------------------------------------- results


def _gather(
    program: Program,
    layout: SpmdLayout,
    state: Mapping[str, torch.Tensor],
    losses: Sequence[torch.Tensor],
    outputs: Mapping[str, torch.Tensor],
) -> dict[str, Any] | None:
    """All-gather every rank's local values; on rank 0 the GLOBAL values (None elsewhere)."""
    sig, mesh = program.signature, layout.mesh
    doc: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    if program.kind is ProgramKind.TRAINING_STEP:
        (loss_spec,) = sig.outputs_of(OutputKind.LOSS)
        loss = layout.output(loss_spec.name).sharding
        per_rank = _all_gather(torch.stack(list(losses)).float())
        steps = Sharding(((),) + loss.dims, loss.partial)
        doc["losses"] = [float(v) for v in unshard(per_rank, steps, mesh)] if per_rank else []
        if per_rank:
            stacked = torch.stack(per_rank)
            doc["loss_spread"] = float((stacked.amax(0) - stacked.amin(0)).max())
        # updated state has the sharding of the input it aliases: by weight key
        for spec in sig.state_inputs:
            if spec.kind is InputKind.CONSTANT:
                continue
            per_rank = _all_gather(state[spec.key])
            if per_rank:
                sharding = layout.input(spec.name).sharding
                tensors[spec.key] = unshard(per_rank, sharding, mesh)
    else:
        for name, value in outputs.items():
            per_rank = _all_gather(value)
            if per_rank:
                tensors[name] = unshard(per_rank, layout.output(name).sharding, mesh)
    if dist.get_rank() != 0:
        return None
    return {"doc": doc, "tensors": tensors}


def _all_gather(local: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `local` (same shape everywhere), on the CPU; empty except on rank 0."""
    local = local.detach().contiguous()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.cpu() for t in gathered] if dist.get_rank() == 0 else []


def _write_out(out: Path, doc: dict[str, Any], results: Mapping[str, Any]) -> None:
    """Write OUT atomically (OUT absent or empty): a staging directory beside it renamed into
    place, whose leftovers a killed run leaves are cleaned by the next run (cli/output.py)."""
    from ..cli.output import staging

    with staging(out, force=False) as tmp:
        training = doc["kind"] == ProgramKind.TRAINING_STEP
        name = "state.safetensors" if training else "outputs.safetensors"
        tensors = {k: v.contiguous() for k, v in results["tensors"].items()}
        safetensors.torch.save_file(tensors, tmp / name)
        doc["files"] = {"results": "results.json", "tensors": name}
        (tmp / "results.json").write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
