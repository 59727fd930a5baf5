"""The eager PyTorch loop a captured training recipe replaces, for reference in tests.

    for step in range(steps):
        for mb in [[t[i::accumulate] for t in batch] for i in ...]:  accumulation (every N-th row)
            with torch.autocast("cpu", dtype=compute):           precision
                loss = loss_fn(model, *mb) / accumulate
            scaler.scale(loss).backward()                       float16: GradScaler
        scaler.unscale_(opt)
        grad_norm = clip_grad_norm_(params, max_norm)           clipping
        scaler.step(opt); scaler.update()
        scheduler.step()                                        schedule (not on skipped steps)

`run_eager` returns what the program's outputs are compared with: per step the loss (the sum
of the micro-batch terms), lr, grad_norm and loss scale, and the final parameters.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch


@dataclasses.dataclass
class EagerRun:
    losses: list[torch.Tensor]
    lrs: list[float]
    grad_norms: list[torch.Tensor]
    scales: list[float]
    params: dict[str, torch.Tensor]


def run_eager(
    model: torch.nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    *,
    steps: int,
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    compute: torch.dtype = torch.float32,
    accumulate: int = 1,
    checkpoint: bool = False,
    batches: Callable[[int], Sequence[torch.Tensor]] | None = None,
) -> EagerRun:
    """Train a deep copy of `model` for `steps` steps (see the module doc); `batches(step)`
    gives each step's batch (default: `batch` every step)."""
    model = copy.deepcopy(model)
    model.train()
    opt = make_optimizer(model)
    scheduler = make_scheduler(opt) if make_scheduler else None
    scaler = torch.amp.GradScaler("cpu") if compute == torch.float16 else None
    params = [p for p in model.parameters() if p.requires_grad]
    run = EagerRun([], [], [], [], {})
    for step in range(steps):
        data = batches(step) if batches else batch
        run.lrs.append(float(opt.param_groups[0]["lr"]))
        opt.zero_grad(set_to_none=True)
        total = None
        for mb in [[t[i::accumulate] for t in data] for i in range(accumulate)]:
            with _autocast(compute):
                loss = loss_fn(model, *mb)
            loss = loss / accumulate if accumulate > 1 else loss
            (scaler.scale(loss) if scaler else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        run.losses.append(total)
        if scaler:
            run.scales.append(float(scaler.get_scale()))
            scaler.unscale_(opt)
        if clip_grad_norm is not None:
            run.grad_norms.append(torch.nn.utils.clip_grad_norm_(params, clip_grad_norm))
        if clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, clip_grad_value)
        skipped = False
        if scaler:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < before
        else:
            opt.step()
        if scheduler is not None and not skipped:
            scheduler.step()
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


def run_program(exe: Any, batch: Sequence[torch.Tensor], steps: int, batches=None) -> EagerRun:
    """The same record from a compiled training step."""
    run = EagerRun([], [], [], [], {})
    for step in range(steps):
        out = exe(*(batches(step) if batches else batch))
        run.losses.append(out.loss)
        run.lrs.append(float(out.lr))
        if out.grad_norm is not None:
            run.grad_norms.append(out.grad_norm)
        if out.loss_scale is not None:
            run.scales.append(float(out.loss_scale))
    run.params = {k: v for k, v in exe.state.items() if not k.startswith(("optimizer.", "amp."))}
    return run


@contextlib.contextmanager
def _autocast(dtype: torch.dtype):
    if dtype == torch.float32:
        yield
    else:
        with torch.autocast("cpu", dtype=dtype):
            yield
