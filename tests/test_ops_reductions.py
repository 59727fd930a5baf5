"""Reductions, sorting, selection and scans of opset 1.3 as real models spell them: each model is
captured whole (no typed refusal), runs bit for bit as eager on `cpu`, and agrees with `cpu` on
`xla` and `onnx` under the parity policy; the differentiable ones also train (a captured SGD step
against eager's, on `cpu` and `xla`)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import portable
from portable.opset import op_name
from portable.testing import check_parity

pytest.importorskip("jax")
pytest.importorskip("onnxruntime")

BACKENDS = ["xla", "onnx"]


def _ops(program) -> set[str]:
    return {op_name(n.target) for n in program.graph.nodes if n.op == "call_function"}


def _check_inference(model: nn.Module, inputs: tuple, ops: set[str]) -> None:
    """Captured with `ops` kept whole, bit for bit as eager on cpu, within parity elsewhere."""
    model = model.eval()
    program = portable.capture(model, inputs)
    assert ops <= _ops(program), sorted(ops - _ops(program))
    got = portable.compile(program, backend="cpu")(*inputs)
    with torch.no_grad():
        want = model(*inputs)
    got, want = (v if isinstance(v, tuple) else (v,) for v in (got, want))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    report = check_parity(program, inputs, backends=BACKENDS)
    assert report.ok, report.format()


# ---- inference: the spellings real models use --------------------------------------------------


class MoERouter(nn.Module):
    """Top-2 routing: softmax gate, top-k experts, ids sorted per token, tokens grouped by expert
    (a stable argsort of the flat expert ids, as dispatch code does)."""

    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        probs = torch.softmax(self.gate(x), dim=-1)
        weights, ids = torch.topk(probs, 2, dim=-1)
        sorted_ids, order = ids.sort(dim=-1)
        dispatch = torch.argsort(ids.flatten(), stable=True)
        return weights / weights.sum(-1, keepdim=True), sorted_ids, order, dispatch


def test_moe_router_sorts_expert_ids():
    torch.manual_seed(0)
    _check_inference(MoERouter(), (torch.randn(6, 8),), {"aten.topk.default", "aten.sort.stable"})


class Similarity(nn.Module):
    """F.normalize, F.cosine_similarity and the CLIP spelling of cosine similarity."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        clip = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).t()
        return F.normalize(a, dim=-1), F.cosine_similarity(a, b, dim=-1), clip


def test_normalize_and_cosine_similarity():
    torch.manual_seed(0)
    inputs = (torch.randn(4, 16), torch.randn(4, 16))
    _check_inference(Similarity(), inputs, {"aten.linalg_vector_norm.default"})


class GradNorm(nn.Module):
    """Global gradient-norm clipping as clip_grad_norm_ spells it: the norm of the per-tensor
    norms, and the clip coefficient it gives."""

    def forward(self, *grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]), 2.0)
        inf = torch.stack([torch.linalg.vector_norm(g, math.inf) for g in grads]).max()
        return total, torch.clamp(1.0 / (total + 1e-6), max=1.0) * inf


def test_global_gradient_norm():
    torch.manual_seed(0)
    grads = (torch.randn(8, 4), torch.randn(4), torch.randn(3, 2, 2) * 5)
    _check_inference(GradNorm(), grads, {"aten.linalg_vector_norm.default", "aten.max.default"})


