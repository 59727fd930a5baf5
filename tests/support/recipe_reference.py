"""The eager loop a captured training recipe replaces (`portable.testing.eager.train_eagerly`),
built from optimizer and scheduler factories, and the same record from a compiled step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from portable.testing.eager import EagerRun, train_eagerly

__all__ = ["EagerRun", "run_eager", "run_program"]


def run_eager(
    model: torch.nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    *,
    steps: int,
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    **recipe: Any,
) -> EagerRun:
    """Train a deep copy of `model` for `steps` steps with a fresh optimizer (and scheduler)."""
    model = copy.deepcopy(model)
    opt = make_optimizer(model)
    scheduler = make_scheduler(opt) if make_scheduler else None
    return train_eagerly(
        model, batch, loss_fn, opt, steps=steps, scheduler=scheduler, copy_model=False, **recipe
    )


def run_program(exe: Any, batch: Sequence[torch.Tensor], steps: int) -> EagerRun:
    """The same record from a compiled training step."""
    run = EagerRun([], [], [], [], {})
    for _ in range(steps):
        out = exe(*batch)
        run.losses.append(out.loss)
        run.lrs.append(float(out.lr))
        if out.grad_norm is not None:
            run.grad_norms.append(out.grad_norm)
        if out.loss_scale is not None:
            run.scales.append(float(out.loss_scale))
    run.params = {k: v for k, v in exe.state.items() if not k.startswith(("optimizer.", "amp."))}
    return run
