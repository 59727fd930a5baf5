"""Eager PyTorch as a parity baseline: what the model gives when run the ordinary way.

`eager_results` returns the same quantities `check_parity` compares (`output <name>`,
`loss step <i>`, `state <key>`), computed with the nn.Module itself: a forward pass for inference,
or, for a training step, the eager loop its recipe stands for (`train_eagerly`):

    for step in range(steps):
        for i in range(accumulate):                              every N-th row of the batch
            with torch.autocast("cpu", dtype=compute):            precision
                micro = batch if accumulate == 1 else [t[i::accumulate] for t in batch]
                loss = loss_fn(model, *micro) / accumulate
            scaler.scale(loss).backward()                        float16: GradScaler
        scaler.unscale_(opt)
        grad_norm = clip_grad_norm_(params, max_norm)            clip_grad_value_ likewise
        scaler.step(opt); scaler.update()
        scheduler.step()                                         not on a skipped step

with the equivalent `torch.optim` optimizer (one torch group per portable group) and either a
torch scheduler or the program's own schedule setting each group's lr."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..capture.dropout import CounterDropout
from ..capture.loss import as_loss_fn
from ..errors import InputError
from ..ir.program import Program, ProgramKind
from ..optim import Optimizer, to_torch
from ..recipe import LossScale, Recipe, recipe_of

__all__ = ["EagerRun", "eager_results", "train_eagerly"]


def eager_results(
    program: Program,
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    steps: int = 1,
) -> dict[str, torch.Tensor]:
    """Run `model` eagerly (on a deep copy, so the caller's model is untouched)."""
    model = copy.deepcopy(model)
    if program.kind is ProgramKind.INFERENCE:
        model.eval()
        with torch.no_grad():
            outs = pytree.tree_leaves(model(*inputs))
        names = [o.name for o in program.signature.outputs]
        return {f"output {n}": t for n, t in zip(names, outs, strict=True)}
    if loss_fn is None:
        raise InputError(
            f"comparing the training step {program.name} with eager PyTorch needs its loss_fn",
            fix="pass loss_fn= (the one the step was captured with) next to eager_model=",
        )
    opt = Optimizer.from_dict(program.metadata["optimizer"])
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    eager = to_torch(opt, trainable)
    recipe = recipe_of(program.metadata)
    step_loss = as_loss_fn(loss_fn, tuple(inputs), {})  # a criterion as capture calls it
    run = train_eagerly(
        model,
        tuple(inputs),
        step_loss,
        eager,
        steps=steps,
        lr_at=_schedule_lrs(opt, recipe, trainable, eager) if recipe.schedule else None,
        **_loop_options(recipe, program),
        copy_model=False,
    )
    results = {f"loss step {i + 1}": loss for i, loss in enumerate(run.losses)}
    tied = program.metadata.get("tied_weights", {})
    for key, value in model.state_dict().items():
        results[f"state {tied.get(key, key)}"] = value
    param_names = {id(p): n for n, p in model.named_parameters()}
    for param, state in eager.state.items():
        name = param_names[id(param)]
        for k, value in state.items():
            if k != "step":
                results[f"state optimizer.{tied.get(name, name)}.{k}"] = value
    return results


@dataclasses.dataclass
class EagerRun:
    """Per step: the loss (the sum of the micro-batch terms), the lr of the first parameter
    group, the pre-clip gradient norm and the loss scale; and the parameters at the end."""

    losses: list[torch.Tensor]
    lrs: list[float]
    grad_norms: list[torch.Tensor]
    scales: list[float]
    params: dict[str, torch.Tensor]


def train_eagerly(
    model: torch.nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    scheduler: Any = None,
    lr_at: Callable[[int], list[float]] | None = None,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    compute: torch.dtype = torch.float32,
    loss_scale: LossScale | None = None,
    accumulate: int = 1,
    dropout_seed: int | None = None,
    copy_model: bool = True,
) -> EagerRun:
    """The eager loop of the module doc over `optimizer` (built on `model`'s parameters; with
    `copy_model`, on a deep copy's, mapped by name). The lr comes from `scheduler` (a torch
    lr_scheduler stepped after every update that is not skipped) or `lr_at(t)` (each torch
    group's lr at schedule step t), else the optimizer's own. With `dropout_seed`, dropout draws
    from the program's counter-based generator (`CounterDropout`, its offset advancing once per
    forward that draws), so the masks are the program's."""
    if copy_model:
        model, optimizer, scheduler = _copied(model, optimizer, scheduler)
    model.train()
    scaler = None
    if compute == torch.float16:
        scale = loss_scale or LossScale()
        scaler = torch.amp.GradScaler(
            "cpu", scale.init, scale.growth, scale.backoff, scale.interval
        )
    params = [p for p in model.parameters() if p.requires_grad]  # clip_grad_norm_'s order
    rng = _Rng(dropout_seed)
    run = EagerRun([], [], [], [], {})
    updates = 0
    for _ in range(steps):
        if lr_at is not None:
            for group, lr in zip(optimizer.param_groups, lr_at(updates), strict=True):
                group["lr"] = lr
        run.lrs.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.zero_grad(set_to_none=True)
        total = None
        for i in range(accumulate):
            with _autocast(compute), rng.drawing():
                micro = batch if accumulate == 1 else [t[i::accumulate] for t in batch]
                loss = loss_fn(model, *micro)
            loss = loss / accumulate if accumulate > 1 else loss
            (scaler.scale(loss) if scaler else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        run.losses.append(total)
        if scaler:
            run.scales.append(float(scaler.get_scale()))
            scaler.unscale_(optimizer)
        if clip_grad_norm is not None:
            run.grad_norms.append(torch.nn.utils.clip_grad_norm_(params, clip_grad_norm))
        if clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(params, clip_grad_value)
        skipped = False
        if scaler:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped = scaler.get_scale() < before
        else:
            optimizer.step()
        updates += not skipped
        if scheduler is not None and not skipped:
            scheduler.step()
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run


class _Rng:
    """The program's dropout generator state in an eager loop (None: torch's own dropout)."""

    def __init__(self, seed: int | None) -> None:
        self.seed = None if seed is None else torch.tensor(seed, dtype=torch.int64)
        self.offset = torch.tensor(0, dtype=torch.int64)

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        if self.seed is None:
            yield
            return
        with CounterDropout(self.seed, self.offset) as mode:
            yield
        if mode.streams:
            self.offset = self.offset + 1


def _copied(model: torch.nn.Module, optimizer: Any, scheduler: Any) -> tuple[Any, Any, Any]:
    """A deep copy of model, optimizer and scheduler together (the optimizer then holds the
    copy's parameters, the scheduler drives the copied optimizer)."""
    memo: dict[int, Any] = {}
    model = copy.deepcopy(model, memo)
    optimizer = copy.deepcopy(optimizer, memo)
    scheduler = copy.deepcopy(scheduler, memo) if scheduler is not None else None
    return model, optimizer, scheduler


def _loop_options(recipe: Recipe, program: Program) -> dict[str, Any]:
    draws = any(i.target == "rng.seed" for i in program.signature.inputs)
    return {
        "dropout_seed": recipe.seed if draws else None,
        "clip_grad_norm": recipe.clip_grad_norm,
        "clip_grad_value": recipe.clip_grad_value,
        "compute": recipe.precision.compute_dtype,
        "loss_scale": recipe.precision.loss_scale,
        "accumulate": recipe.accumulate,
    }


def _schedule_lrs(
    optimizer: Optimizer,
    recipe: Recipe,
    trainable: Mapping[str, torch.Tensor],
    eager: torch.optim.Optimizer,
) -> Callable[[int], list[float]]:
    """lr_at(t): each torch group's lr from the program's schedule at recipe.start + t."""
    names = {id(p): n for n, p in trainable.items()}
    bases = []
    for group in eager.param_groups:
        index = optimizer.group_of(names[id(group["params"][0])])
        bases.append(optimizer.group_hyper(index)[0])
    schedule = recipe.schedule

    def lr_at(t: int) -> list[float]:
        step = torch.tensor(float(recipe.start + t), dtype=torch.float64)
        return [float(schedule.lr(step, base)) for base in bases]

    return lr_at


@contextlib.contextmanager
def _autocast(dtype: torch.dtype) -> Iterator[None]:
    if dtype == torch.float32:
        yield
    else:
        with torch.autocast("cpu", dtype=dtype):
            yield