class Extremes(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values, index = x.min(dim=1)
        return (
            x.max(),
            x.min(),
            values,
            index,
            x.argmin(dim=-1),
            torch.any(mask),
            mask.any(dim=0),
            torch.all(mask, dim=1),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_max_min_argmin_any(dtype):
    torch.manual_seed(0)
    x = torch.randint(-3, 4, (5, 6)).to(dtype)  # ties: argmin / min.dim give the first index
    mask = torch.rand(5, 6) > 0.7
    ops = {"aten.max.default", "aten.min.default", "aten.min.dim", "aten.argmin.default"}
    _check_inference(Extremes(), (x, mask), ops | {"aten.any.default", "aten.any.dim"})


def test_nan_is_the_extreme_and_sorts_last():
    class Nan(nn.Module):
        def forward(self, x):
            values, order = torch.sort(x, dim=-1, stable=True)
            down, _ = torch.sort(x, dim=-1, descending=True, stable=True)
            return x.max(), *x.min(dim=1), x.argmin(dim=1), values, order, down

    x = torch.tensor([[1.0, math.nan, -2.0, 0.0], [-0.0, 0.0, math.inf, -math.inf]])
    _check_inference(Nan(), (x,), {"aten.sort.stable", "aten.min.dim"})


class Products(nn.Module):
    """Products and scans: a survival curve (the cumprod of per-step survival probabilities),
    the product of gates, and the mean and std of a batch (torch.std_mean)."""

    def forward(self, keep: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        survival = torch.cumprod(keep, dim=1)
        std, mean = torch.std_mean(x, dim=0)
        var, mean_all = torch.var_mean(x, correction=0)
        return survival, torch.prod(keep), torch.prod(x, dim=1), std, mean, var, mean_all


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prod_cumprod_std_mean(dtype):
    torch.manual_seed(0)
    keep, x = (1 - torch.rand(3, 7) * 0.2).to(dtype), torch.randn(6, 5).to(dtype)
    ops = {"aten.cumprod.default", "aten.prod.default", "aten.prod.dim_int"}
    _check_inference(Products(), (keep, x), ops | {"aten.var_mean.correction"})


def test_integer_prod_and_cumprod():
    class Counts(nn.Module):
        def forward(self, n, flags):
            return torch.prod(n, dim=0), torch.cumprod(n, dim=1), torch.prod(flags)

    n, flags = torch.randint(-3, 4, (4, 5)), torch.ones(3, dtype=torch.bool)
    _check_inference(Counts(), (n, flags), {"aten.prod.dim_int", "aten.cumprod.default"})


class SegmentPool(nn.Module):
    """Per-segment pooling of token features (graph nets, MoE combine): scatter_reduce with each
    reduction, with and without the initial values."""

    def forward(self, x: torch.Tensor, segment: torch.Tensor) -> tuple[torch.Tensor, ...]:
        index = segment[:, None].expand_as(x)
        base = torch.zeros(3, x.shape[1], dtype=x.dtype)
        return tuple(
            base.scatter_reduce(0, index, x, reduce, include_self=include_self)
            for reduce in ("sum", "prod", "mean", "amax", "amin")
            for include_self in (True, False)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_scatter_reduce_every_reduction(dtype):
    torch.manual_seed(0)
    x = torch.randint(-4, 5, (7, 4)).to(dtype) if dtype == torch.int64 else torch.randn(7, 4)
    segment = torch.tensor([0, 2, 0, 1, 2, 2, 0])  # the rows of segment 1 meet once
    _check_inference(SegmentPool(), (x.to(dtype), segment), {"aten.scatter_reduce.two"})


# ---- training steps: the backward of each differentiable op ------------------------------------


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _check_training(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    torch.manual_seed(0)
    program = portable.capture(model, (x, y), loss_fn=_mse, optimizer=portable.optim.SGD(lr=0.1))
    report = check_parity(
        program, (x, y), backends=["xla"], eager_model=model, loss_fn=_mse, steps=2
    )
    assert report.ok, report.format()


class SortPool(nn.Module):
    """Sorted-value pooling (sort backward scatters grad to the sorted positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        h = self.proj(x)
        top, _ = torch.topk(h, 3, dim=-1)
        return torch.sort(h, dim=-1, descending=True).values[:, :3] + top


class NormHead(nn.Module):
    """Normalized features, a gradient-norm-like term and a max-norm term."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, x):
        h = self.proj(x)
        total = torch.linalg.vector_norm(torch.stack([h.norm(), self.proj.weight.norm()]))
        return (
            F.normalize(h, dim=-1) * total + torch.linalg.vector_norm(h, math.inf, dim=-1)[:, None]
        )


class Moments(nn.Module):
    """std_mean / var_mean statistics, prod over a dim, a min over a dim and max of all."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)

    def forward(self, x):
        h = self.proj(x)
        std, mean = torch.std_mean(h, dim=0, keepdim=True)
        gate = torch.prod(torch.sigmoid(h), dim=-1, keepdim=True)
        return (h - mean) / std * gate + h.min(dim=1, keepdim=True).values + h.max()


class Pooled(nn.Module):
    """scatter_reduce pooling of rows into segments (sum, mean and amax)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 3)
        self.register_buffer("index", torch.tensor([0, 1, 0, 2, 1])[:, None].expand(5, 3))

    def forward(self, x):
        h = self.proj(x)
        base = torch.zeros(3, 3)
        pooled = [
            base.scatter_reduce(0, self.index, h, r, include_self=False)
            for r in ("sum", "mean", "amax")
        ]
        return h + torch.gather(sum(pooled), 0, self.index)  # each row gets its segment's pool


@pytest.mark.parametrize("model", [SortPool, NormHead, Moments, Pooled])
def test_training_step_backward(model):
    torch.manual_seed(0)
    built = model()
    x = torch.randn(5, 6)
    with torch.no_grad():
        y = torch.randn(built(x).shape)
    _check_training(built, x, y)


class Survival(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 4)

    def forward(self, x):
        return torch.cumprod(torch.sigmoid(self.proj(x)), dim=1)


def test_cumprod_training_step():
    # its backward takes aten.max.dim of a bool mask (max.dim is declared for bools too)
    torch.manual_seed(0)
    x = torch.randn(5, 6)
    _check_training(Survival(), x, torch.randn(5, 4))


@pytest.mark.parametrize("lower", [True, False])
def test_triangle_indices_as_eager_on_every_backend(lower):
    """tril_indices / triu_indices (pairwise-feature and attention-bias code): static grids
    sorted into the triangle's row-major order, exact on every backend."""
    fn = torch.tril_indices if lower else torch.triu_indices

    class Pairs(torch.nn.Module):
        def forward(self, x):
            return tuple(
                fn(r, c, o) + x for r, c, o in ((4, 5, 0), (4, 5, -2), (3, 3, 5), (6, 2, 1))
            )

    x = torch.zeros((), dtype=torch.int64)
    program = portable.capture(Pairs(), (x,))
    want = Pairs()(x)
    for backend in ("cpu", "xla", "onnx"):
        got = portable.compile(program, backend=backend)(x)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), backend
