"""The blockwise (FlashAttention-2 style) lowering of `portable::attention` on `xla` / `neuron`.

Above `BLOCK` (512) keys, the shared rules compute attention tile by tile with an online softmax
(`backends/xla/rules/attention.py`), so no [Lq, Lk] intermediate exists in the HLO. Checked here:

- numerics of the blockwise forward and backward against the CPU kernels
  (`torch.ops.portable.attention` / `attention_backward`) at sequence lengths above the block size,
  with full blocks and a shorter last block: masks (bool, additive, broadcast), causal (also with a
  mask, and with Lq != Lk), GQA, scale, fully masked rows (0, as on CPU), bfloat16 inputs;
- the HLO of a captured program at L = 2048, inference and training step, through `xla` and
  `neuron:trn3`: no array has two dims of size L, the largest is a [B, H, BLOCK, BLOCK] tile (the
  plain form's largest is [B*H, L, L]: 32 MiB against 2 MiB), and the neuron validator accepts it
  without findings (every `while` has a constant trip count); at L = 256 the plain form stays;
- a training step through `xla` at L = 600 matches `cpu`.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import portable

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from portable.backends.xla.rules.attention import (  # noqa: E402 (after the jax skip)
    BLOCK,
    attention_blockwise,
    attention_blockwise_backward,
)

# float32: the blockwise sums run in a different order than the CPU kernel's; both are float32
# with O(1) values, so they agree to a few ulps (observed: under 0.5 of this bound).
F32_TOL = {"rtol": 1e-5, "atol": 1e-6}
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}  # one bfloat16 ulp: the result is rounded once


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _bool_mask(lq, lk, dead_rows=(3,)):
    mask = torch.rand(lq, lk) > 0.3
    for row in dead_rows:
        mask[row] = False  # a fully masked row: 0 output and zero gradients on CPU
    return mask


def _float_mask(lq, lk):
    mask = _randn(2, 1, lq, lk)
    mask[:, :, 7] = float("-inf")  # a fully masked row in an additive mask
    mask[:, :, :, 600:650] = float("-inf") if lk > 650 else 0.0
    return mask


def _key_padding_mask(lq, lk):
    return (torch.arange(lk) < 1000).reshape(1, 1, 1, lk)  # broadcast over batch, heads, queries


# label -> (hq, hk, lq, lk, mask(lq, lk) or None, is_causal, scale)
CASES = {
    "plain": (2, 2, 1100, 1100, None, False, None),
    "causal": (2, 2, 1100, 1100, None, True, None),
    "bool_mask": (2, 2, 1100, 1100, _bool_mask, False, None),
    "bool_mask_causal": (2, 2, 1100, 1100, _bool_mask, True, None),
    "additive_mask": (2, 2, 1100, 1100, _float_mask, False, None),
    "key_padding_mask": (2, 2, 700, 1100, _key_padding_mask, False, None),
    "gqa_scale": (4, 2, 1100, 1100, None, False, 0.3),
    "causal_lq_lt_lk": (2, 2, 600, 1100, None, True, None),
    "causal_lq_gt_lk": (2, 1, 1100, 520, None, True, None),
    "exact_blocks": (2, 2, 1024, 1024, _bool_mask, True, None),
}


def _inputs(hq, hk, lq, lk, make_mask, dtype=torch.float32, dim=8):
    torch.manual_seed(0)
    q = _randn(2, hq, lq, dim, dtype=dtype)
    k, v = _randn(2, hk, lk, dim, dtype=dtype), _randn(2, hk, lk, dim, dtype=dtype)
    grad = _randn(2, hq, lq, dim, dtype=dtype)
    mask = None if make_mask is None else make_mask(lq, lk)
    return grad, q, k, v, mask


def _jax(t):
    if t is None:
        return None
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.numpy())


def _torch(x):
    return torch.from_numpy(np.array(x.astype(jnp.float32)))


@pytest.mark.parametrize("label", list(CASES))
def test_forward_and_backward_match_cpu(label):
    hq, hk, lq, lk, make_mask, causal, scale = CASES[label]
    assert lk > BLOCK  # the blockwise form
    grad, q, k, v, mask = _inputs(hq, hk, lq, lk, make_mask)
    want = torch.ops.portable.attention(q, k, v, mask, causal, scale)
    want_grads = torch.ops.portable.attention_backward(grad, q, k, v, mask, causal, scale)
    args = [_jax(t) for t in (q, k, v, mask)]
    with jax.enable_x64(True):  # as the backend lowers
        got = jax.jit(attention_blockwise, static_argnums=(4, 5))(*args, causal, scale)
        got_grads = jax.jit(attention_blockwise_backward, static_argnums=(5, 6))(
            _jax(grad), *args, causal, scale
        )
    torch.testing.assert_close(_torch(got), want, **F32_TOL)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(_torch(g), w, **F32_TOL, msg=f"d{name}")
    if mask is not None and mask.dtype == torch.bool and mask.ndim == 2:
        dead = ~mask.any(-1)
        if dead.any():  # fully masked rows: exactly 0, as the CPU kernel gives
            assert (_torch(got)[..., dead, :] == 0).all()
            assert (_torch(got_grads[0])[..., dead, :] == 0).all()


def test_bfloat16_computes_in_float32_and_rounds_once():
    grad, q, k, v, mask = _inputs(2, 2, 1100, 1100, _bool_mask, dtype=torch.bfloat16)
    want = torch.ops.portable.attention(q, k, v, mask, True, None)
    with jax.enable_x64(True):
        got = attention_blockwise(_jax(q), _jax(k), _jax(v), _jax(mask), True, None)
    assert got.dtype == jnp.bfloat16
    torch.testing.assert_close(_torch(got).bfloat16(), want, **BF16_TOL)


# -- the HLO ---------------------------------------------------------------------------------


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return F.scaled_dot_product_attention(self.proj(x), x, x, is_causal=True)


def _loss(model, x):
    return model(x).square().mean()


def _program(length: int, training: bool):
    torch.manual_seed(0)
    batch = (_randn(1, 2, length, 16),)  # B = 1, H = 2, D = 16
    if training:
        opt = portable.optim.SGD(lr=0.1)
        return portable.capture(_Attention(), batch, loss_fn=_loss, optimizer=opt), batch
    return portable.capture(_Attention(), batch), batch


_SHAPE = re.compile(r"\b(?:pred|[a-z]+\d+)\[([\d,]*)\]")


def _shapes(hlo_text: str) -> set[tuple[int, ...]]:
    return {tuple(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(hlo_text)}


def _neuron_hlo(program, tmp_path):
    """(HLO text written for neuron:trn3, the validator's findings); errors raise in lower."""
    compiled = portable.lower(program, "neuron:trn3", tmp_path)
    (record,) = compiled.payload.programs
    hlo = (tmp_path / "programs" / record.key / "model" / "graph.hlo.txt").read_text()
    return hlo, record.findings


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_long_sequences_have_no_square_intermediate(training, tmp_path):
    length = 2048
    program, _ = _program(length, training)
    neuron_hlo, findings = _neuron_hlo(program, tmp_path)
    # int32 loop counters, constant trip counts: not even a warning (the plain form's causal
    # iota is int64 and draws an int64-downcast warning)
    # (a training step's optimizer computes its lr in float64: downcast, as everywhere)
    assert not [f for f in findings if f.code != "fp64-downcast"]
    for backend, text in (
        ("xla", portable.lower(program, "xla").payload.as_text()),
        ("neuron:trn3", neuron_hlo),
    ):
        shapes = _shapes(text)
        square = sorted(s for s in shapes if s.count(length) >= 2)
        assert not square, f"{backend}: L x L arrays {square}"
        largest = max(shapes, key=math.prod)
        assert math.prod(largest) == 2 * BLOCK * BLOCK, f"{backend}: largest {largest}"
        assert " while(" in text


def test_short_sequences_keep_the_plain_form(tmp_path):
    length = 256
    program, _ = _program(length, training=True)
    neuron_hlo, _ = _neuron_hlo(program, tmp_path)
    for text in (portable.lower(program, "xla").payload.as_text(), neuron_hlo):
        assert any(s.count(length) >= 2 for s in _shapes(text))
        assert " while(" not in text


def test_training_step_on_xla_matches_cpu():
    program, batch = _program(600, training=True)  # one full key block and a short one
    got, want = portable.compile(program, "xla")(*batch), portable.compile(program, "cpu")(*batch)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    assert set(got.state) == set(want.state)
    for key, value in want.state.items():
        torch.testing.assert_close(got.state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_plain_form_gives_zero_for_fully_masked_rows_like_cpu():
    """Short sequences (plain softmax form): a query whose every key is masked gets 0 output
    and 0 gradients, as the CPU kernel gives, not softmax's NaN."""
    from portable.backends.xla.rules.attention import attention as plain

    grad, q, k, v, mask = _inputs(2, 2, 40, 48, _bool_mask)
    mask[3] = False  # query 3 sees no key
    want = torch.ops.portable.attention(q, k, v, mask, False, None)
    want_grads = torch.ops.portable.attention_backward(grad, q, k, v, mask, False, None)
    args = [_jax(t) for t in (q, k, v, mask)]
    with jax.enable_x64(True):
        got, vjp = jax.vjp(lambda q, k, v: plain(q, k, v, args[3]), *args[:3])
        got_grads = vjp(_jax(grad))
    torch.testing.assert_close(_torch(got), want, **F32_TOL)
    assert (_torch(got)[..., 3, :] == 0).all()
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.isfinite(_torch(g)).all()
        torch.testing.assert_close(_torch(g), w, **F32_TOL)
