"""Fused scale-mask-softmax forward: `portable::scale_mask_softmax(x, mask=None, scale=1.0, dim=-1)`.

y = softmax(x * scale + mask) along `dim`, computed in float32 and stored in x's dtype (float32,
float16 or bfloat16), with the semantics of `scale_mask_softmax_reference`: a bool mask keeps
True positions (False -> -inf), any other mask is added after scaling, and a row with every
position masked is NaN, as torch.softmax gives.

Layout. The launcher makes x and the mask contiguous (the mask in its own, unbroadcast shape), so
every stride follows from the shapes and `plan_scale_mask_softmax` works from fake tensors. The
kernel reads a row of x along `dim` with stride `sxn` (1 when `dim` is last: constexpr
`X_UNIT_N`), and all other dims collapse into at most three row dims (R0, R1, R2) whose strides
the kernel applies after splitting the row index; the mask is read through its own strides with
0 on every broadcast dim, so it is never expanded to x's shape. Only a mask whose broadcast
pattern leaves more than three row dims after merging is expanded over the row dims (still not
along `dim`). One program handles a [BLOCK_R, BLOCK_N] tile of rows; a row longer than BLOCK_N is
read twice: an online max/sum pass over its blocks, then a pass that writes exp(s - max) / sum.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from portable.errors import BackendError

from . import launch
from ._layout import broadcast_strides, contiguous_strides, int_type, merge_dims, next_pow2

__all__ = ["plan_scale_mask_softmax", "scale_mask_softmax"]

OP = "portable::scale_mask_softmax"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BLOCK_N = 4096  # longest row held in registers at once; longer rows loop over blocks
ROW_TILE = 1024  # elements per tile when several short rows share a program
MAX_BLOCK_R = 16


@triton.jit
def _scores(
    X: tl.tensor, M: tl.tensor, x_row: tl.tensor, m_row: tl.tensor, cols: tl.tensor,
    row_ok: tl.tensor, N: tl.tensor, scale: tl.tensor, sxn: tl.tensor, smn: tl.tensor,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, X_UNIT_N: tl.constexpr, M_UNIT_N: tl.constexpr,
) -> tl.tensor:  # fmt: skip
    """s = x * scale + mask for one [BLOCK_R, BLOCK_N] tile in fp32; -inf where masked or
    outside the tensor."""
    ok = row_ok[:, None] & (cols[None, :] < N)
    x_col = cols if X_UNIT_N else cols * sxn
    x = tl.load(X + x_row[:, None] + x_col[None, :], mask=ok, other=0.0)
    s = x.to(tl.float32) * scale
    if HAS_MASK:
        m_col = cols if M_UNIT_N else cols * smn
        m = tl.load(M + m_row[:, None] + m_col[None, :], mask=ok, other=0)
        if MASK_IS_BOOL:
            ok = ok & (m != 0)
        else:
            s = s + m.to(tl.float32)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _scale_mask_softmax_fwd(
    X: tl.tensor, Y: tl.tensor, M: tl.tensor, scale: tl.tensor,
    n_rows: tl.tensor, R1: tl.tensor, R2: tl.tensor, N: tl.tensor,
    sx0: tl.tensor, sx1: tl.tensor, sx2: tl.tensor, sxn: tl.tensor,
    sm0: tl.tensor, sm1: tl.tensor, sm2: tl.tensor, smn: tl.tensor,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    X_UNIT_N: tl.constexpr, M_UNIT_N: tl.constexpr,
) -> None:  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    i2 = rows % R2
    i1 = (rows // R2) % R1
    i0 = rows // R2 // R1
    x_row = i0 * sx0 + i1 * sx1 + i2 * sx2  # Y has X's shape and strides
    m_row = i0 * sm0 + i1 * sm1 + i2 * sm2
    cols = tl.arange(0, BLOCK_N).to(tl.int64)
    if SINGLE_BLOCK:
        s = _scores(X, M, x_row, m_row, cols, row_ok, N, scale, sxn, smn,
                    HAS_MASK, MASK_IS_BOOL, X_UNIT_N, M_UNIT_N)  # fmt: skip
        # a fully masked row has max -inf, so s - max is NaN there: torch.softmax's answer
        p = tl.exp(s - tl.max(s, 1)[:, None])
        y = p / tl.sum(p, 1)[:, None]
        x_col = cols if X_UNIT_N else cols * sxn
        ok = row_ok[:, None] & (cols[None, :] < N)
        tl.store(Y + x_row[:, None] + x_col[None, :], y.to(Y.dtype.element_ty), mask=ok)
    else:
        # pass 1: running max m and sum row_sum of exp(s - m); m_safe keeps exp finite while a
        # row has seen only masked positions (then m = -inf and row_sum stays 0)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_R], tl.float32)
        for start in range(0, N, BLOCK_N):
            s = _scores(X, M, x_row, m_row, start + cols, row_ok, N, scale, sxn, smn,
                        HAS_MASK, MASK_IS_BOOL, X_UNIT_N, M_UNIT_N)  # fmt: skip
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            row_sum = row_sum * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m = m_new
        # pass 2: a fully masked row has m = -inf, so s - m is NaN there, as in torch.softmax
        for start in range(0, N, BLOCK_N):
            s = _scores(X, M, x_row, m_row, start + cols, row_ok, N, scale, sxn, smn,
                        HAS_MASK, MASK_IS_BOOL, X_UNIT_N, M_UNIT_N)  # fmt: skip
            y = tl.exp(s - m[:, None]) / row_sum[:, None]
            c = start + cols
            x_col = c if X_UNIT_N else c * sxn
            ok = row_ok[:, None] & (c[None, :] < N)
            tl.store(Y + x_row[:, None] + x_col[None, :], y.to(Y.dtype.element_ty), mask=ok)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What the kernel reads, derived from shapes only (plan and launcher share it)."""

    rows: tuple[int, int, int]  # (R0, R1, R2): the dims other than `dim`, merged
    n: int
    x_strides: tuple[int, int, int, int]  # (sx0, sx1, sx2, sxn)
    m_strides: tuple[int, int, int, int]
    mask_shape: tuple[int, ...] | None  # the contiguous shape the launcher gives the mask


