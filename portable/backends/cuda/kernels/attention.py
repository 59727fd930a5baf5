"""Attention forward with online softmax (FlashAttention-2 style):
`portable::attention(q, k, v, mask=None, is_causal=False, scale=None)`.

out = softmax(q @ k^T * scale + mask) @ v with the semantics of `attention_reference`. Each
program owns BLOCK_M query rows of one (batch, head) and walks the keys in blocks of BLOCK_N,
keeping a running row max, a running sum of exp(s - max) and an fp32 accumulator rescaled as the
max grows; no Lq x Lk tensor ever exists. Scores, softmax and accumulation are fp32; the dots
take q/k/v in their own dtype (tensor cores for fp16/bf16; IEEE fp32, not TF32, for fp32) and
the probabilities are cast to v's dtype for the second dot, as FlashAttention does. The output
has q's dtype.

Which cases this kernel is for (the lowering decides when to call it): those that PyTorch's
fused SDPA kernels do not cover, where SDPA would refuse or fall back to its unfused math path
(an Lq x Lk tensor in memory):
  - a mask together with `is_causal`: SDPA refuses the pair (the reference folds causal into
    the mask, which materializes an Lq x Lk tensor);
  - float32 inputs with a bool or additive mask: the flash kernel takes neither fp32 nor masks,
    and the memory-efficient kernel only some mask layouts and alignments;
  - head dims the flash kernels refuse (not a multiple of 8, or fp32 at any size): here any
    D, Dv <= 256, each padded to the next power of two (at least 16) with the padding masked;
  - grouped-query attention without repeating k/v (q head h reads kv head h // (Hq // Hk)).

Conventions. q is [..., Hq, Lq, D], k [..., Hk, Lk, D], v [..., Hk, Lk, Dv] with the same leading
dims (flattened into one batch dim; a 3-D [H, L, D] input has batch 1). `scale` defaults to
1 / sqrt(D). A bool mask keeps True; any other mask is added to the scaled scores; masks
broadcast to [..., Hq, Lq, Lk] and are read through strides with 0 on broadcast dims.
`is_causal` is top-left aligned (query i sees keys j <= i), also when Lq != Lk and together with
a mask. A query row whose every key is masked gets 0, which is what `attention_reference` (SDPA
on CPU) returns there, not NaN.

Layout. The launcher makes q, k, v and the mask (in its own, unbroadcast shape) contiguous, so
strides follow from shapes and `plan_attention` works from fake tensors; the innermost strides
are 1 (the mask's is 1, or 0 when it broadcasts over keys: constexpr `MASK_BCAST_N`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import triton
import triton.language as tl

from portable.errors import BackendError
from portable.opset.nn_ops import with_attention_layout

from . import launch
from ._layout import broadcast_strides, contiguous_strides, int_type, merge_dims, next_pow2

__all__ = ["plan_attention", "attention"]

OP = "portable::attention"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@triton.jit
def _attention_fwd(
    Q: tl.tensor, K: tl.tensor, V: tl.tensor, Out: tl.tensor, M: tl.tensor, scale: tl.tensor,
    Hq: tl.tensor, group: tl.tensor, Lq: tl.tensor, Lk: tl.tensor, D: tl.tensor, Dv: tl.tensor,
    sqb: tl.tensor, sqh: tl.tensor, sqm: tl.tensor, skb: tl.tensor, skh: tl.tensor, skn: tl.tensor,
    svb: tl.tensor, svh: tl.tensor, svn: tl.tensor, sob: tl.tensor, soh: tl.tensor, som: tl.tensor,
    smb: tl.tensor, smh: tl.tensor, smm: tl.tensor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    MASK_BCAST_N: tl.constexpr, IS_CAUSAL: tl.constexpr, INPUT_PRECISION: tl.constexpr,
) -> None:  # fmt: skip
    # program id -> (query block, batch * head), query blocks fastest: neighbours share k/v in L2
    num_m = tl.cdiv(Lq, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % num_m
    pid_bh = pid // num_m
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    hk = h // group  # grouped-query attention: `group` q heads share one kv head

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    m_base = M + b * smb + h * smh + offs_m.to(tl.int64)[:, None] * smm  # Lq * Lk may pass 2**31

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp(score - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    hi = Lk
    if IS_CAUSAL:  # keys past the block's last query are masked for every row: skip them
        hi = tl.minimum(Lk, (pid_m + 1) * BLOCK_M)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < Lk
        kt = tl.load(
            k_base + offs_n[None, :] * skn + offs_d[:, None],
            mask=key_ok[None, :] & (offs_d[:, None] < D),
            other=0.0,
        )
        s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * scale
        keep = key_ok[None, :] & row_ok[:, None]
        if IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        if HAS_MASK:
            m_ptr = m_base if MASK_BCAST_N else m_base + offs_n[None, :]
            mask = tl.load(m_ptr, mask=row_ok[:, None] & key_ok[None, :], other=0)
            if MASK_IS_BOOL:
                keep = keep & (mask != 0)
            else:
                s = s + mask.to(tl.float32)
        s = tl.where(keep, s, float("-inf"))
        # online softmax; m_safe keeps exp finite while a row has seen only masked keys
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + offs_n[:, None] * svn + offs_dv[None, :],
            mask=key_ok[:, None] & (offs_dv[None, :] < Dv),
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    # rows whose every key is masked have l_i = 0 and acc = 0: they get 0, like the reference
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + b * sob + h * soh + offs_m[:, None] * som + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < Dv),
    )


@triton.jit
def _bf16_dot_probe(A, C):
    r = tl.arange(0, 16)
    a = tl.load(A + r[:, None] * 16 + r[None, :])
    tl.store(C + r[:, None] * 16 + r[None, :], tl.dot(a, a))


_PROBE = launch.KernelLaunch(
    kernel="bf16_dot_probe",
    fn=_bf16_dot_probe,
    signature={"A": "*bf16", "C": "*fp32"},
    constexprs={},
    grid=(1,),
    grid_rule="(1,)",
)


def _check_interpreter_bf16_dot() -> None:
    """Triton's interpreter multiplies the bit patterns of bf16 `tl.dot` operands
    (triton-lang/triton#11584): refuse rather than return garbage where it still does."""
    a = torch.ones(16, 16, dtype=torch.bfloat16)
    c = torch.zeros(16, 16, dtype=torch.float32)
    launch.run(_PROBE, a, c)
    if not bool((c == 16).all()):
        raise BackendError(
            "Triton's interpreter cannot run bfloat16 tl.dot (triton-lang/triton#11584), so the "
            "attention kernel cannot run bfloat16 CPU tensors",
            op=OP,
            fix="run on CUDA tensors, or cast q, k, v to float16 or float32 on CPU",
        )


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What the kernel reads, derived from shapes only (plan and launcher share it)."""

    batch: int  # the leading dims, flattened
    hq: int
    hk: int
    lq: int
    lk: int
    d: int
    dv: int
    mask_strides: tuple[int, int, int, int]  # (smb, smh, smm, smn) over [batch, Hq, Lq, Lk]
    mask_shape: tuple[int, ...] | None  # the contiguous shape the launcher gives the mask


def _fail(what: str, fix: str | None = None) -> BackendError:
    return BackendError(what, op=OP, fix=fix)


def _layout(q: Any, k: Any, v: Any, mask: Any) -> _Layout:
    qs, ks, vs = (tuple(int(s) for s in t.shape) for t in (q, k, v))
    if len(qs) < 3 or len(ks) != len(qs) or len(vs) != len(qs):
        raise _fail(
            f"attention kernel needs q, k, v of one rank >= 3 ([..., H, L, D]); got shapes "
            f"{qs}, {ks}, {vs}"
        )
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise _fail(
            f"attention kernel got dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}",
            fix="give q, k and v one dtype among float32, float16 and bfloat16",
        )
    lead = qs[:-3]
    (hq, lq, d), (hk, lk, dk), (hv, lv, dv) = qs[-3:], ks[-3:], vs[-3:]
    if ks[:-3] != lead or vs[:-3] != lead or dk != d or (hv, lv) != (hk, lk):
        raise _fail(
            f"attention shapes do not agree: q {qs}, k {ks}, v {vs} (need equal leading dims, "
            f"k's head dim = q's, and v's heads and length = k's)"
        )
    if hk == 0 or hq % hk:
        raise _fail(
            f"q heads ({hq}) are not a multiple of kv heads ({hk})",
            fix="grouped-query attention needs Hq = group * Hk",
        )
    if d < 1 or max(d, dv) > MAX_HEAD_DIM:
        raise _fail(
            f"head dims D={d}, Dv={dv} exceed the kernel's {MAX_HEAD_DIM}",
            fix="use the reference or SDPA lowering for larger heads",
        )
    batch = math.prod(lead)
    target = (*lead, hq, lq, lk)
    if mask is None:
        return _Layout(batch, hq, hk, lq, lk, d, dv, (0, 0, 0, 0), None)
    if mask.dtype not in launch.TRITON_TYPES:
        raise _fail(
            f"mask of dtype {mask.dtype} is not supported",
            fix="give a bool mask (True keeps) or a floating-point additive mask",
        )
    mask_shape = tuple(int(s) for s in mask.shape)
    try:
        ok = tuple(torch.broadcast_shapes(mask_shape, target)) == target
    except RuntimeError:
        ok = False
    if not ok:
        raise _fail(
            f"mask of shape {mask_shape} does not broadcast to [..., Hq, Lq, Lk] = {target}",
            fix="give a mask whose dims are 1 or equal to those, aligned on the right",
        )
    strides = broadcast_strides(mask_shape, target)
    sizes, (lead_st,) = merge_dims(lead, strides[: len(lead)])
    if len(sizes) > 1:
        # the leading dims broadcast irregularly: expand the mask over them only
        tail = ((1,) * 3 + mask_shape)[-3:]
        mask_shape = (*lead, *tail)
        strides = broadcast_strides(mask_shape, target)
        sizes, (lead_st,) = merge_dims(lead, strides[: len(lead)])
    smb = lead_st[0] if lead_st else 0
    mask_strides = (smb, strides[-3], strides[-2], strides[-1])
    return _Layout(batch, hq, hk, lq, lk, d, dv, mask_strides, mask_shape)


_INT_PARAMS = (
    "Hq", "group", "Lq", "Lk", "D", "Dv",
    "sqb", "sqh", "sqm", "skb", "skh", "skn", "svb", "svh", "svn", "sob", "soh", "som",
    "smb", "smh", "smm",
)  # fmt: skip


def _runtime_ints(lay: _Layout) -> list[int]:
    """The kernel's integer parameters, in order, after (Q, K, V, Out, M, scale)."""
    q_st = contiguous_strides((lay.batch, lay.hq, lay.lq, lay.d))
    k_st = contiguous_strides((lay.batch, lay.hk, lay.lk, lay.d))
    v_st = contiguous_strides((lay.batch, lay.hk, lay.lk, lay.dv))
    o_st = contiguous_strides((lay.batch, lay.hq, lay.lq, lay.dv))
    return [
        lay.hq, lay.hq // lay.hk, lay.lq, lay.lk, lay.d, lay.dv,
        *q_st[:3], *k_st[:3], *v_st[:3], *o_st[:3], *lay.mask_strides[:3],
    ]  # fmt: skip


def _config(dtype: torch.dtype, head: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for H100/B200 by dtype and padded head dim.
    fp32 runs IEEE dots without tensor cores and holds twice the bytes per tile: smaller tiles."""
    if dtype == torch.float32:
        if head <= 64:
            return 64, 64, 4, 2
        return (64, 32, 4, 2) if head <= 128 else (32, 32, 4, 1)
    if head <= 64:
        return 128, 64, 4, 3
    return (128, 64, 8, 3) if head <= 128 else (64, 64, 4, 2)


def _plan(
    q: Any, mask: Any, is_causal: bool, lay: _Layout, block_m: int | None, block_n: int | None
) -> list[launch.KernelLaunch]:
    if lay.batch * lay.hq * lay.lq == 0 or lay.dv == 0:
        return []
    block_d, block_dv = max(16, next_pow2(lay.d)), max(16, next_pow2(lay.dv))
    bm, bn, warps, stages = _config(q.dtype, max(block_d, block_dv))
    bm, bn = block_m or bm, block_n or bn
    ints = _runtime_ints(lay)
    num_m = -(-lay.lq // bm)
    signature = {
        **dict.fromkeys(("Q", "K", "V", "Out"), launch.triton_type(q.dtype)),
        "M": launch.triton_type(mask.dtype if mask is not None else q.dtype),
        "scale": "fp32",
        **dict.fromkeys(_INT_PARAMS, int_type(*ints)),
    }
    constexprs = {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_D": block_d,
        "BLOCK_DV": block_dv,
        "HAS_MASK": mask is not None,
        "MASK_IS_BOOL": mask is not None and mask.dtype == torch.bool,
        "MASK_BCAST_N": mask is not None and lay.mask_strides[3] == 0,
        "IS_CAUSAL": bool(is_causal),
        "INPUT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return [
        launch.KernelLaunch(
            kernel="attention_fwd",
            fn=_attention_fwd,
            signature=signature,
            constexprs=constexprs,
            grid=(num_m * lay.batch * lay.hq,),
            grid_rule="(cdiv(Lq, BLOCK_M) * B * Hq,)",
            num_warps=warps,
            num_stages=stages,
        )
    ]


def plan_attention(
    q: Any,
    k: Any,
    v: Any,
    mask: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> list[launch.KernelLaunch]:
    """The launches `attention` runs for these arguments, from `.shape`/`.dtype` only (fake or
    meta tensors do). Sizes and strides are runtime ints (those of contiguous q, k, v, out and
    a contiguous mask in its own shape); block sizes, the padded head dims, the mask kind,
    causality and the dot precision are constexprs. `block_m`/`block_n` override the GPU
    configuration (tests use them for small shapes). Empty outputs need no launch: []."""
    return _plan(q, mask, is_causal, _layout(q, k, v, mask), block_m, block_n)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask) @ v in q's dtype on q's device, of shape
    [..., Hq, Lq, Dv] and in `portable::attention`'s output layout (`attention_strides`: the
    kernel writes a contiguous result, copied when that layout differs). CPU tensors run in
    Triton's interpreter, which needs TRITON_INTERPRET=1 set before triton is imported (see
    `launch.run`)."""
    lay = _layout(q, k, v, mask)
    plans = _plan(q, mask, is_causal, lay, block_m, block_n)
    layout_of = (q, k, v, mask, is_causal, scale)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if mask is not None:
        m = mask.to(q.device)
        assert lay.mask_shape is not None  # _layout sets it whenever there is a mask
        if lay.mask_shape != tuple(mask.shape):  # expanded over the leading dims (see _layout)
            m = m.reshape((1,) * (len(lay.mask_shape) - m.dim()) + tuple(m.shape))
            m = m.expand(lay.mask_shape)
        m = m.contiguous()
    else:
        m = q  # never read: HAS_MASK is False
    scale = 1.0 / math.sqrt(lay.d) if scale is None else float(scale)
    if plans and q.dtype == torch.bfloat16 and launch.interpreted(_attention_fwd):
        _check_interpreter_bf16_dot()
    for plan in plans:
        launch.run(plan, q, k, v, out, m, scale, *_runtime_ints(lay))
    return with_attention_layout(out, *layout_of)
