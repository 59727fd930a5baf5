"""What the job loop (loop.py) asks of an engine, and how an engine is chosen.

An engine runs the backend's own executable of the per-rank program on one fleet's runtime:

- `cpu`: torch.distributed (torchrun, gloo), each rank the cpu backend's executable;
- `cuda`: torchrun + NCCL, each rank the cuda backend's executable on its GPU;
- `xla`: one JAX controller over the host's devices (shard_map), the xla backend's lowering;
- `neuron`: the same controller over the Neuron PJRT plugin's devices (jax-neuronx), with the
  lowering rules of the `neuron` target (platform "neuron").

The loop is the same for all of them: it hands an engine each step's batch (global rows
`rows()`), reads the step's loss and metrics, and moves the state in and out of checkpoints as
tensors keyed by checkpoint key (`checkpoint.checkpoint_key`): DTensors of this rank's shards on
torch.distributed, whole tensors under one controller. `loop.make_engine` picks the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import torch

__all__ = ["Engine", "StepOut"]


@dataclasses.dataclass(frozen=True)
class StepOut:
    """One step as the loop sees it: the (global) loss and the program's metrics."""

    loss: float
    metrics: dict[str, float]  # lr, grad_norm, loss_scale (when the recipe has them)


class Engine(Protocol):
    rank: int  # this process's rank (0 under one controller)
    world: int  # processes of the job (1 under one controller)
    devices: int  # devices the step runs on (the mesh's size)
    device_kind: str  # "cpu", "cuda", ... (peaks.detect_device)
    compile_s: float  # seconds spent compiling the programs when the engine started
    comm: Any  # a comm_stats.CommStats (empty under one controller: XLA schedules collectives)
    lowering: dict[str, Any]  # the backend's decisions, in the start event (neuron: target, MX)

    def rows(self, batch: int) -> tuple[int, int] | None:
        """The rows [start, stop) of the global batch this process feeds (None: it needs the
        whole batch, then sharded)."""
        ...

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> StepOut: ...

    def eval_loss(self, idx: torch.Tensor, targets: torch.Tensor) -> float: ...

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The state to save, by checkpoint key (DTensors of local shards, or whole tensors)."""
        ...

    def load_state(self, load: Any) -> None:
        """`load(targets)` fills `targets` (as `checkpoint_state` gives them) in place; the
        engine then runs from those values."""
        ...

    def state_slices(self, key: str, shape: tuple[int, ...]) -> tuple[slice, ...]:
        """The part of state entry `key` (GLOBAL `shape`) this process holds."""
        ...

    def set_state(self, values: Mapping[str, torch.Tensor]) -> None:
        """Replace state entries (by weight key) with the parts `state_slices` named."""
        ...

    def snapshot(self) -> Any: ...

    def restore(self, snapshot: Any) -> None: ...

    def barrier(self) -> None: ...

    def close(self) -> None: ...
