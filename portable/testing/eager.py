"""Eager PyTorch as a parity baseline: what the model gives when run the ordinary way.

`eager_results` returns the same quantities `check_parity` compares (`output <name>`,
`loss step <i>`, `state <key>`), computed with the nn.Module itself: a forward pass for inference,
or an eager `loss.backward(); optimizer.step()` loop with the equivalent `torch.optim` optimizer
for a training step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.utils._pytree as pytree

from ..capture.loss import as_loss_fn
from ..errors import InputError
from ..ir.program import Program, ProgramKind
from ..optim import Optimizer, to_torch

__all__ = ["eager_results"]


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
    eager = to_torch(opt, [p for p in model.parameters() if p.requires_grad])
    model.train()
    results = {}
    step_loss = as_loss_fn(loss_fn, tuple(inputs), {})  # a criterion as capture calls it
    for step in range(steps):
        eager.zero_grad()
        loss = step_loss(model, *inputs)
        loss.backward()
        eager.step()
        results[f"loss step {step + 1}"] = loss.detach()
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
