"""The MX matmul rewrite: `dequantize -> matmul` becomes the native MX matmul where the arch
has one (sm_100), and stays emulated elsewhere; each match gets a Decision saying which and why.

Pattern (after the mx-quantize pass in `real` mode, or written by hand):

    # mm(dq(a, axis=1), t(dq(b, axis=1)))   a: [M, K], b: [N, K]
    #   == dq(a) @ dq(b)^T                                  -> mx_matmul(a, sa, b, sb, f, dtype)
    # mm(dq(a, axis=1), dq(c, axis=0))      c: [K, N]  (== the above with b = c^T)
    # mm(t(dq(d, axis=0)), ...)             d: [K, M]  (the lhs transposed: weight gradients)
    # addmm(bias, <same>)                                   -> mx_matmul(..., bias)

Both operands quantized along K (the contraction dim), block 32, FP8 elements (e4m3 / e5m2):
that is what cuBLAS's block-scaled GEMM takes, with E8M0 scales in the 128x4 swizzled layout.
Other formats, other axes or sizes the GEMM does not take stay emulated, and the decision says
why. On archs without native MX every match is recorded as emulated. The GEMM itself is
`mx_gemm.py`; the kernel-graph op that calls it is `dispatch.KERNEL_OPS["mx_matmul"]`.
"""

from __future__ import annotations

import torch

from portable.ir.rewriter import Rewriter
from portable.ir.signature import TensorSpec
from portable.ir.source import source_of
from portable.opset.bind import bind

from ..mx_match import Dim
from ..mx_match import MXOperand as _MXOperand
from ..mx_match import mx_operand as _operand
from .decisions import Decision
from .dispatch import KERNEL_OPS
from .mx_gemm import NATIVE_FORMATS
from .targets import CudaArch

__all__ = ["rewrite_mx_matmuls"]

aten = torch.ops.aten


def _t(rw: Rewriter, x: torch.fx.Node) -> torch.fx.Node:
    """t(x) at the insertion point, its recorded shape reversed (dims may be symbols)."""
    spec = x.meta["tensor"]
    tensor = TensorSpec(tuple(reversed(spec.shape)), spec.dtype)
    return rw.call(aten.t.default, (x,), tensor=tensor, name=None)  # fx's naming: %t_default


def _oriented(rw: Rewriter, operand: _MXOperand) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(codes, scales) as [rows, K] / [rows, K // 32] graph values (transposing if needed)."""
    if not operand.flip:
        return operand.codes, operand.scales
    codes = _t(rw, operand.codes)
    return codes, _t(rw, operand.scales)


def _rows_k(operand: _MXOperand) -> tuple[Dim, Dim]:
    rows, k = operand.shape
    return (k, rows) if operand.flip and operand.axis == 0 else (rows, k)


def _native_refusal(a: _MXOperand, b: _MXOperand) -> str:
    """Why cuBLAS's block-scaled GEMM cannot take these operands ("" if it can)."""
    (m, k), (n, _) = _rows_k(a), _rows_k(b)
    if a.format != b.format or a.format not in NATIVE_FORMATS:
        return f"format {a.format}/{b.format}: native MX matmul here takes e4m3 or e5m2"
    if a.block != 32 or b.block != 32:
        return "block size must be 32"
    if not (isinstance(m, int) and isinstance(n, int) and isinstance(k, int)):
        dynamic = [d for d in (m, n, k) if isinstance(d, str)]
        return f"dynamic dims {', '.join(dynamic)}: the GEMM needs static M, N and K"
    if m % 16 or n % 16 or k % 32:
        return f"M={m}, N={n}, K={k}: the GEMM needs M, N multiples of 16 and K of 32"
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"output dtype {a.dtype}"
    return ""


def rewrite_mx_matmuls(
    gm: torch.fx.GraphModule, arch: CudaArch, mode: str | None = None
) -> list[Decision]:
    """Replace every native-capable MX matmul in `gm` for `arch`; return one Decision each.

    `mode` is the mx-quantize pass's (program metadata): "fake" keeps every MX matmul emulated
    (fake quantization means emulation on every target); "real" or hand-written MX ops use the
    native GEMM where the arch has one."""
    mx_matmul = KERNEL_OPS["mx_matmul"].op
    decisions: list[Decision] = []
    graph = gm.graph
    rw = Rewriter(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
            continue
        args = bind(node)
        if node.target is aten.mm.default:
            bias, lhs, rhs = None, args.node("self"), args.node("mat2")
        else:  # addmm(bias, lhs, rhs)
            bias, lhs, rhs = args.node("self"), args.node("mat1"), args.node("mat2")
        a, b = _operand(lhs, 1), _operand(rhs, 0)
        if a is None or b is None:
            continue
        src = source_of(node)
        where = src.location() if src else None
        if mode == "fake":
            why = "mx-quantize mode=fake: fake quantization is emulated on every target"
        elif not arch.native_mx:
            why = f"{arch.name} has no MX matmul"
        elif node.target is aten.addmm.default and (args.beta != 1 or args.alpha != 1):
            why = "addmm with alpha or beta other than 1: the native GEMM adds the bias as is"
        else:
            why = _native_refusal(a, b)
        if why:
            decisions.append(Decision(node.name, "mx_matmul", "emulated-mx", why, where))
            continue
        with rw.at(before=node):
            a_codes, a_scales = _oriented(rw, a)
            b_codes, b_scales = _oriented(rw, b)
            new = graph.call_function(
                mx_matmul, (a_codes, a_scales, b_codes, b_scales, a.format, a.dtype, bias)
            )
        new.meta = dict(node.meta)  # the matmul's value, type and source line
        rw.replace(node, new)
        decisions.append(Decision(new.name, "mx_matmul", "native-mx", "", where))
    graph.eliminate_dead_code()
    return decisions
