"""MX GEMMs on Trainium3: `dq -> mm` becomes QuantizeMX per operand + one block-scaled dot.

Pattern (after the mx-quantize pass; the matcher is cuda's, `backends/mx_match.py`):

    # mm(dq(q(u, axis=1)), dq(q(v, axis=0)))              u: [M, K], v: [K, N]
    #   -> block_scaled_dot(QuantizeMX(u, dim=-1), QuantizeMX(v, dim=-2), contracting (1, 0))
    # an operand t(dq(q(u, axis))) contracts u along `axis` too: contracting dims are the
    #   quantized dims of the high-precision sources, whichever way the GEMM reads them
    # addmm(bias, <same>) -> <same> + bias

Each match is one `MXGemm` decision: native where the recipe fits the custom calls (format
e4m3 / e5m2, scale rule emax, block 32, bf16 / f16 operands, the quantized dim the last or
second-to-last of its source and divisible by 4 and 32, static shapes, addmm with alpha = beta
= 1, on a target with MX and `NeuronOptions(mx="native")`), emulated otherwise with the reason.
The mx-quantize pass's `mode` (fake / real) is cuda's convention: on neuron the native path is
exact quantization (EMAX bytes are what the hardware computes), so both modes lower natively.

A native GEMM node keeps its name (HLO metadata and findings point at it) and becomes a call of
`native_mx_gemm`, a target outside the opset that only this backend lowers (`gemm_rules`); the
quantize / dequantize / transpose nodes it no longer reads are erased.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from portable.errors import LoweringError
from portable.ir.program import Program
from portable.ir.rewriter import Rewriter
from portable.ir.source import source_of
from portable.opset.bind import bind

from ..mx_match import MXOperand, mx_operand
from ..xla.dtypes import to_jax
from ..xla.rules._util import out_dtype
from .mx_calls import BLOCK, ELEMENT_DTYPES, PACK, block_scaled_dot, quantize_mx
from .options import NeuronOptions
from .targets import NeuronTarget

__all__ = ["MXGemm", "gemm_rules", "lower_mx_gemms", "native_mx_gemm"]

aten = torch.ops.aten
_QUANTIZE = torch.ops.portable.mx_quantize.default
_OPERAND_DTYPES = (torch.bfloat16, torch.float16)
_RESULT_DTYPES = (torch.float32, torch.bfloat16)  # EVRF045


@dataclasses.dataclass(frozen=True)
class MXGemm:
    """How one MX GEMM lowers: `lowering` "native" (QuantizeMX + __op$block_scaled_dot) or
    "emulated" (integer HLO), `reason` why it is emulated, `role` forward / input_grad /
    weight_grad (from the mx-quantize record; "" when hand-written)."""

    node: str
    role: str
    lowering: str
    reason: str = ""
    source: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in ("", None)}

    def line(self) -> str:
        why = f": {self.reason}" if self.reason else ""
        where = f" ({self.source})" if self.source else ""
        return f"{self.node} {self.role or 'gemm'} {self.lowering}{why}{where}"


def native_mx_gemm(*args: Any, **kwargs: Any) -> Any:
    """Graph target of a native MX GEMM (see the module docstring); lowered, never called."""
    raise LoweringError(
        "native_mx_gemm is lowered by the neuron backend only",
        backend="neuron",
        fix="lower the program with portable.lower(..., 'neuron:trn3')",
    )


@dataclasses.dataclass(frozen=True)
class _Side:
    """One GEMM operand as QuantizeMX sees it: the quantized source tensor, its quantized dim,
    and the quantize / dequantize arguments."""

    source: torch.fx.Node
    axis: int  # normalized, 0 <= axis < rank
    shape: tuple[Any, ...]
    dtype: torch.dtype
    format: str
    scale_rule: str
    block: int
    decoded: torch.dtype  # the dequantize's output dtype


def _side(operand: MXOperand) -> _Side | None:
    """The quantize behind a matched operand (None if its codes are not a quantize's)."""
    codes = operand.codes
    if codes.op != "call_function" or not codes.args:
        return None
    q = codes.args[0]
    if not isinstance(q, torch.fx.Node) or q.target is not _QUANTIZE:
        return None
    args = bind(q)
    x = args.node("x")
    spec = x.meta["tensor"]
    rank = len(spec.shape)
    return _Side(
        x,
        args.literal("axis") % rank,
        tuple(spec.shape),
        spec.dtype,
        args.literal("format"),
        args.literal("scale_rule"),
        args.literal("block_size"),
        operand.dtype,
    )


def _refusal(side: _Side, out: torch.dtype) -> str:
    """Why QuantizeMX cannot quantize this operand ("" if it can)."""
    rank, size = len(side.shape), side.shape[side.axis]
    if side.format not in ELEMENT_DTYPES:
        return f"format {side.format}: QuantizeMX produces e4m3 (float8_e4m3fn) or e5m2 only"
    if side.scale_rule != "emax":
        return (
            f"scale rule {side.scale_rule}: QuantizeMX computes EMAX scales only "
            "(mx-quantize{scale=emax})"
        )
    if side.block != BLOCK:
        return f"block size {side.block}: QuantizeMX blocks are {BLOCK}"
    if side.dtype not in _OPERAND_DTYPES:
        return (
            f"operand dtype {str(side.dtype).removeprefix('torch.')}: QuantizeMX takes bf16 or "
            "f16 (capture with precision compute=bfloat16)"
        )
    if not all(isinstance(d, int) for d in side.shape):
        return f"dynamic shape {list(side.shape)}: the custom calls need static shapes"
    if side.axis < rank - 2:
        return f"axis {side.axis} of a rank-{rank} operand: QuantizeMX quantizes the last two dims"
    if size % PACK or size % BLOCK:
        return f"quantized dim {size} is not divisible by {PACK} and {BLOCK}"
    if side.decoded != side.dtype or side.decoded != out:
        return f"dequantized to {side.decoded}, GEMM in {out}: the dot reads the operand dtype"
    return ""


def _decide(node: torch.fx.Node, sides: tuple[_Side, _Side], target: NeuronTarget,
            options: NeuronOptions) -> str:  # fmt: skip
    """Why this GEMM stays emulated ("" when it lowers natively)."""
    if options.mx == "emulate":
        return "NeuronOptions(mx='emulate')"
    if not target.mx:
        return f"neuron:{target.name} has no MX"
    a, b = sides
    if a.format != b.format:
        return f"formats {a.format}/{b.format} differ: one block-scaled dot takes one format"
    if node.target is aten.addmm.default:
        args = bind(node)
        if args.literal("beta") != 1 or args.literal("alpha") != 1:
            return "addmm with alpha or beta other than 1"
    out = node.meta["tensor"].dtype
    for side in sides:
        why = _refusal(side, out)
        if why:
            return why
    return ""


def _roles(program: Program) -> dict[str, str]:
    """GEMM node name -> forward / input_grad / weight_grad, from the mx-quantize record."""
    record = program.metadata.get("mx_quantize")
    layers = record.get("layers", []) if isinstance(record, dict) else []
    return {op["node"]: op["gemm"] for layer in layers for op in layer.get("operands", [])}


def lower_mx_gemms(
    program: Program, target: NeuronTarget, options: NeuronOptions
) -> tuple[Program, tuple[MXGemm, ...]]:
    """`program` with every natively lowerable MX GEMM rewritten to `native_mx_gemm` (a copy;
    `program` itself when none is), and one decision per MX GEMM in graph order."""
    roles = _roles(program)
    plans: list[tuple[str, tuple[_Side, _Side]]] = []
    decisions: list[MXGemm] = []
    for node in program.graph.nodes:
        matched = _match(node)
        if matched is None:
            continue
        src = source_of(node)
        where = src.location() if src else None
        why = _decide(node, matched, target, options)
        lowering = "emulated" if why else "native"
        decisions.append(MXGemm(node.name, roles.get(node.name, ""), lowering, why, where))
        if not why:
            plans.append((node.name, matched))
    if not plans:
        return program, tuple(decisions)
    out = program.replace()
    nodes = {n.name: n for n in out.graph.nodes}
    for name, (a, b) in plans:
        _rewrite(out.graph, nodes[name], nodes[a.source.name], nodes[b.source.name], a, b)
    out.graph.lint()
    return out, tuple(decisions)


def _match(node: torch.fx.Node) -> tuple[_Side, _Side] | None:
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
        return None
    args = bind(node)
    lhs, rhs = (
        (args.node("self"), args.node("mat2"))
        if node.target is aten.mm.default
        else (args.node("mat1"), args.node("mat2"))
    )
    a, b = mx_operand(lhs, 1), mx_operand(rhs, 0)
    if a is None or b is None:
        return None
    sa, sb = _side(a), _side(b)
    return None if sa is None or sb is None else (sa, sb)


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, x_a: torch.fx.Node,
             x_b: torch.fx.Node, a: _Side, b: _Side) -> None:  # fmt: skip
    # mm(dq(q(u)), dq(q(v))) -> native_mx_gemm(u, v[, bias]): QuantizeMX x2 + block-scaled dot
    bias = bind(node).node("self") if node.target is aten.addmm.default else None
    old = node.args
    node.target = native_mx_gemm
    node.args = (x_a, x_b, bias)
    node.kwargs = {"format": a.format, "axes": (a.axis, b.axis), "decoded": a.decoded}
    rw = Rewriter(graph)
    for value in old:
        rw.erase_dead(value)


