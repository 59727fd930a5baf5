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


def to_torch(optimizer: Optimizer, params) -> torch.optim.Optimizer:
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


def from_torch(optimizer: torch.optim.Optimizer) -> Optimizer:
    """Read the hyper-parameters of a single-group `torch.optim.SGD` / `AdamW` instance."""
    if len(optimizer.param_groups) != 1:
        raise CaptureError(
            f"{type(optimizer).__name__} has {len(optimizer.param_groups)} parameter groups; "
            "portable supports one",
            fix="use portable.optim.SGD / AdamW, or a torch optimizer with one parameter group",
        )
    g = optimizer.param_groups[0]
    if type(optimizer) is torch.optim.SGD:
        return SGD(
            lr=float(g["lr"]),
            momentum=g["momentum"],
            dampening=g["dampening"],
            weight_decay=g["weight_decay"],
            nesterov=g["nesterov"],
        )
    if type(optimizer) is torch.optim.AdamW:
        if g.get("amsgrad"):
            raise CaptureError("AdamW(amsgrad=True) is not supported", fix="set amsgrad=False")
        return AdamW(
            lr=float(g["lr"]),
            betas=tuple(g["betas"]),
            eps=g["eps"],
            weight_decay=g["weight_decay"],
        )
    raise CaptureError(
        f"optimizer {type(optimizer).__name__} is not supported",
        fix="use torch.optim.SGD / AdamW or portable.optim.SGD / AdamW",
    )


def as_optimizer(obj: Any) -> Optimizer:
    """Accept a portable optimizer or a torch one."""
    if isinstance(obj, Optimizer):
        return obj
    if isinstance(obj, torch.optim.Optimizer):
        return from_torch(obj)
    raise CaptureError(
        f"optimizer must be portable.optim.SGD/AdamW or a torch.optim optimizer, got {type(obj).__name__}",
        fix="pass optimizer=portable.optim.AdamW(lr=...)",
    )
