"""One rank of a pipelined training step under torchrun (worker.py hands over here when the run
directory's program has a pipeline plan).

The run directory holds the step program itself (not a per-rank program): every rank cuts the
same stages from it (`split_stages` is deterministic) and builds its `PipelineRank`. State and
batch are GLOBAL on every rank; a rank keeps the state of its stages. After K steps rank 0
collects, by point-to-point tensors (no pickled objects): each state tensor from the lowest rank
holding it, the losses from the rank holding the last stage, and every rank's measured bubble
per step (`1 - compute / step time`), reported beside the schedule's formula.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InputError
from ..ir.program import Program, ProgramKind
from ..ir.sharding import coords_of, rank_of, shard, unshard
from ..ir.signature import InputKind
from ..passes.pipeline_split import PipelineStages, split_stages
from .launch import read_global
from .pipeline import PipelineRank, bubble_formula
from .runtime import TorchCollectives, collective

__all__ = ["run_pipeline_rank"]


def run_pipeline_rank(
    program: Program,
    state_path: Path,
    inputs_path: Path,
    steps: int,
    backend: str,
    timeout: datetime.timedelta,
    at: Callable[..., None],
) -> dict[str, Any]:
    """K steps of this rank's stages; on rank 0 `{"doc": ..., "tensors": GLOBAL state}`, else
    `{}`. The process group is initialised here."""
    if program.kind is not ProgramKind.TRAINING_STEP:
        raise InputError(
            "a pipeline plan runs training steps; this run directory holds an inference program",
            fix="drop the pipeline from the plan for --inference",
        )
    at("init")
    with collective("joining the process group", timeout):
        dist.init_process_group(backend, timeout=timeout)
    stages = split_stages(program)
    mesh = program.plan.mesh
    assert mesh is not None  # a pipeline plan has its mesh
    state = _global(state_path, program, state=True)
    batch = _global(inputs_path, program, state=False)
    collectives = None
    if program.spmd is not None:  # per-rank over the other axes: this rank's shards
        collectives = TorchCollectives(mesh, timeout)
        state = _local(program, state, state=True)
        batch = _local(program, batch, state=False)
    runner = PipelineRank(stages, state, batch, mesh=mesh, collectives=collectives)
    losses: list[torch.Tensor] = []
    bubbles: list[float] = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        at("step", step, steps)
        with collective(f"pipeline step {step}", timeout):
            loss, _ = runner.step(batch)
        if loss is not None:
            losses.append(loss.detach().reshape(()))
        bubbles.append(1.0 - runner.busy_s / runner.step_s if runner.step_s > 0 else 0.0)
    run_s = time.perf_counter() - start
    at("gather")
    with collective("gathering the results", timeout):
        return _collect(program, stages, runner, losses, bubbles, steps, run_s)


def _local(
    program: Program, values: dict[str, torch.Tensor], *, state: bool
) -> dict[str, torch.Tensor]:
    """This rank's shards of GLOBAL values, by the per-rank layout over the other axes."""
    layout = program.spmd
    assert layout is not None
    sub = sub_rank(program, dist.get_rank())
    specs = program.signature.state_inputs if state else program.signature.user_inputs
    out = {}
    for spec in specs:
        key = spec.key if state else spec.name
        out[key] = shard(values[key], layout.input(spec.name).sharding, layout.mesh, sub)
    return out


def sub_rank(program: Program, rank: int) -> int:
    """A rank's rank in the mesh of the other axes (its pipeline coordinate dropped)."""
    assert program.plan.mesh is not None and program.spmd is not None
    coords = coords_of(program.plan.mesh, rank)
    return rank_of(program.spmd.mesh, {a: coords[a] for a in program.spmd.mesh.names})


def _global(path: Path, program: Program, *, state: bool) -> dict[str, torch.Tensor]:
    """GLOBAL state by weight key, or inputs by name (worker.read_global's checks)."""
    values = read_global(path, program, state=state, layout=program.spmd)
    specs = program.signature.state_inputs if state else program.signature.user_inputs
    return {(s.key if state else s.name): values[s.name] for s in specs}


def _collect(
    program: Program,
    stages: PipelineStages,
    runner: PipelineRank,
    losses: list[torch.Tensor],
    bubbles: list[float],
    steps: int,
    run_s: float,
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    holders = {
        r: {k for s in stages.stages_of_rank(r) for k in s.state} for r in range(stages.ranks)
    }
    held = runner.state()
    tensors: dict[str, torch.Tensor] = {}
    mesh = program.plan.mesh
    assert mesh is not None
    axis = stages.pipeline.axis
    for spec in program.signature.state_inputs:
        if spec.kind is InputKind.CONSTANT:
            continue
        owner = min(r for r, keys in holders.items() if spec.key in keys)
        shape, dtype = spec.spec.shape, spec.spec.dtype
        if program.spmd is None:
            value = _to_rank0(held.get(spec.key), owner, shape, dtype)
            if value is not None:
                tensors[spec.key] = value
            continue
        # the owner pipeline rank's shards over the other axes, in their rank order
        ranks = [r for r in range(world) if coords_of(mesh, r)[axis] == owner]
        ranks.sort(key=lambda r: sub_rank(program, r))
        parts = [_to_rank0(held.get(spec.key), r, shape, dtype) for r in ranks]
        if rank == 0:
            layout = program.spmd
            tensors[spec.key] = unshard(
                [p for p in parts if p is not None], layout.input(spec.name).sharding, layout.mesh
            )
    last = (len(stages.stages) - 1) % stages.ranks
    if mesh.size > stages.ranks:  # the lowest rank of the last pipeline coordinate
        last = min(r for r in range(world) if coords_of(mesh, r)[axis] == last)
    loss_values = _to_rank0(
        torch.stack(losses).float() if losses else None, last, (steps,), torch.float32
    )
    per_rank = [torch.zeros(steps, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(per_rank, torch.tensor(bubbles, dtype=torch.float64))
    if rank != 0:
        return {}
    pipeline = stages.pipeline
    assert loss_values is not None
    doc = {
        "losses": [float(v) for v in loss_values],
        "loss_spread": 0.0,  # one rank (the last stage's) computes the loss
        "pipeline": {
            "schedule": pipeline.schedule,
            "stages": len(stages.stages),
            "microbatches": stages.microbatches,
            "virtual_stages": pipeline.virtual_stages,
            "split_points": list(stages.split_points),
            "bubble_per_rank": [[round(float(b), 4) for b in r] for r in per_rank],
            "bubble_formula": round(
                bubble_formula(
                    pipeline.schedule, stages.ranks, stages.microbatches, pipeline.virtual_stages
                ),
                4,
            ),
        },
        "run_s": round(run_s, 4),
    }
    return {"doc": doc, "tensors": tensors}


def _to_rank0(
    value: torch.Tensor | None, owner: int, shape: Any, dtype: torch.dtype
) -> torch.Tensor | None:
    """`value` (held by rank `owner`) on rank 0; None elsewhere."""
    rank = dist.get_rank()
    if owner == 0:
        return value if rank == 0 else None
    if rank == owner:
        assert value is not None
        dist.send(value.detach().contiguous(), 0)
        return None
    if rank == 0:
        buffer = torch.empty(tuple(int(d) for d in shape), dtype=dtype)
        dist.recv(buffer, owner)
        return buffer
    return None