def _check(x: Any, mask: Any, dim: int) -> int:
    if x.dtype not in DTYPES:
        raise BackendError(
            f"scale_mask_softmax kernel got x of dtype {x.dtype}",
            op=OP,
            fix="cast x to float32, float16 or bfloat16",
        )
    rank = max(len(x.shape), 1)
    if not -rank <= dim < rank:
        raise BackendError(f"dim {dim} is out of range for x of rank {len(x.shape)}", op=OP)
    if mask is not None:
        if mask.dtype not in launch.TRITON_TYPES:
            raise BackendError(
                f"mask of dtype {mask.dtype} is not supported",
                op=OP,
                fix="give a bool mask (True keeps) or a floating-point additive mask",
            )
        try:
            ok = tuple(torch.broadcast_shapes(tuple(mask.shape), tuple(x.shape))) == tuple(x.shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise BackendError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to x's shape "
                f"{tuple(x.shape)}",
                op=OP,
                fix="give a mask whose dims are 1 or equal to x's, aligned on the right",
            )
    return dim % rank


def _layout(x: Any, mask: Any, dim: int) -> _Layout:
    shape = tuple(int(s) for s in x.shape) or (1,)
    d = _check(x, mask, dim)
    x_st = contiguous_strides(shape)
    mask_shape = None
    m_st = (0,) * len(shape)
    if mask is not None:
        mask_shape = tuple(int(s) for s in mask.shape)
        m_st = broadcast_strides(mask_shape, shape)
    lead = [i for i in range(len(shape)) if i != d]

    def merged(m_st: tuple[int, ...]) -> tuple[list[int], list[list[int]]]:
        return merge_dims(
            [shape[i] for i in lead], [x_st[i] for i in lead], [m_st[i] for i in lead]
        )

    sizes, (xs, ms) = merged(m_st)
    if len(sizes) > 3:
        # an irregular broadcast over many dims: expand the mask over the row dims (not `dim`),
        # which leaves x's own two row groups (before and after `dim`)
        assert mask_shape is not None  # x's own row dims merge into those two groups
        padded = (1,) * (len(shape) - len(mask_shape)) + mask_shape
        mask_shape = tuple(shape[i] if i != d else padded[d] for i in range(len(shape)))
        m_st = broadcast_strides(mask_shape, shape)
        sizes, (xs, ms) = merged(m_st)
    pad = 3 - len(sizes)
    sizes, xs, ms = [1] * pad + sizes, [0] * pad + xs, [0] * pad + ms
    return _Layout(
        rows=(sizes[0], sizes[1], sizes[2]),
        n=shape[d],
        x_strides=(xs[0], xs[1], xs[2], x_st[d]),
        m_strides=(ms[0], ms[1], ms[2], m_st[d]),
        mask_shape=mask_shape,
    )


