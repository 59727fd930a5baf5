"""The `cpu` and `cuda` engines: one torchrun rank running the backend's executable of the
per-rank program, with its collectives on torch.distributed process groups (gloo / NCCL).

Per rank: `init_process_group`, one group per mesh axis group (`TorchCollectives`, timed by
`TimedCollectives`), this rank's shards of the GLOBAL initial state (`shard` by the layout),
the executable compiled with those local weights (cpu backend; cuda backend on the rank's GPU),
and the validation program's executable beside it, reading the same state. Checkpoints see the
state as DTensors over a device mesh of the plan's axes, so DCP writes each rank's own shards and
a resumed job under another plan reshards them on load.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..api import compile as compile_program
from ..distributed.runtime import TorchCollectives, collective
from ..errors import BackendError
from ..ir.program import Program
from ..ir.sharding import Sharding, coords_of, shard
from ..ir.signature import OutputKind
from ..opset.collectives import collective_runtime
from .checkpoint import checkpoint_key, device_mesh, to_dtensor
from .comm_stats import CommStats, TimedCollectives
from .engine import StepOut
from .prepare import JobFiles

__all__ = ["TorchEngine"]


class TorchEngine:
    """One rank of a torch.distributed job (see the module docstring)."""

    def __init__(self, files: JobFiles, *, device_type: str, timeout_s: float) -> None:

        program = files.per_rank
        assert program.spmd is not None  # read_job loads what per_rank_program wrote
        self.program, self.layout, self.mesh = program, program.spmd, program.spmd.mesh
        self.device_kind = device_type
        self.lowering: dict[str, Any] = {}  # the backend's executable decides nothing to record
        self.device = torch.device("cpu")
        backend = "gloo"
        if device_type == "cuda":
            if not torch.cuda.is_available():
                raise BackendError(
                    "the cuda engine needs a CUDA GPU per rank, and torch sees none here",
                    fix="run on a GPU host, or pass --engine cpu (the reference) or xla",
                )
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
            backend = "nccl"
        timeout = datetime.timedelta(seconds=timeout_s)
        with collective("joining the process group", timeout):
            _init_process_group(backend, timeout, self.device if backend == "nccl" else None)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        program.plan.check_world_size(self.world, "torchrun (WORLD_SIZE)")
        self.devices = self.world
        self.comm = CommStats()
        self._collectives = TimedCollectives(TorchCollectives(self.mesh, timeout), self.comm)
        self._device_mesh = device_mesh(self.mesh, device_type) if self.mesh.size > 1 else None
        start = time.perf_counter()
        local = {
            s.key: shard(program.weights[s.key], self._sharding(s.name), self.mesh, self.rank)
            for s in program.signature.state_inputs
        }
        self.exe = self._compile(program, local)
        self.eval_exe = None
        if files.eval_per_rank is not None:
            self.eval_exe = self._compile(files.eval_per_rank, local)
        self.compile_s = time.perf_counter() - start
        self._names = {s.key: s.name for s in program.signature.state_inputs}
        (self._loss_index,) = [
            i for i, o in enumerate(program.signature.outputs) if o.kind is OutputKind.LOSS
        ]

    # ------------------------------------------------------------------ the step

    def rows(self, batch: int) -> tuple[int, int] | None:
        sharding = self._sharding(self.program.signature.user_inputs[0].name)
        if any(sharding.dims[1:]) or sharding.partial:
            return None
        if not sharding.dims[0]:
            return (0, batch)
        factor = sharding.factor(self.mesh, 0)
        coords = coords_of(self.mesh, self.rank)
        index = 0
        for axis in sharding.dims[0]:
            index = index * self.mesh.axis_size(axis) + coords[axis]
        size = batch // factor
        return (index * size, (index + 1) * size)

    def local_batch(self, idx: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """This rank's values of the two user inputs (`idx`, `targets` are its rows already when
        `rows` gave a range, else the global batch, sharded here)."""
        users = self.program.signature.user_inputs
        if self.rows(int(self.layout.input(users[0].name).global_shape[0])) is not None:
            return [idx.to(self.device), targets.to(self.device)]
        return [
            shard(v, self._sharding(u.name), self.mesh, self.rank).to(self.device)
            for u, v in zip(users, (idx, targets), strict=True)
        ]

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> StepOut:
        batch = self.local_batch(idx, targets)
        with collective_runtime(self._collectives):
            result = self.exe(*batch)
        metrics = {k: float(v) for k, v in result.metrics.items()}
        return StepOut(float(result.loss), metrics)

    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        if self.eval_exe is None:
            raise BackendError("this job has no validation program", fix="pass --eval-data")
        self.eval_exe.state = {k: self.exe.state[k] for k in self.eval_exe.state}
        with collective_runtime(self._collectives), torch.no_grad():
            loss = self.eval_exe(*self.local_batch(idx, targets))
        return float(loss)

    # ------------------------------------------------------------------ state

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in self.exe.state.items():
            if self._device_mesh is not None:
                value = to_dtensor(
                    value, self._sharding(self._names[key]), self.mesh, self._device_mesh
                )
            out[checkpoint_key(key)] = value
        return out

    def load_state(self, load: Any) -> None:
        targets = {k: _zeros_like(v) for k, v in self.checkpoint_state().items()}
        load(targets)
        inverse = {checkpoint_key(k): k for k in self.exe.state}
        self.exe.state = {inverse[k]: _local(v) for k, v in targets.items()}

    def state_slices(self, key: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
        sharding = self._sharding(self._names[key])
        coords = coords_of(self.mesh, self.rank)
        slices = []
        for dim, axes in enumerate(sharding.dims):
            index = 0
            for axis in axes:
                index = index * self.mesh.axis_size(axis) + coords[axis]
            size = shape[dim] // (sharding.factor(self.mesh, dim) if axes else 1)
            slices.append(slice(index * size, (index + 1) * size))
        return tuple(slices)

    def set_state(self, values: Mapping[str, torch.Tensor]) -> None:
        state = dict(self.exe.state)
        for key, value in values.items():
            state[key] = value.to(self.device, state[key].dtype).contiguous()
        self.exe.state = state

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.exe.state.items()}

    def restore(self, snapshot: dict[str, torch.Tensor]) -> None:
        self.exe.state = dict(snapshot)

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ helpers

    def _sharding(self, name: str) -> Sharding:
        return self.layout.input(name).sharding

    def _compile(self, program: Program, local: Mapping[str, torch.Tensor]) -> Any:
        keys = {s.key for s in program.signature.state_inputs}
        local_program = program.replace(
            weights={**program.weights, **{k: v for k, v in local.items() if k in keys}}
        )
        if self.device_kind == "cuda":
            return compile_program(local_program, backend="cuda")
        return compile_program(local_program, backend="cpu")


def _init_process_group(
    backend: str, timeout: datetime.timedelta, device: torch.device | None
) -> None:
    """`init_process_group` from torchrun's environment, every key of this attempt's groups
    under a prefix of its own: torchrun's agent keeps its store across restarts, and a
    restarted rank must not read the addresses the ranks of the failed attempt published."""
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"portable/attempt-{attempt}/", store)
    dist.init_process_group(
        backend, store=prefixed, rank=rank, world_size=world, timeout=timeout, device_id=device
    )


def _zeros_like(value: torch.Tensor) -> torch.Tensor:

    if isinstance(value, DTensor):
        return DTensor.from_local(
            torch.zeros_like(value.to_local()),
            value.device_mesh,
            value.placements,
            run_check=False,
        )
    return torch.zeros_like(value)


def _local(value: torch.Tensor) -> torch.Tensor:

    return value.to_local() if isinstance(value, DTensor) else value