def gemm_rules(impl: str) -> dict[Callable[..., Any], Callable[..., Any]]:
    """The lowering rule of `native_mx_gemm` with the custom calls ("custom-call") or their
    XLA:CPU stand-ins ("stand-in"), keyed by graph target (`xla.lowering.lower(rules=...)`)."""
    return {native_mx_gemm: functools.partial(_lower_gemm, impl=impl)}


def _lower_gemm(ctx, x_a, x_b, bias=None, *, format, axes, decoded, impl):  # noqa: A002
    dtype = out_dtype(ctx)
    result = dtype if torch_dtype(dtype) in _RESULT_DTYPES else to_jax(torch.float32)
    data_a, scales_a = quantize_mx(x_a, axes[0] - x_a.ndim, format, impl)  # dim -1 or -2
    data_b, scales_b = quantize_mx(x_b, axes[1] - x_b.ndim, format, impl)
    out = block_scaled_dot(
        data_a,
        data_b,
        scales_a,
        scales_b,
        fmt=format,
        contracting=axes,
        out_dtype=result,
        decoded=to_jax(decoded),
        impl=impl,
    ).astype(dtype)
    return out if bias is None else bias.astype(dtype) + out  # addmm's rule with beta = 1


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a JAX dtype (float types only)."""
    import jax.numpy as jnp

    return {
        jnp.dtype(jnp.float32): torch.float32,
        jnp.dtype(jnp.bfloat16): torch.bfloat16,
        jnp.dtype(jnp.float16): torch.float16,
    }[jnp.dtype(dtype)]