def _runtime_ints(lay: _Layout) -> list[int]:
    """The kernel's integer parameters, in order, after (X, Y, M, scale)."""
    r0, r1, r2 = lay.rows
    return [r0 * r1 * r2, r1, r2, lay.n, *lay.x_strides, *lay.m_strides]


_INT_PARAMS = ("n_rows", "R1", "R2", "N", "sx0", "sx1", "sx2", "sxn", "sm0", "sm1", "sm2", "smn")


def _plan(x: Any, mask: Any, lay: _Layout, block_n: int | None) -> list[launch.KernelLaunch]:
    ints = _runtime_ints(lay)
    n_rows = ints[0]
    if n_rows == 0 or lay.n == 0:
        return []
    block_n = min(next_pow2(lay.n), next_pow2(block_n or MAX_BLOCK_N))
    block_r = min(next_pow2(n_rows), max(1, ROW_TILE // block_n), MAX_BLOCK_R)
    tile = block_r * block_n
    m_type = launch.triton_type(mask.dtype if mask is not None else x.dtype)
    itype = int_type(*ints)
    signature = {
        "X": launch.triton_type(x.dtype),
        "Y": launch.triton_type(x.dtype),
        "M": m_type,
        "scale": "fp32",
        **dict.fromkeys(_INT_PARAMS, itype),
    }
    constexprs = {
        "BLOCK_R": block_r,
        "BLOCK_N": block_n,
        "SINGLE_BLOCK": lay.n <= block_n,
        "HAS_MASK": mask is not None,
        "MASK_IS_BOOL": mask is not None and mask.dtype == torch.bool,
        "X_UNIT_N": lay.x_strides[3] == 1,
        "M_UNIT_N": lay.m_strides[3] == 1,
    }
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return [
        launch.KernelLaunch(
            kernel="scale_mask_softmax",
            fn=_scale_mask_softmax_fwd,
            signature=signature,
            constexprs=constexprs,
            grid=(-(-n_rows // block_r),),
            grid_rule="(cdiv(n_rows, BLOCK_R),)",
            num_warps=4 if tile <= 2048 else 8,
            num_stages=1 if lay.n <= block_n else 2,
        )
    ]


def plan_scale_mask_softmax(
    x: Any, mask: Any = None, scale: float = 1.0, dim: int = -1, *, block_n: int | None = None
) -> list[launch.KernelLaunch]:
    """The launches `scale_mask_softmax` runs for these arguments, from `.shape`/`.dtype` only
    (fake or meta tensors do). Sizes and strides are runtime ints (those of contiguous x and a
    contiguous mask in its own shape); block sizes, the single-block path, the mask kind and
    unit column strides are constexprs. `block_n` caps the row block (tests use it to make short
    rows loop); the default is the GPU configuration. Empty x needs no launch: []."""
    return _plan(x, mask, _layout(x, mask, dim), block_n)


def scale_mask_softmax(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float = 1.0,
    dim: int = -1,
    *,
    block_n: int | None = None,
) -> torch.Tensor:
    """softmax(x * scale + mask) along `dim` in float32, returned contiguous in x's dtype, on x's
    device. CPU tensors run in Triton's interpreter, which needs TRITON_INTERPRET=1 set before
    triton is imported (see `launch.run`)."""
    lay = _layout(x, mask, dim)
    plans = _plan(x, mask, lay, block_n)
    x = x.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if mask is not None:
        m = mask.to(x.device)
        assert lay.mask_shape is not None  # _layout sets it whenever there is a mask
        if lay.mask_shape != tuple(mask.shape):  # expanded over the row dims (see _layout)
            m = m.reshape((1,) * (x.dim() - m.dim()) + tuple(m.shape)).expand(lay.mask_shape)
        m = m.contiguous()
    else:
        m = x  # never read: HAS_MASK is False
    for plan in plans:
        launch.run(plan, x, y, m, float(scale), *_runtime_ints(lay))
    return y
