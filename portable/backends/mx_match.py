"""Matching MX GEMM operands: a matmul operand that is `mx_dequantize` blocked along the GEMM's
contraction dim, directly or through a 2-D transpose. Shared by the backends that turn
`dq -> mm` into a native MX GEMM (cuda's `mx_rewrite.py`, neuron's `mx_native.py`).
"""

from __future__ import annotations

import dataclasses

import torch

from portable.opset.bind import bind

__all__ = ["Dim", "MXOperand", "dequantized", "mx_operand", "transposed_of"]

aten = torch.ops.aten
_TRANSPOSES = {aten.t.default, aten.permute.default, aten.transpose.int}

Dim = int | str  # a recorded dim: an int, or a symbol's name (dynamic)


@dataclasses.dataclass(frozen=True)
class MXOperand:
    """A 2-D mx_dequantize read by a matmul: its codes and scales, format, output dtype, block
    size, blocked dim (0 or 1) and recorded shape. `flip`: whether codes and scales need a
    transpose to be [rows, K] blocked along dim 1 (set by `_operand`)."""

    codes: torch.fx.Node
    scales: torch.fx.Node
    format: str
    dtype: torch.dtype
    block: int
    axis: int
    shape: tuple[Dim, Dim]
    flip: bool = False


def dequantized(node: torch.fx.Node | None) -> MXOperand | None:
    """The 2-D mx_dequantize that `node` is, with its operands."""
    if node is None or node.op != "call_function":
        return None
    if node.target is not torch.ops.portable.mx_dequantize.default:
        return None
    shape = tuple(node.meta["tensor"].shape)
    if len(shape) != 2:
        return None
    args = bind(node)
    return MXOperand(
        codes=args.node("codes"),
        scales=args.node("scales"),
        format=args.literal("format"),
        dtype=args.literal("dtype"),
        block=args.literal("block_size"),
        axis=args.literal("axis") % 2,
        shape=(shape[0], shape[1]),
    )


def transposed_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """x if `node` is a 2-D transpose of x."""
    if node.op != "call_function" or node.target not in _TRANSPOSES:
        return None
    args = bind(node)
    if node.target is aten.permute.default:
        swaps = [d % 2 for d in args.literal("dims")] == [1, 0]
    elif node.target is aten.transpose.int:
        swaps = {args.literal("dim0") % 2, args.literal("dim1") % 2} == {0, 1}
    else:  # t
        swaps = True
    return args.node("self") if swaps else None


def mx_operand(node: torch.fx.Node, contraction: int) -> MXOperand | None:
    """A matmul operand that is a dequantized MX tensor blocked along the GEMM's contraction
    dim (`contraction` = 1 for the lhs [M, K], 0 for the rhs [K, N]), directly or through a
    transpose. Returns it oriented as [rows, K] blocked along dim 1 (what the native GEMM takes:
    the lhs as is, the rhs as its [N, K] transpose), with `flip` saying whether the codes and
    scales need a transpose to get there."""
    direct = dequantized(node)
    if direct is not None and direct.axis == contraction:
        return dataclasses.replace(direct, flip=contraction == 0)
    inner = dequantized(transposed_of(node))
    if inner is not None and inner.axis == 1 - contraction:
        return dataclasses.replace(inner, flip=contraction == 1)
    return None
