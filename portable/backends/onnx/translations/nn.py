"""ONNX translations of the portable ops other than MX, for `torch.onnx.export`'s
`custom_translation_table`.

Each rule takes the op's arguments as the exporter passes them (tensors as ONNX values, attributes
as Python values) and emits ONNX ops of `OPSET` (export.py's opset). Every rule computes what the
op's CPU kernel computes (portable/opset/nn_ops.py, collectives.py); the parity tests hold each to
rtol 1e-5 against the `cpu` backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from onnxscript import BOOL, FLOAT, INT64
from onnxscript import opset23 as op

__all__ = ["TRANSLATIONS"]

_PORTABLE = torch.ops.portable


# onnxscript's stubs type a Constant's or a Cast's result as any tensor type; these helpers give
# it the type its attribute fixes (ONNX type numbers: 1 FLOAT, 9 BOOL).


def _float(value: float) -> FLOAT:
    return cast(FLOAT, op.Constant(value_float=value))


def _int(value: int) -> INT64:
    return cast(INT64, op.Constant(value_int=value))


def _ints(values: list[int]) -> INT64:
    return cast(INT64, op.Constant(value_ints=values))


def _to_float(x) -> FLOAT:
    return cast(FLOAT, op.Cast(x, to=1))


def _to_bool(x) -> BOOL:
    return cast(BOOL, op.Cast(x, to=9))


def _is_4d(value) -> bool:
    shape = getattr(value, "shape", None)
    return shape is not None and len(shape) == 4


def attention(q, k, v, mask=None, is_causal: bool = False, scale: float | None = None):
    """softmax(q @ k^T * scale + mask) @ v.

    [batch, heads, seq, head_dim] operands -> ONNX `Attention` (opset 23): bool masks keep True,
    causal is top-left (upper-left causal bias), kv heads repeat for GQA: the portable semantics.
    Other ranks -> the decomposition below (ONNX reads 3-D operands as [batch, seq, hidden])."""
    if _is_4d(q) and _is_4d(k) and _is_4d(v):
        attrs: dict = {"is_causal": int(bool(is_causal))}
        if scale is not None:
            attrs["scale"] = float(scale)
        # the optional outputs (present key/value, scores) are unused: the first is y
        if mask is None:
            return op.Attention(q, k, v, **attrs)[0]
        return op.Attention(q, k, v, mask, **attrs)[0]
    return _attention_decomposed(q, k, v, mask, is_causal, scale)


def _attention_decomposed(q, k, v, mask, is_causal, scale):
    # softmax(q @ k^T * scale + mask [+ causal]) @ v; scale defaults to 1 / sqrt(head_dim)
    k, v = _repeat_kv(q, k), _repeat_kv(q, v)
    head_dim = _to_float(op.Shape(q, start=-1))
    s = op.MatMul(q, op.Transpose(k, perm=_swap_last(len(q.shape))))
    if scale is None:
        scale_value = op.Div(_float(1.0), op.Sqrt(head_dim))
        s = op.Mul(s, op.CastLike(scale_value, s))
    else:
        s = op.Mul(s, op.CastLike(_float(float(scale)), s))
    if mask is not None:
        s = _apply_mask(s, mask)
    if is_causal:
        lq, lk = op.Shape(s, start=-2, end=-1), op.Shape(s, start=-1)
        ones = op.Expand(_int(1), op.Concat(lq, lk, axis=0))
        keep = _to_bool(op.Trilu(ones, upper=0))  # top-left causal: keep j <= i
        s = op.Where(keep, s, _minus_inf(s))
    return op.MatMul(op.Softmax(s, axis=-1), v)


def _repeat_kv(q, t):
    """Repeat each kv head (dim -3) for grouped-query attention: [.., hk, s, d] ->
    [.., hk * group, s, d], as `repeat_interleave(group, dim=-3)`."""
    if len(q.shape) < 3 or q.shape[-3] == t.shape[-3]:
        return t
    group = int(q.shape[-3]) // int(t.shape[-3])
    grouped = op.Unsqueeze(t, _ints([-3]))  # [.., hk, 1, s, d]
    ones = _ints([1] * (len(t.shape) - 3))
    tile = op.Concat(ones, _ints([1, group, 1, 1]), axis=0)
    lead, tail = op.Shape(t, end=-3), op.Shape(t, start=-2)
    heads = _ints([int(q.shape[-3])])
    return op.Reshape(op.Tile(grouped, tile), op.Concat(lead, heads, tail, axis=0))


def _swap_last(rank: int) -> list[int]:
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return perm


def _apply_mask(s, mask):
    """bool masks keep True (False -> -inf); float masks are added."""
    if mask.dtype is not None and mask.dtype.name == "BOOL":
        return op.Where(mask, s, _minus_inf(s))
    return op.Add(s, op.CastLike(mask, s))


def _minus_inf(like):
    return op.CastLike(_float(float("-inf")), like)


def scale_mask_softmax(x, mask=None, scale: float = 1.0, dim: int = -1):
    """softmax(x * scale + mask) along dim, computed in float32 (float64 stays), result in x's
    dtype: the CPU kernel's order of operations."""
    wide = x.dtype is not None and x.dtype.name == "DOUBLE"
    s = x if wide else _to_float(x)
    s = op.Mul(s, op.CastLike(_float(float(scale)), s))
    if mask is not None:
        s = _apply_mask(s, mask)
    return op.CastLike(op.Softmax(s, axis=dim), x)


