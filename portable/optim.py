"""Optimizers as data, with a functional update that is traced into the training-step graph.

Each optimizer is a frozen dataclass of hyper-parameters plus two functions over plain tensors:
`init_state(param)` names and creates its per-parameter state, `update(param, grad, state, step)`
returns the new parameter and state. Both follow `torch.optim`'s default (for-loop, non-capturable)
algorithm so a captured step matches an eager `torch.optim` loop; `step` is a float32 tensor that
counts completed steps and is part of the optimizer state of the program.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .errors import CaptureError

__all__ = ["SGD", "AdamW", "Optimizer", "as_optimizer", "from_torch", "to_torch"]


@dataclasses.dataclass(frozen=True)
class Optimizer(abc.ABC):
    """Base: subclasses define `kind`, `state_names`, `init_state` and `update`."""

    kind = "optimizer"

    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of the per-parameter state tensors, in graph order."""
        return ()

    def init_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(param) for name in self.state_names}

    @abc.abstractmethod
    def update(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        step: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return the new parameter and state after one step."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Optimizer:
        data = dict(data)
        kind = data.pop("kind")
        cls = {"sgd": SGD, "adamw": AdamW}.get(kind)
        if cls is None:
            raise CaptureError(f"unknown optimizer kind {kind!r}", fix="use 'sgd' or 'adamw'")
        if "betas" in data:
            data["betas"] = tuple(data["betas"])
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """`torch.optim.SGD` semantics (momentum buffer starts as the first gradient)."""

    kind = "sgd"
    lr: float = 1e-2
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise CaptureError(
                "SGD nesterov needs momentum > 0 and dampening == 0",
                fix=f"got momentum={self.momentum}, dampening={self.dampening}",
            )

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def update(self, param, grad, state, step):
        if self.weight_decay != 0:
            grad = grad.add(param, alpha=self.weight_decay)
        new_state = {}
        if self.momentum != 0:
            # torch.optim.SGD: buf = grad on the first step, else momentum*buf + (1-dampening)*grad.
            # Written branch-free: `first` is 1.0 on step 0, 0.0 afterwards.
            first = (step == 0).to(grad.dtype)
            buf = state["momentum_buffer"]
            later = buf.mul(self.momentum).add(grad, alpha=1 - self.dampening)
            buf = first * grad + (1 - first) * later
            new_state["momentum_buffer"] = buf
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        return param.add(grad, alpha=-self.lr), new_state


@dataclasses.dataclass(frozen=True)
class AdamW(Optimizer):
    """`torch.optim.AdamW` semantics (decoupled weight decay, bias correction, amsgrad=False)."""

    kind = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def update(self, param, grad, state, step):
        # Mirrors torch.optim.AdamW's single-tensor step op for op, so the cpu backend matches
        # an eager loop bit for bit: bias corrections are computed in float64 (torch computes
        # them as Python floats) and rounded once to the parameter dtype; lerp and addcmul are
        # the same ATen kernels; addcdiv is value * exp_avg / denom, then added.
        beta1, beta2 = self.betas
        t = (step + 1).to(torch.float64)
        bias_correction1 = 1 - torch.pow(beta1, t)
        bias_correction2 = 1 - torch.pow(beta2, t)
        step_size = (self.lr / bias_correction1).to(param.dtype)
        bias_correction2_sqrt = bias_correction2.pow(0.5).to(param.dtype)
        param = param.mul(1 - self.lr * self.weight_decay)
        exp_avg = state["exp_avg"].lerp(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
        denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + self.eps
        param = param + (-step_size) * exp_avg / denom
        return param, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def to_torch(optimizer: Optimizer, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The eager `torch.optim` optimizer with the same hyper-parameters (for reference loops)."""
    if isinstance(optimizer, SGD):
        return torch.optim.SGD(
            params,
            lr=optimizer.lr,
            momentum=optimizer.momentum,
            dampening=optimizer.dampening,
            weight_decay=optimizer.weight_decay,
            nesterov=optimizer.nesterov,
        )
    if isinstance(optimizer, AdamW):
        return torch.optim.AdamW(
            params,
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
        )
    raise CaptureError(f"no torch.optim equivalent for {type(optimizer).__name__}")


def from_torch(
    optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor] | None = None
) -> Optimizer:
    """The portable optimizer that takes exactly the steps of a fresh, single-group
    `torch.optim.SGD` / `Adam` / `AdamW` instance.

    What a captured step cannot reproduce is refused by name, never dropped: several parameter
    groups, state from earlier steps, step hooks, an attached learning-rate scheduler, flags
    without a portable equivalent (`maximize`, `amsgrad`, Adam's coupled weight decay), and,
    given the model's trainable `params` (name -> tensor), an optimizer over other tensors."""
    name = type(optimizer).__name__
    _refuse_what_is_not_captured(optimizer, name)
    if params is not None:
        _check_covers(optimizer, name, params)
    group = optimizer.param_groups[0]
    if group.get("maximize"):
        raise CaptureError(
            f"{name}(maximize=True) is not supported",
            fix="minimize the negated objective (return -objective from loss_fn)",
        )
    if type(optimizer) is torch.optim.SGD:
        return _sgd_from(group)
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return _adamw_from(group, name, decoupled=type(optimizer) is torch.optim.AdamW)
    raise CaptureError(
        f"optimizer {name} is not supported",
        fix="use torch.optim.SGD / Adam / AdamW or portable.optim.SGD / AdamW",
    )


_NOT_CAPTURED_YET = "not captured yet (schedules come with training recipes)"


def _refuse_what_is_not_captured(optimizer: torch.optim.Optimizer, name: str) -> None:
    if len(optimizer.param_groups) != 1:
        raise CaptureError(
            f"{name} has {len(optimizer.param_groups)} parameter groups; portable supports one",
            fix="use portable.optim.SGD / AdamW, or a torch optimizer with one parameter group",
        )
    # torch's LRScheduler wraps the optimizer's step and records each group's initial_lr
    if hasattr(optimizer.step, "_wrapped_by_lr_sched") or "initial_lr" in optimizer.param_groups[0]:
        raise CaptureError(
            f"a learning-rate scheduler is attached to {name}: a captured step runs at the "
            f"constant lr {float(optimizer.param_groups[0]['lr']):g}; schedules are "
            + _NOT_CAPTURED_YET,
            fix="pass an optimizer without a scheduler and train at a constant lr, or capture "
            "one program per lr value you need",
        )
    if optimizer.state:
        raise CaptureError(
            f"{name} has state from earlier steps ({len(optimizer.state)} parameters); a "
            "captured step starts from fresh optimizer state",
            fix=f"pass a fresh {name} (created over model.parameters(), never stepped)",
        )
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        raise CaptureError(
            f"{name} has step hooks, which a captured step does not run",
            fix="remove the hooks (handle.remove()) and do that work outside the program",
        )


def _check_covers(
    optimizer: torch.optim.Optimizer, name: str, params: Mapping[str, torch.Tensor]
) -> None:
    # tensors that do not require grad never get a gradient, so torch.optim skips them too
    held = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    missing = [n for n, p in params.items() if id(p) not in held]
    foreign = len(held - {id(p) for p in params.values()})
    if missing or foreign:
        listed = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise CaptureError(
            f"{name} holds {len(params) - len(missing)} of the model's {len(params)} trainable "
            "parameters"
            + (f" (not: {listed})" if missing else "")
            + (f" and {foreign} other tensor(s)" if foreign else "")
            + "; a captured step updates every trainable parameter of the model",
            fix="create it over model.parameters(), or freeze the others with "
            "param.requires_grad_(False) before capture",
        )


def _sgd_from(group: dict[str, Any]) -> SGD:
    return SGD(
        lr=float(group["lr"]),
        momentum=float(group["momentum"]),
        dampening=float(group["dampening"]),
        weight_decay=float(group["weight_decay"]),
        nesterov=bool(group["nesterov"]),
    )


def _adamw_from(group: dict[str, Any], name: str, *, decoupled: bool) -> AdamW:
    if group.get("amsgrad"):
        raise CaptureError(f"{name}(amsgrad=True) is not supported", fix="set amsgrad=False")
    weight_decay = float(group["weight_decay"])
    if weight_decay != 0 and not (decoupled or group.get("decoupled_weight_decay")):
        raise CaptureError(
            f"{name}'s weight_decay (L2 added to the gradient) is not AdamW's decoupled decay",
            fix="use torch.optim.AdamW (or Adam(decoupled_weight_decay=True)), or weight_decay=0",
        )
    # torch.optim.AdamW is Adam with decoupled decay; with weight_decay=0 the two are one
    return AdamW(
        lr=float(group["lr"]),
        betas=(float(group["betas"][0]), float(group["betas"][1])),
        eps=float(group["eps"]),
        weight_decay=weight_decay,
    )


def as_optimizer(obj: Any, params: Mapping[str, torch.Tensor] | None = None) -> Optimizer:
    """Accept a portable optimizer or a torch one (read by `from_torch`, checked against the
    model's trainable `params` when given). A learning-rate scheduler is refused by name."""
    if isinstance(obj, Optimizer):
        return obj
    if isinstance(obj, torch.optim.Optimizer):
        return from_torch(obj, params)
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        raise CaptureError(
            f"{type(obj).__name__} is a learning-rate scheduler, not an optimizer; schedules are "
            + _NOT_CAPTURED_YET,
            fix="pass an optimizer without a scheduler to train at a constant lr "
            "(portable.optim.AdamW(lr=...) or a fresh torch.optim one)",
        )
    raise CaptureError(
        f"optimizer must be portable.optim.SGD/AdamW or a torch.optim optimizer, got {type(obj).__name__}",
        fix="pass optimizer=portable.optim.AdamW(lr=...)",
    )
