"""The cuda backend's fused scale-mask-softmax kernel, run on CPU in Triton's interpreter and
compared with `scale_mask_softmax_reference` (NaN where a row is fully masked, as there)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from portable.errors import BackendError
from portable.opset.nn_ops import scale_mask_softmax_reference

pytest.importorskip("triton")

from portable.backends.cuda.kernels import softmax  # noqa: E402
from portable.backends.cuda.kernels.launch import jit_function  # noqa: E402

# fully masked rows and padded tile rows compute exp(-inf - -inf) = NaN in numpy
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    # one bf16/fp16 rounding of a value in [0, 1] (the interpreter truncates to bf16, the GPU
    # rounds to nearest)
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
    torch.bfloat16: {"rtol": 1e-2, "atol": 8e-3},
}


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    # conftest sets it before triton is imported, which is when Triton reads it
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _mask(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "bool":
        return torch.rand(shape, generator=g) > 0.3
    return torch.randn(shape, generator=g)


def _check(x, mask, scale, dim, **kw):
    got = softmax.scale_mask_softmax(x, mask, scale, dim, **kw)
    want = scale_mask_softmax_reference(x, mask, scale, dim)
    assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, equal_nan=True, **TOL[x.dtype])
    return got


# (x shape, mask kind, mask shape, scale, dim, block_n): block_n=None is the GPU configuration
CASES = {
    "plain": ((2, 3, 5, 37), "none", None, 1.0, -1, None),
    "bool-broadcast": ((2, 3, 5, 37), "bool", (5, 37), 0.5, -1, None),
    "float-broadcast-heads": ((2, 3, 5, 37), "float", (3, 1, 37), 0.5, -1, None),
    "float-full": ((2, 3, 5, 37), "float", (2, 3, 5, 37), 2.0, -1, None),
    "float-broadcast-along-dim": ((2, 3, 5, 37), "float", (2, 1, 5, 1), 0.7, -1, 8),
    "bool-multiblock": ((2, 3, 5, 37), "bool", (2, 1, 5, 37), 2.0, -1, 16),
    "scalar-mask": ((4, 9), "float", (), 1.5, -1, None),
    "dim1": ((2, 6, 5, 7), "bool", (6, 5, 7), 1.0, 1, None),
    "dim0-multiblock": ((9, 3, 4), "float", (1, 3, 1), 0.3, 0, 4),
    "dim2-mask-broadcast-along-dim": ((2, 3, 5, 6), "bool", (3, 1, 6), 1.0, 2, None),
    "rank5-irregular-broadcast": ((2, 3, 4, 5, 6), "float", (2, 1, 4, 1, 6), 1.0, -1, None),
    "rank5-irregular-dim2": ((2, 3, 4, 5, 6), "float", (2, 1, 4, 1, 6), 1.0, 2, None),
    "1d": ((11,), "float", (11,), 1.0, 0, None),
    "long-row-default-config": ((3, 5000), "float", (5000,), 0.9, -1, None),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_fp32(case):
    shape, kind, mshape, scale, dim, block_n = case
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    _check(x, _mask(kind, mshape, g), scale, dim, block_n=block_n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_n", [None, 16])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_half_dtypes(dtype, block_n, kind):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 3, 6, 40, generator=g) * 3).to(dtype)
    mask = _mask(kind, (2, 1, 6, 40), g)
    if mask is not None and mask.is_floating_point():
        mask = mask.to(dtype)
    _check(x, mask, 0.5, -1, block_n=block_n)


@pytest.mark.parametrize("block_n", [None, 16], ids=["one-block", "multi-block"])
def test_fully_masked_rows_are_nan_and_late_unmasking_is_exact(block_n):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 40, generator=g)
    keep = torch.rand(2, 4, 40, generator=g) > 0.5
    keep[0, 1] = False  # fully masked: NaN like torch.softmax
    keep[1, 2] = False
    keep[1, 2, 35:] = True  # masked through the first blocks, then visible
    neg = torch.zeros(2, 4, 40)
    neg[1, 3] = float("-inf")  # an additive mask can mask a row too
    got = _check(x, keep, 1.0, -1, block_n=block_n)
    assert got[0, 1].isnan().all() and not got[1, 2].isnan().any()
    torch.testing.assert_close(got[1, 2].sum(), torch.tensor(1.0))
    assert _check(x, neg, 1.0, -1, block_n=block_n)[1, 3].isnan().all()


def test_non_contiguous_input_and_mask():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 24, generator=g).transpose(0, 1)  # [2, 5, 24], not contiguous
    mask = torch.randn(24, 5, generator=g).t()  # [5, 24], not contiguous
    _check(x, mask, 1.25, -1)


def test_plan_from_meta_tensors_is_what_the_launcher_runs(monkeypatch):
    shape = (2, 3, 4, 5000)
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(4, 5000, dtype=torch.bool, device="meta")
    (plan,) = softmax.plan_scale_mask_softmax(x, mask, 0.125)
    assert list(plan.signature) == jit_function(plan.fn).arg_names
    assert plan.signature["X"] == "*bf16" and plan.signature["M"] == "*i1"
    assert plan.signature["n_rows"] == "i32" and plan.signature["scale"] == "fp32"
    assert plan.constexprs == {
        "BLOCK_R": 1,
        "BLOCK_N": 4096,
        "SINGLE_BLOCK": False,
        "HAS_MASK": True,
        "MASK_IS_BOOL": True,
        "X_UNIT_N": True,
        "M_UNIT_N": True,
    }
    assert plan.grid == (2 * 3 * 4,) and plan.num_warps == 8
    described = [SimpleNamespace(shape=t.shape, dtype=t.dtype) for t in (x, mask)]
    assert softmax.plan_scale_mask_softmax(*described, 0.125) == [plan]  # shape and dtype only

    ran = []
    real_run = softmax.launch.run
    monkeypatch.setattr(softmax.launch, "run", lambda p, *a: (ran.append(p), real_run(p, *a)))
    g = torch.Generator().manual_seed(4)
    xs = torch.randn(shape, generator=g).bfloat16()
    _check(xs, torch.rand(4, 5000, generator=g) > 0.5, 0.125, -1)
    assert ran == [plan]


def test_short_rows_share_a_program():
    (plan,) = softmax.plan_scale_mask_softmax(torch.empty(64, 100, device="meta"), None, 1.0)
    assert (plan.constexprs["BLOCK_R"], plan.constexprs["BLOCK_N"]) == (8, 128)
    assert plan.constexprs["SINGLE_BLOCK"] and plan.grid == (8,)
    (plan,) = softmax.plan_scale_mask_softmax(torch.empty(64, 100, 3, device="meta"), dim=1)
    assert not plan.constexprs["X_UNIT_N"] and plan.grid == (64 * 3 // 8,)


def test_empty_input_needs_no_launch():
    x = torch.empty(3, 0, 5)
    assert softmax.plan_scale_mask_softmax(x, None, 1.0, dim=1) == []
    assert softmax.scale_mask_softmax(x, None, 1.0, dim=1).shape == (3, 0, 5)


def test_refusals_say_what_and_how():
    x = torch.randn(2, 3, 4)
    with pytest.raises(BackendError, match=r"mask of shape \(2, 4, 4\) does not broadcast"):
        softmax.scale_mask_softmax(x, torch.zeros(2, 4, 4))
    with pytest.raises(BackendError, match=r"does not broadcast to x's shape \(2, 3, 4\)"):
        softmax.scale_mask_softmax(x, torch.zeros(5, 2, 3, 4))  # would grow x
    with pytest.raises(BackendError, match="dtype torch.int32") as info:
        softmax.scale_mask_softmax(x.int())
    assert "float32, float16 or bfloat16" in str(info.value)
    with pytest.raises(BackendError, match="dim 3 is out of range"):
        softmax.scale_mask_softmax(x, dim=3)
