"""Native MX matmul on archs that have it (sm_100); `dequantize -> matmul` elsewhere.

Pattern (after the mx-quantize pass in `real` mode, or written by hand):

    # mm(mx_dequantize(a, sa, f, axis=1), t(mx_dequantize(b, sb, f, axis=1)))     a: [M, K], b: [N, K]
    #   == dequantize(a) @ dequantize(b)^T                  -> mx_matmul(a, sa, b, sb, f, dtype)
    # addmm(bias, <same>)                                   -> mx_matmul(..., bias)

Both operands quantized along K (the contraction dim), block 32, FP8 elements (e4m3 / e5m2):
that is what cuBLAS's block-scaled GEMM takes, with E8M0 scales in the 128x4 swizzled layout.
Other formats, other axes or sizes the GEMM does not take stay emulated, and the decision says
why. On archs without native MX every match is recorded as emulated.
"""

from __future__ import annotations

import torch

from portable.ir.source import source_of

from .targets import CudaArch

__all__ = ["native_mx_available", "rewrite_mx_matmuls", "scaled_mm_mx"]

aten = torch.ops.aten
NATIVE_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_TRANSPOSES = {aten.t.default, aten.permute.default, aten.transpose.int}


def _dequantize_along_k(node) -> dict | None:
    """The mx_dequantize feeding a matmul operand, if it is 2-D and quantized along dim 1."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return None
    if node.target is not torch.ops.portable.mx_dequantize.default:
        return None
    codes, scales, fmt, axis, dtype = node.args[:5]
    block = node.args[5] if len(node.args) > 5 else node.kwargs.get("block_size", 32)
    shape = tuple(node.meta["val"].shape)
    if len(shape) != 2 or axis not in (1, -1):
        return None
    return {
        "codes": codes,
        "scales": scales,
        "format": fmt,
        "dtype": dtype,
        "block": block,
        "shape": shape,
        "node": node,
    }


def _transposed(node) -> torch.fx.Node | None:
    if (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target in _TRANSPOSES
    ):
        if node.target is aten.permute.default and list(node.args[1]) != [1, 0]:
            return None
        return node.args[0]
    return None


def _native_refusal(a: dict, b: dict) -> str:
    """Why cuBLAS's block-scaled GEMM cannot take these operands ("" if it can)."""
    (m, k), (n, _) = a["shape"], b["shape"]
    if a["format"] != b["format"] or a["format"] not in NATIVE_FORMATS:
        return f"format {a['format']}/{b['format']}: native MX matmul here takes e4m3 or e5m2"
    if a["block"] != 32 or b["block"] != 32:
        return "block size must be 32"
    if m % 16 or n % 16 or k % 32:
        return f"M={m}, N={n}, K={k}: the GEMM needs M, N multiples of 16 and K of 32"
    if a["dtype"] not in (torch.bfloat16, torch.float16, torch.float32):
        return f"output dtype {a['dtype']}"
    return ""


def rewrite_mx_matmuls(gm: torch.fx.GraphModule, arch: CudaArch) -> list:
    """Replace every native-capable MX matmul in `gm` for `arch`; return one Decision each."""
    from .dispatch import KERNEL_OPS
    from .lowering import Decision

    mx_matmul = KERNEL_OPS["mx_matmul"].op
    decisions = []
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
            continue
        bias, lhs, rhs = (None, *node.args[:2]) if node.target is aten.mm.default else node.args[:3]
        a = _dequantize_along_k(lhs)
        b = _dequantize_along_k(_transposed(rhs))
        if a is None or b is None:
            continue
        src = source_of(node)
        where = src.location() if src else None
        why = _native_refusal(a, b) if arch.native_mx else f"{arch.name} has no MX matmul"
        if why:
            decisions.append(Decision(node.name, "mx_matmul", "emulated-mx", why, where))
            continue
        with graph.inserting_before(node):
            new = graph.call_function(
                mx_matmul,
                (a["codes"], a["scales"], b["codes"], b["scales"], a["format"], a["dtype"], bias),
            )
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        decisions.append(Decision(new.name, "mx_matmul", "native-mx", "", where))
    graph.eliminate_dead_code()
    return decisions


def native_mx_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] == 10


def scaled_mm_mx(a_codes, a_scales, b_codes, b_scales, fmt, dtype, bias=None):
    """cuBLAS block-scaled GEMM: FP8 codes reinterpreted as float8, E8M0 scales swizzled."""
    from portable.mx import swizzle_scales

    element = NATIVE_FORMATS[fmt]
    a = a_codes.view(element)
    b = b_codes.view(element).t()  # [K, N], column-major: what _scaled_mm wants for its rhs
    sa = swizzle_scales(a_scales).view(torch.float8_e8m0fnu)
    sb = swizzle_scales(b_scales).view(torch.float8_e8m0fnu)
    out = torch._scaled_mm(a, b, sa, sb, out_dtype=dtype)
    return out if bias is None else out + bias
