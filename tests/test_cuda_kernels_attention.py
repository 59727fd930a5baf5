"""The cuda backend's online-softmax attention kernel, run on CPU in Triton's interpreter and
compared with `attention_reference` (0 where every key of a query is masked, as there)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from portable.errors import BackendError
from portable.opset.nn_ops import attention_reference

pytest.importorskip("triton")

from triton.runtime import interpreter  # noqa: E402

from portable.backends.cuda.kernels import attention as attn  # noqa: E402
from portable.backends.cuda.kernels.launch import jit_function  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    # the kernel rounds probabilities to the input dtype for the second dot (as FlashAttention
    # does); the bf16 interpreter also truncates where the GPU rounds to nearest
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def _bf16_dot(self, a, b, d, input_precision, max_num_imprecise_acc, _orig=None):
    """tl.dot on bf16 operands, converted to fp32 first: the fix of triton-lang/triton#11584
    (the interpreter multiplies bf16 bit patterns). The GPU kernel is unchanged."""
    import triton.language as tl

    a, b = (self.cast_impl(t, tl.float32) if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
    return _orig(self, a, b, d, input_precision, max_num_imprecise_acc)


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    # conftest sets it before triton is imported, which is when Triton reads it
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    orig = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(
        interpreter.InterpreterBuilder,
        "create_dot",
        lambda self, *args: _bf16_dot(self, *args, _orig=orig),
    )


def _qkv(b, hq, hk, lq, lk, d, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (b,) if b else ()
    q = torch.randn(*lead, hq, lq, d, generator=g).to(dtype)
    k = torch.randn(*lead, hk, lk, d, generator=g).to(dtype)
    v = torch.randn(*lead, hk, lk, dv, generator=g).to(dtype)
    return q, k, v, g


def _check(q, k, v, mask=None, is_causal=False, scale=None, **kw):
    got = attn.attention(q, k, v, mask, is_causal, scale, **kw)
    want = attention_reference(q, k, v, mask, is_causal, scale)
    assert got.dtype == q.dtype and got.shape == want.shape and got.is_contiguous()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **TOL[q.dtype])
    return got


# name -> (B, Hq, Hk, Lq, Lk, D, Dv, mask kind, mask shape, is_causal, scale, blocks)
# blocks=None is the GPU configuration (fp32, D <= 64: BLOCK_M=64, BLOCK_N=64; Lk > 64 loops)
CASES = {
    "plain-lq-ne-lk": (2, 2, 2, 37, 70, 32, 32, "none", None, False, None, None),
    "causal": (2, 2, 2, 37, 70, 32, 32, "none", None, True, None, None),
    "causal-two-query-blocks": (1, 2, 2, 80, 100, 16, 16, "none", None, True, None, None),
    "causal-block-m-gt-block-n": (1, 2, 2, 80, 100, 16, 16, "none", None, True, None, (32, 16)),
    "causal-lq-gt-lk": (1, 2, 2, 50, 20, 16, 16, "none", None, True, None, (16, 16)),
    "causal-single-query": (1, 2, 2, 1, 40, 16, 16, "none", None, True, None, (16, 16)),
    "bool-mask-broadcast": (2, 2, 2, 37, 70, 32, 32, "bool", (37, 70), False, None, None),
    "float-mask-per-batch": (2, 2, 2, 37, 70, 32, 32, "float", (2, 1, 37, 70), False, 0.3, None),
    "float-mask+causal": (2, 2, 2, 37, 70, 32, 32, "float", (2, 1, 37, 70), True, None, None),
    "bool-mask+causal-small-blocks": (
        2,
        2,
        2,
        37,
        70,
        32,
        32,
        "bool",
        (2, 2, 37, 70),
        True,
        None,
        (16, 16),
    ),  # fmt: skip
    "mask-broadcast-over-keys": (1, 2, 2, 20, 45, 16, 16, "float", (20, 1), True, None, (16, 16)),
    "gqa+mask+causal": (2, 4, 2, 24, 50, 32, 32, "bool", (1, 4, 24, 50), True, None, (16, 16)),
    "mqa": (1, 4, 1, 24, 50, 32, 32, "float", (24, 50), False, None, (16, 16)),
    "head-dims-48-80": (1, 4, 2, 20, 70, 48, 80, "float", (20, 70), True, 0.2, None),
    "head-dim-80": (1, 2, 2, 20, 70, 80, 80, "bool", (2, 20, 70), False, None, None),
    "head-dim-20": (1, 2, 1, 18, 33, 20, 20, "none", None, True, None, (16, 16)),
    "head-dim-256": (1, 2, 2, 20, 40, 256, 256, "bool", (20, 40), True, None, None),
    "3d-input": (0, 3, 3, 9, 40, 16, 16, "float", (3, 9, 40), True, None, (16, 16)),
}


def _mask(kind, shape, g):
    if kind == "none":
        return None
    if kind == "bool":
        keep = torch.rand(shape, generator=g) > 0.3
        keep[..., 0] = True  # no fully masked rows here (tested apart)
        return keep
    return torch.randn(shape, generator=g)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_fp32(case):
    b, hq, hk, lq, lk, d, dv, kind, mshape, causal, scale, blocks = case
    q, k, v, g = _qkv(b, hq, hk, lq, lk, d, dv)
    bm, bn = blocks or (None, None)
    _check(q, k, v, _mask(kind, mshape, g), causal, scale, block_m=bm, block_n=bn)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_half_dtypes_mask_and_causal(dtype, kind):
    q, k, v, g = _qkv(2, 4, 2, 30, 80, 64, 64, dtype)  # default blocks: BLOCK_N=64, two blocks
    mask = _mask(kind, (2, 1, 30, 80), g)
    _check(q, k, v, mask.to(dtype) if kind == "float" else mask, True)


@pytest.mark.parametrize("blocks", [None, (16, 16)], ids=["default-blocks", "small-blocks"])
def test_fully_masked_rows_give_zero_like_the_reference(blocks):
    q, k, v, g = _qkv(1, 2, 2, 20, 70, 16, 16)
    keep = torch.rand(1, 2, 20, 70, generator=g) > 0.5
    keep[0, 0, 3] = False  # every key masked
    keep[0, 1, 5] = False
    keep[0, 1, 5, 66] = True  # only a key in the last block (the running max starts at -inf)
    additive = torch.zeros(20, 70)
    additive[7] = float("-inf")
    bm, bn = blocks or (None, None)
    got = _check(q, k, v, keep, True, block_m=bm, block_n=bn)
    assert (got[0, 0, 3] == 0).all()
    got = _check(q, k, v, keep, False, block_m=bm, block_n=bn)
    torch.testing.assert_close(got[0, 1, 5], v[0, 1, 66])
    assert (_check(q, k, v, additive, True, block_m=bm, block_n=bn)[:, :, 7] == 0).all()


def test_leading_dims_and_non_contiguous_inputs():
    g = torch.Generator().manual_seed(5)
    # [B, L, H, D] transposed to [B, H, L, D], as attention layers produce them
    q = torch.randn(2, 3, 20, 4, 16, generator=g).transpose(-3, -2)
    k = torch.randn(2, 3, 40, 2, 16, generator=g).transpose(-3, -2)
    v = torch.randn(2, 3, 40, 2, 16, generator=g).transpose(-3, -2)
    mask = torch.randn(3, 1, 20, 40, generator=g)  # broadcast over the first of two lead dims
    got = attn.attention(q, k, v, mask, True, block_m=16, block_n=16)
    want = torch.stack(
        [attention_reference(q[i], k[i], v[i], mask, True) for i in range(2)]
    )  # SDPA wants one batch dim with GQA: compare per outer index
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_plan_from_meta_tensors_is_what_the_launcher_runs(monkeypatch):
    def meta(*shape, dtype=torch.float16):
        return torch.empty(shape, dtype=dtype, device="meta")

    q, k, v = meta(2, 4, 30, 80), meta(2, 2, 70, 80), meta(2, 2, 70, 48)
    mask = meta(2, 1, 30, 70, dtype=torch.bool)
    (plan,) = attn.plan_attention(q, k, v, mask, True)
    assert list(plan.signature) == jit_function(plan.fn).arg_names
    assert plan.signature["Q"] == "*fp16" and plan.signature["M"] == "*i1"
    assert plan.signature["Lk"] == "i32" and plan.signature["scale"] == "fp32"
    assert plan.constexprs == {
        "BLOCK_M": 128,
        "BLOCK_N": 64,
        "BLOCK_D": 128,
        "BLOCK_DV": 64,
        "HAS_MASK": True,
        "MASK_IS_BOOL": True,
        "MASK_BCAST_N": False,
        "IS_CAUSAL": True,
        "INPUT_PRECISION": "tf32",  # unused for fp16 operands
    }
    assert plan.grid == (1 * 2 * 4,) and (plan.num_warps, plan.num_stages) == (8, 3)
    described = [SimpleNamespace(shape=t.shape, dtype=t.dtype) for t in (q, k, v, mask)]
    assert attn.plan_attention(*described, True) == [plan]  # shape and dtype only
    (fp32,) = attn.plan_attention(*(meta(*t.shape, dtype=torch.float32) for t in (q, k, v)))
    assert fp32.constexprs["INPUT_PRECISION"] == "ieee" and not fp32.constexprs["HAS_MASK"]

    ran = []
    real_run = attn.launch.run
    monkeypatch.setattr(attn.launch, "run", lambda p, *a: (ran.append(p), real_run(p, *a)))
    qs, ks, vs, g = _qkv(2, 4, 2, 30, 70, 80, 48, torch.float16, seed=6)
    _check(qs, ks, vs, torch.rand(2, 1, 30, 70, generator=g) > 0.2, True)
    assert ran == [plan]


def test_empty_queries_need_no_launch():
    q, k, v, _ = _qkv(1, 2, 2, 0, 10, 16, 16)
    assert attn.plan_attention(q, k, v) == []
    assert attn.attention(q, k, v).shape == (1, 2, 0, 16)


def test_bf16_on_a_broken_interpreter_is_refused(monkeypatch):
    def raw_bit_dot(self, a, b, d, *rest):  # what the unpatched interpreter does with bf16
        return interpreter.TensorHandle(
            (a.data.astype("float32") @ b.data.astype("float32")) + d.data, d.dtype.scalar
        )

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", raw_bit_dot)
    q, k, v, _ = _qkv(1, 2, 2, 8, 8, 16, 16, torch.bfloat16)
    with pytest.raises(BackendError, match="triton-lang/triton#11584") as info:
        attn.attention(q, k, v)
    assert "cast q, k, v to float16 or float32" in str(info.value)


def test_refusals_say_what_and_how():
    q, k, v, _ = _qkv(1, 3, 2, 4, 5, 16, 16)
    with pytest.raises(BackendError, match=r"q heads \(3\) are not a multiple of kv heads \(2\)"):
        attn.attention(q, k, v)
    q, k, v, _ = _qkv(1, 2, 2, 4, 5, 16, 16)
    with pytest.raises(BackendError, match=r"does not broadcast to \[\.\.\., Hq, Lq, Lk\]"):
        attn.attention(q, k, v, torch.zeros(4, 4))
    with pytest.raises(BackendError, match="dtypes q torch.float32, k torch.float16"):
        attn.attention(q, k.half(), v)
    with pytest.raises(BackendError, match=r"head dims D=320, Dv=16 exceed the kernel's 256"):
        attn.attention(torch.zeros(2, 4, 320), torch.zeros(2, 5, 320), torch.zeros(2, 5, 16))
    with pytest.raises(BackendError, match="need equal leading dims"):
        attn.attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
