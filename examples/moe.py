"""MoE: a mixture-of-experts layer with top-2 routing and dense, static-shape dispatch.

Demonstrates routing that `torch.export` can capture without data-dependent shapes: every
expert runs on every token, and a (tokens, experts) gate matrix, zero outside each token's top-k
experts, combines their outputs. The gate is built with `softmax` -> `topk` -> renormalise ->
`scatter`; there is no `nonzero`, boolean indexing or `.item()`. The loss adds a Switch-style
load-balancing term so the router is trained to spread tokens over experts. AdamW.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from portable.capture.decorator import portable
from portable.optim import AdamW


@dataclass(frozen=True)
class MoEConfig:
    in_features: int = 32
    dim: int = 64
    hidden: int = 128  # per-expert SwiGLU width
    n_experts: int = 4
    top_k: int = 2
    n_classes: int = 10
    aux_loss_weight: float = 0.01


BATCH, SEQ = 4, 8
_CFG = MoEConfig()


class Expert(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def load_balancing_loss(probs: torch.Tensor, top_i: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer auxiliary loss: E * sum_e(share of routed slots on e * mean prob of e).

    Equals 1 when routing is uniform and grows as tokens pile onto few experts.
    """
    n_experts = probs.shape[-1]
    routed = torch.zeros_like(probs).scatter(-1, top_i, 1.0)  # (N, E), k ones per row
    share = routed.mean(dim=0) / top_k
    return n_experts * (share * probs.mean(dim=0)).sum()


class MoELayer(nn.Module):
    """Top-k routed experts over the last dimension of `x`."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(config.dim, config.hidden) for _ in range(config.n_experts)
        )

    def forward(self, x: torch.Tensor, return_aux: bool = False):
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, dim)
        probs = F.softmax(self.router(x), dim=-1)  # (N, E)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, top_i, top_w)  # (N, E), k non-zeros per row

        # Dense dispatch: every expert sees every token; the gates zero out unrouted pairs.
        expert_out = torch.stack([expert(x) for expert in self.experts], dim=1)  # (N, E, dim)
        y = torch.einsum("ne,ned->nd", gates, expert_out).reshape(shape)
        if return_aux:  # a Python flag, fixed at capture time
            return y, load_balancing_loss(probs, top_i, self.top_k)
        return y


def moe_loss(model: "MoE", x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy plus the weighted load-balancing loss."""
    logits, aux_loss = model(x, return_aux=True)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return ce + model.config.aux_loss_weight * aux_loss


@portable(
    example_inputs=lambda: (torch.randn(BATCH, SEQ, _CFG.in_features),),
    loss_fn=moe_loss,
    example_batch=lambda: (
        torch.randn(BATCH, SEQ, _CFG.in_features),
        torch.randint(0, _CFG.n_classes, (BATCH, SEQ)),
    ),
    optimizer=AdamW(lr=1e-3),
)
class MoE(nn.Module):
    """Per-token classifier: features (B, T, in_features) -> logits (B, T, n_classes)."""

    def __init__(self, config: MoEConfig = MoEConfig()):
        super().__init__()
        self.config = config
        self.in_proj = nn.Linear(config.in_features, config.dim)
        self.norm = nn.LayerNorm(config.dim)
        self.moe = MoELayer(config)
        self.head = nn.Linear(config.dim, config.n_classes)

    def forward(self, x: torch.Tensor, return_aux: bool = False):
        """Logits, or (logits, load-balancing loss) when `return_aux` (used by the loss)."""
        h = self.in_proj(x)
        if return_aux:
            moe_out, aux_loss = self.moe(self.norm(h), return_aux=True)
            return self.head(h + moe_out), aux_loss
        return self.head(h + self.moe(self.norm(h)))