def rms_norm(x, normalized_shape, weight=None, eps: float | None = None):
    """x * rsqrt(mean(x^2) + eps) * weight -> ONNX `RMSNormalization` (opset 23); eps defaults
    to the dtype's machine epsilon, as torch.rms_norm."""
    if eps is None:
        eps = torch.finfo(_torch_dtype(x)).eps
    scale = weight if weight is not None else _ones(x, normalized_shape)
    return op.RMSNormalization(x, scale, axis=-len(normalized_shape), epsilon=float(eps))


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """(x - mean) * rsqrt(var + eps) * weight + bias -> ONNX `LayerNormalization`."""
    scale = weight if weight is not None else _ones(x, normalized_shape)
    axis = -len(normalized_shape)
    if bias is None:
        return op.LayerNormalization(x, scale, axis=axis, epsilon=float(eps))[0]
    # outputs: y, mean, inverse std (the latter two unused)
    return op.LayerNormalization(x, scale, bias, axis=axis, epsilon=float(eps))[0]


def _ones(x, normalized_shape):
    shape = _ints([int(d) for d in normalized_shape])
    return op.Expand(op.CastLike(_float(1.0), x), shape)


_ONNX_TO_TORCH = {
    "FLOAT": torch.float32,
    "DOUBLE": torch.float64,
    "FLOAT16": torch.float16,
    "BFLOAT16": torch.bfloat16,
}


def _torch_dtype(x) -> torch.dtype:
    return _ONNX_TO_TORCH.get(x.dtype.name if x.dtype is not None else "FLOAT", torch.float32)


# Collectives over a group of one rank are the identity (the CPU kernels' `_single_rank`); the
# backend refuses groups of more than one rank before export (backend.py).


def all_reduce(x, reduce_op: str, axis: str, group_size: int):
    return op.Identity(x)


def all_gather(x, dim: int, axis: str, group_size: int):
    return op.Identity(x)


def reduce_scatter(x, reduce_op: str, dim: int, axis: str, group_size: int):
    return op.Identity(x)


def all_to_all(x, split_dim: int, concat_dim: int, axis: str, group_size: int):
    return op.Identity(x)


def local_shard(x, dim: int, axis: str, group_size: int):
    return op.Identity(x)


def wait(x):
    return op.Identity(x)


TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {
    _PORTABLE.attention.default: attention,
    _PORTABLE.scale_mask_softmax.default: scale_mask_softmax,
    _PORTABLE.rms_norm.default: rms_norm,
    _PORTABLE.layer_norm.default: layer_norm,
    _PORTABLE.all_reduce.default: all_reduce,
    _PORTABLE.all_gather.default: all_gather,
    _PORTABLE.reduce_scatter.default: reduce_scatter,
    _PORTABLE.all_to_all.default: all_to_all,
    _PORTABLE.local_shard.default: local_shard,
    _PORTABLE.wait.default: wait,
}
