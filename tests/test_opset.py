"""The opset table and the portable:: ops' kernels (CPU reference, fake, autograd)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import portable
from portable.opset import OPSET_VERSION, lookup, op_name, opset_table, resolve

REPO = Path(__file__).resolve().parents[1]
ops = torch.ops.portable


def test_docs_are_generated_from_the_table():
    from portable.backends.coverage import reference

    assert (REPO / "docs" / "opset.md").read_text() == reference(), (
        "docs/opset.md is stale: run `python -m portable.backends.coverage > docs/opset.md`"
    )


def test_every_entry_resolves_and_round_trips():
    assert OPSET_VERSION.count(".") == 1
    for name, entry in opset_table().items():
        target = resolve(name)
        assert op_name(target) == name and lookup(target) is entry
        assert entry.semantics and entry.signature


def test_ops_outside_the_opset_are_not_found():
    assert lookup(torch.ops.aten.segment_reduce.default) is None
    assert lookup(print) is None


def _math_attention(q, k, v, mask=None, is_causal=False, scale=None):
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "scale": dict(scale=0.3),
    "bool_mask": dict(mask="bool"),
    "additive_mask": dict(mask="float"),
    "mask_and_causal": dict(mask="bool", is_causal=True),
}


@pytest.mark.parametrize("gqa", [1, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_forward_and_backward(case, gqa):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    k, v = (
        torch.randn(2, 4 // gqa, 6, 8, dtype=torch.float64),
        torch.randn(2, 4 // gqa, 6, 8, dtype=torch.float64),
    )
    kwargs = dict(CASES[case])
    if kwargs.get("mask") == "bool":
        kwargs["mask"] = torch.rand(6, 6) > 0.3
        kwargs["mask"][:, 0] = True  # no fully masked row
    elif kwargs.get("mask") == "float":
        kwargs["mask"] = torch.randn(6, 6, dtype=torch.float64)
    args = (kwargs.get("mask"), kwargs.get("is_causal", False), kwargs.get("scale"))
    out = ops.attention(q, k, v, *args)
    torch.testing.assert_close(out, _math_attention(q, k, v, *args))
    grad = torch.randn_like(out)
    dq, dk, dv = ops.attention_backward(grad, q, k, v, *args)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    _math_attention(*leaves, *args).backward(grad)
    for got, leaf in zip((dq, dk, dv), leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad)


def test_attention_autograd_uses_its_backward_op():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    ops.attention(q, k, v, None, True, None).sum().backward()
    assert torch.autograd.gradcheck(
        lambda q, k, v: ops.attention(q, k, v, None, True, None),
        tuple(t.detach().double().requires_grad_() for t in (q, k, v)),
    )


def test_norms_match_torch_bit_for_bit_and_have_gradients():
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    w, b = (
        torch.randn(16, dtype=torch.float64, requires_grad=True),
        torch.randn(16, dtype=torch.float64),
    )
    assert torch.equal(ops.rms_norm(x, [16], w, 1e-6), torch.rms_norm(x, [16], w, 1e-6))
    assert torch.equal(ops.layer_norm(x, [16], w, b, 1e-5), F.layer_norm(x, [16], w, b, 1e-5))
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, [16], w, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda x, w: ops.layer_norm(x, [16], w, None, 1e-5), (x, w))
    assert torch.autograd.gradcheck(lambda x: ops.rms_norm(x, [5, 16], None, None), (x,))


def test_collectives_on_one_rank_are_the_identity_and_refuse_bigger_groups():
    x = torch.randn(4, 6)
    for out in (
        ops.all_reduce(x, "sum", "dp", 1),
        ops.all_gather(x, 0, "dp", 1),
        ops.reduce_scatter(x, "sum", 0, "dp", 1),
        ops.all_to_all(x, 0, 1, "dp", 1),
        ops.wait(x),
    ):
        assert torch.equal(out, x)
    with pytest.raises(portable.BackendError, match="group of 2 ranks"):
        ops.all_reduce(x, "sum", "dp", 2)


def test_collective_and_mx_shape_rules():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 6)
        assert ops.all_gather(x, 0, "dp", 2).shape == (8, 6)
        assert ops.reduce_scatter(x, "sum", 1, "tp", 3).shape == (4, 2)
        assert ops.all_to_all(x, 0, 1, "ep", 2).shape == (2, 12)
        codes, scales = ops.mx_quantize(torch.empty(3, 64), "e2m1", -1, "floor", 32)
        assert codes.shape == (3, 32) and scales.shape == (3, 2) and codes.dtype == torch.uint8
        assert ops.mx_dequantize(codes, scales, "e2m1", -1, torch.bfloat16, 32).shape == (3, 64)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_scale_mask_softmax_matches_unfused_eager_and_its_gradient(mask_kind):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 7, requires_grad=True)
    mask = {
        "none": None,
        "bool": torch.rand(5, 7) > 0.3,
        "float": torch.randn(1, 3, 5, 7, requires_grad=True),
    }[mask_kind]
    if mask_kind == "bool":
        mask[:, 0] = True

    def unfused(x, mask):
        s = x * 0.125
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        return torch.softmax(s, -1)

    fused = ops.scale_mask_softmax(x, mask, 0.125, -1)
    ref = unfused(x, mask)
    assert torch.equal(fused, ref)
    grad = torch.randn_like(ref)
    leaves = [x] + ([mask] if mask_kind == "float" else [])
    got = torch.autograd.grad(fused, leaves, grad)
    want = torch.autograd.grad(ref, leaves, grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_scale_mask_softmax_computes_half_inputs_in_float32():
    x = torch.randn(4, 9).to(torch.bfloat16)
    got = ops.scale_mask_softmax(x, None, 3.0, -1)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.softmax(x.float() * 3.0, -1).to(torch.bfloat16))
