"""Numbers that must be right: the silent-wrong results issue 13 found (items 4-6, 14, 18), each
compared with eager PyTorch or with what it must be; and the attention inputs that must be
refused typed."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import portable

from .base import OK, Scenario, refused, wrong


class _LearnedBias(nn.Module):
    """A trainable additive attention bias (T5 / ALiBi style), used inside and outside SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.bias = nn.Parameter(torch.randn(2, 6, 6) * 0.5)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)
        return y.sum() + 0.01 * self.bias.square().sum()


def trainable_mask(tmp: Path) -> str:
    """One SGD step moves the bias as eager does (was 0.01 against eager's 0.106)."""
    torch.manual_seed(0)
    model, x = _LearnedBias(), torch.randn(2, 6, 16)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).backward()
    opt.step()
    step = portable.capture(
        model, (x,), loss_fn=lambda m, x: m(x), optimizer=portable.optim.SGD(lr=0.1)
    )
    exe = portable.compile(step)
    exe(x)
    err = (exe.state["bias"] - ref.bias.detach()).abs().max().item()
    return OK if err < 1e-5 else wrong(f"bias differs from eager by {err:.3g}")


class _NanoGPTAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(16, 48)

    def forward(self, x):
        B, T, C = x.shape  # noqa: N806
        q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, T, C)


def nanogpt_view(tmp: Path) -> str:
    """sdpa(...).transpose(1, 2).contiguous().view(B, T, C) (was: cannot be captured)."""
    torch.manual_seed(0)
    model, x = _NanoGPTAttention().eval(), torch.randn(2, 5, 16)
    got = portable.compile(portable.capture(model, (x,)))(x)
    err = (got - model(x)).abs().max().item()
    return OK if err < 1e-6 else wrong(f"max abs {err:.3g}")


class _Mha(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def mha_training_step(tmp: Path) -> str:
    """nn.MultiheadAttention training step (was: a raw `view size is not compatible`)."""
    torch.manual_seed(0)
    model, x, y = _Mha(), torch.randn(2, 5, 16), torch.randn(2, 5, 16)

    def loss(m, x, y):
        return F.mse_loss(m(x), y)

    step = portable.capture(model, (x, y), loss_fn=loss, optimizer=portable.optim.SGD(lr=0.1))
    got = portable.compile(step)(x, y).loss
    err = (got - loss(model, x, y)).abs().item()
    return OK if err < 1e-6 else wrong(f"loss differs from eager by {err:.3g}")


def parity_special_values(tmp: Path) -> str:
    """The parity comparison of special values: +inf = +inf, +inf != -inf, NaN = NaN, and
    complex numbers compared on both parts."""
    from portable.testing.parity import compare

    inf, nan = math.inf, math.nan
    cases = [
        (torch.tensor([inf]), torch.tensor([inf]), True),
        (torch.tensor([-inf]), torch.tensor([-inf]), True),
        (torch.tensor([inf]), torch.tensor([-inf]), False),
        (torch.tensor([inf]), torch.tensor([1.0]), False),
        (torch.tensor([nan]), torch.tensor([nan]), True),
        (torch.tensor([nan]), torch.tensor([1.0]), False),
        (torch.tensor([1 + 1j]), torch.tensor([1 - 1j]), False),
        (torch.tensor([1 + 1j]), torch.tensor([1 + 1j]), True),
    ]
    for got, want, same in cases:
        row = compare("x", "q", got, want, 1e-5, 1e-6)
        if row.ok != same or (same and not math.isfinite(row.max_abs)):
            return wrong(f"{got.tolist()} vs {want.tolist()}: ok={row.ok}, max abs {row.max_abs}")
    return OK


def _attention_shapes() -> nn.Module:
    class M(nn.Module):
        def forward(self, q, k):
            return torch.ops.portable.attention(q, k, k)

    return M()


def _attention_dropout() -> nn.Module:
    class M(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    return M()


_q = torch.randn(1, 2, 4, 8)
SCENARIOS = [
    Scenario("trainable attention mask, one SGD step", "numerics", trainable_mask, "works"),
    Scenario("nanoGPT's view after SDPA", "numerics", nanogpt_view, "works"),
    Scenario("nn.MultiheadAttention training step", "numerics", mha_training_step, "works"),
    Scenario("parity of inf, NaN and complex values", "numerics", parity_special_values, "works"),
    Scenario(
        "attention dropout",
        "numerics",
        lambda tmp: refused(lambda: portable.capture(_attention_dropout(), (_q, _q, _q))),
    ),
    Scenario(
        "attention with disagreeing head dims",
        "numerics",
        lambda tmp: refused(
            lambda: portable.capture(_attention_shapes(), (_q, torch.randn(1, 2, 4, 6)))
        ),
    ),
]
