"""The `cpu` engine for a pipelined step: one torchrun rank holding its pipeline stages, the
step run by torch.distributed.pipelining's schedule (portable/distributed/pipeline.py).

Every rank reads the whole batch (the first stage takes its micro-batches through the
schedule, later stages read theirs directly). The loss, computed by the rank of the last stage,
is broadcast so that every rank's loop sees the same step. Checkpoints hold each rank's stages'
state as whole tensors by checkpoint key (a tied weight from each of its holders, identical), so
torch.distributed.checkpoint writes every tensor once and a job resumed under another plan, or on
another engine, reads whole tensors back.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.pipeline import PipelineRank
from ..distributed.runtime import collective
from ..errors import BackendError
from ..passes.pipeline_split import split_stages
from .checkpoint import checkpoint_key
from .comm_stats import CommStats
from .engine import StepOut
from .prepare import JobFiles
from .torch_engine import _init_process_group

__all__ = ["PipelineEngine"]


class PipelineEngine:
    """One pipeline rank of a torch.distributed job (see the module docstring)."""

    def __init__(self, files: JobFiles, *, device_type: str, timeout_s: float) -> None:
        if device_type != "cpu":
            raise BackendError(
                f"a pipeline plan runs on the cpu engine (gloo) here, not {device_type}",
                fix="pass --engine cpu, or drop the pipeline from the plan",
            )
        if files.eval_per_rank is not None:
            raise BackendError(
                "validation (--eval-data) is not run under a pipeline plan yet",
                fix="drop --eval-data, or evaluate the checkpoint under a plan without pipeline",
            )
        program = files.per_rank
        if program.spmd is not None:
            raise BackendError(
                "portable train runs a pipeline over a mesh of its axis alone for now; this plan "
                "also has " + ", ".join(program.spmd.mesh.names),
                fix="train with Mesh({'pp': N}) and a pipeline, or run the combined plan with "
                "portable run (PP x DP x TP runs there)",
            )
        self.program = program
        self.device_kind = "cpu"
        self.lowering: dict[str, Any] = {}
        self.timeout = datetime.timedelta(seconds=timeout_s)
        with collective("joining the process group", self.timeout):
            _init_process_group("gloo", self.timeout, None)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        program.plan.check_world_size(self.world, "torchrun (WORLD_SIZE)")
        self.devices = self.world
        self.comm = CommStats()
        start = time.perf_counter()
        self.stages = split_stages(program)
        state = {s.key: program.weights[s.key] for s in program.signature.state_inputs}
        self.names = [i.name for i in program.signature.user_inputs]
        example = {
            i.name: torch.zeros(tuple(int(d) for d in i.spec.shape), dtype=i.spec.dtype)
            for i in program.signature.user_inputs
        }
        self.runner = PipelineRank(self.stages, state, example)
        self.compile_s = time.perf_counter() - start
        self.last_rank = (len(self.stages.stages) - 1) % self.stages.ranks
        self.bubbles: list[float] = []

    def rows(self, batch: int) -> tuple[int, int] | None:
        return None  # every rank reads the whole batch

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> StepOut:
        batch = dict(zip(self.names, (idx, targets), strict=True))
        with collective("a pipeline step", self.timeout):
            loss, outputs = self.runner.step(batch)
            value = torch.zeros((), dtype=torch.float32) if loss is None else loss.detach().float()
            dist.broadcast(value, src=self.last_rank)
        self.bubbles.append(1.0 - self.runner.busy_s / max(self.runner.step_s, 1e-9))
        metrics = {
            o.name: float(outputs[o.name])
            for o in self.stages.outputs
            if o.kind.value == "metric" and o.name in outputs
        }
        metrics["bubble"] = self.bubbles[-1]
        return StepOut(float(value), metrics)

    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        raise BackendError("this job has no validation program", fix="drop --eval-data")

    # ------------------------------------------------------------------ state

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {checkpoint_key(k): v for k, v in self.runner.state().items()}

    def load_state(self, load: Any) -> None:
        targets = {k: torch.zeros_like(v) for k, v in self.checkpoint_state().items()}
        load(targets)
        inverse = {checkpoint_key(k): k for k in self.runner.state()}
        self.runner.load({inverse[k]: v for k, v in targets.items()})

    def state_slices(self, key: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(0, d) for d in shape)  # whole tensors

    def set_state(self, values: Mapping[str, torch.Tensor]) -> None:
        held = self.runner.state()
        self.runner.load({k: v.to(held[k].dtype) for k, v in values.items() if k in held})

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.runner.state().items()}

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        self.runner.load(snapshot)

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
