"""The loss contract of a training step: `loss_fn(model, *example_batch, **kwargs) -> scalar`.

Two forms are accepted:
- a callable taking the model first: `lambda model, x, y: F.cross_entropy(model(x), y)`;
- a `torch.nn` loss module (`nn.CrossEntropyLoss()`, any `nn.modules.loss._Loss`), the
  PyTorch idiom `criterion(model(x), y)`: it is called as
  `criterion(model(*batch[:-1], **kwargs), batch[-1])`, the last batch element being the target.

Anything else that cannot take `(model, *batch)` is refused before export, with the contract.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CaptureError

__all__ = ["CriterionLoss", "as_loss_fn"]

LossFn = Callable[..., torch.Tensor]


class CriterionLoss(torch.nn.Module):
    """`loss_fn(model, *inputs, target) = criterion(model(*inputs), target)`; the criterion is a
    submodule, so its buffers (e.g. class weights) are captured as buffers."""

    def __init__(self, criterion: torch.nn.Module) -> None:
        super().__init__()
        self.criterion = criterion

    def forward(self, model: torch.nn.Module, *batch: Any, **kwargs: Any) -> torch.Tensor:
        return self.criterion(model(*batch[:-1], **kwargs), batch[-1])


def as_loss_fn(loss_fn: Any, batch: tuple[Any, ...], kwargs: dict[str, Any]) -> LossFn:
    """The callable a training step differentiates, `(model, *batch, **kwargs) -> loss`."""
    if isinstance(loss_fn, torch.nn.modules.loss._Loss):
        return _criterion(loss_fn, batch)
    if not callable(loss_fn):
        raise CaptureError(
            f"loss_fn must be callable, got {type(loss_fn).__name__}",
            fix="pass loss_fn=lambda model, x, y: ... returning a scalar loss",
        )
    _check_arguments(loss_fn, batch, kwargs)
    return loss_fn


def _criterion(criterion: torch.nn.Module, batch: tuple[Any, ...]) -> LossFn:
    if len(batch) < 2:
        raise CaptureError(
            f"{type(criterion).__name__} is called as criterion(model(*inputs), target), but the "
            f"batch has {len(batch)} element(s)",
            fix="pass example_batch = (inputs..., target): the last element is the target",
        )
    return CriterionLoss(criterion)


def _check_arguments(loss_fn: LossFn, batch: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    try:
        signature.bind(object(), *batch, **kwargs)
    except TypeError as exc:
        name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
        example = f"{name}(model(x), y)" if name.isidentifier() else "F.mse_loss(model(x), y)"
        raise CaptureError(
            f"loss_fn is called as loss_fn(model, *example_batch) with {1 + len(batch)} "
            f"arguments (the model and {len(batch)} batch element(s)), but it is "
            f"{name}{signature}: {exc}",
            fix="take the model first and compute the loss from its output, e.g. "
            f"loss_fn=lambda model, x, y: {example}; a torch.nn loss module "
            "(nn.CrossEntropyLoss()) can be passed as is",
        ) from None
