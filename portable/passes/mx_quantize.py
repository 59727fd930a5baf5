"""`mx-quantize`: MX quantize-dequantize both operands of every linear layer's GEMMs.

The recipe (shared/reference/mx.md, "Training recipe"): each GEMM operand is quantized from high
precision along *that* GEMM's contraction dim, block 32. `mx_gemms.py` finds the GEMMs (an
inference program has one per linear layer, a training step three); this module rewrites them
with one pattern, the same for every GEMM:

    # mm(a, b) -> mm(dq(q(a, axis=1)), dq(q(b, axis=0)))        a: [M', C], b: [C, N'] (C contracted)
    # addmm(bias, a, b) -> addmm(bias, <same>)
    # an operand t(u) is quantized as t(dq(q(u, axis=0 | 1))): the high-precision tensor u is
    #   quantized along its own dim that the GEMM contracts (bit-identical: MX blocks along dim 1
    #   of u^T are the blocks along dim 0 of u); t(t(u)) is u.

So the forward `X @ t(W)` quantizes X and W along K, the input gradient `dY @ t(t(W))` dY and
W along N, the weight gradient `t(dY) @ X` dY and X along M (tokens). Every new node takes the
GEMM's `meta["source"]`. The dequantized operand has the operand's dtype, so the GEMM's types do
not change. Norms, softmax, attention, embeddings and optimizer state are never touched;
`keep_first_last` keeps the first and last linear layers in high precision: every layer that
reads the model's first activation (all of block 0's attention projections) and every layer that
writes its last (the LM head; `mx_gemms.boundary_layers`). `include` / `exclude` pick layers by
module path (`re.search`).

`mode=fake` and `mode=real` write the same graph; `program.metadata["mx_quantize"]` records the
mode, which backends read: the `cuda` backend turns `real` q -> dq -> GEMM chains into a native
block-scaled MX GEMM on sm_100 (e4m3 / e5m2), every other target (and `fake` everywhere)
executes the emulation. `mx_error_report(program, inputs)` measures each quantized operand's
SQNR on example inputs.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import typing
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from portable import mx
from portable.errors import PassError
from portable.ir.program import Program
from portable.ir.rewriter import Rewriter
from portable.ir.signature import TensorSpec
from portable.opset import bind
from portable.opset.mx_ops import codes_shape, scales_shape
from portable.opset.table import PERMUTE, ops_with
from portable.runtime import flatten_inputs

from .base import Pass, PassReport, PassResult, ReportTable
from .mx_gemms import CONTRACTION, GEMMS, Gemm, Layer, LinearGemms, find_linear_gemms

__all__ = ["MODES", "MXQuantize", "mx_error_report", "sqnr_db"]

aten = torch.ops.aten
MODES = ("fake", "real")
BLOCK_SIZE = 32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRANSPOSES = ops_with(PERMUTE)
_FIRST = "first linear layers, which read the model's first activation (keep_first_last=true)"
_LAST = "last linear layers, which write its last activation (keep_first_last=true)"


@dataclasses.dataclass(frozen=True)
class MXQuantize(Pass):
    """MX-quantize both operands of every linear GEMM along its contraction dim (the recipe).

    Each linear layer's forward GEMM, and in training steps its input-gradient and weight-gradient
    GEMMs, get quantize -> dequantize (block 32) on both operands. Options: `format` (e4m3,
    e5m2, e3m2, e2m3, e2m1, int8), `scale` (the E8M0 scale rule: rceil, floor, ceil, even,
    emax; `portable.mx.scale`), `mode` (fake: emulation everywhere; real: native MX GEMMs where
    the target has them), `include` / `exclude` (regexes searched in the module path),
    `keep_first_last` (keep in high precision every linear layer that reads the model's first
    activation or writes its last).

    Counts: `layers` quantized, and GEMMs quantized per kind (`forward`, `input_grad`,
    `weight_grad`). Notes: the layers kept in high precision and why, GEMMs left alone."""

    name = "mx-quantize"
    preserves_numerics: typing.ClassVar[bool] = False
    format: str = "e4m3"
    scale: str = "rceil"
    mode: str = "fake"
    include: str | None = None
    exclude: str | None = None
    keep_first_last: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for option, value, valid in (
            ("format", self.format, tuple(mx.FORMATS)),
            ("scale", self.scale, mx.SCALE_RULES),
            ("mode", self.mode, MODES),
        ):
            if value not in valid:
                raise PassError(
                    f"option {option!r} of pass {self.name!r} must be one of "
                    f"{', '.join(valid)}; got {value!r}",
                    pass_name=self.name,
                    fix=f"use {option}={valid[0]} (valid: {', '.join(valid)})",
                )
        for option, pattern in (("include", self.include), ("exclude", self.exclude)):
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise PassError(
                        f"option {option!r} of pass {self.name!r} is not a valid regex: "
                        f"{pattern!r} ({exc})",
                        pass_name=self.name,
                        fix='write a Python regex searched in the module path, e.g. "mlp|attn"',
                    ) from None

    def apply(self, program: Program) -> PassResult:
        if "mx_quantize" in program.metadata:
            raise PassError(
                f"{program.name} is already MX-quantized "
                f"(metadata mx_quantize: {_brief(program.metadata['mx_quantize'])})",
                pass_name=self.name,
                fix="apply mx-quantize once; choose the layers with include=/exclude=",
            )
        found = find_linear_gemms(program)
        chosen, notes = self._select(found)
        plans = [(layer, _plan(layer, notes)) for layer in chosen]
        plans = [(layer, gemms) for layer, gemms in plans if gemms]
        if found.unmatched:
            names = ", ".join(n.name for n in found.unmatched)
            notes.append(f"backward GEMMs of no linear layer, kept: {names}")
        counts = {"layers": len(plans), **dict.fromkeys(GEMMS, 0)}
        if not plans:
            return PassResult(program, self.report(False, counts, notes))
        out = program.replace()
        nodes = {n.name: n for n in out.graph.nodes}  # the copy keeps node names
        layers = []
        per_kind: Counter[str] = Counter()
        for layer, gemms in plans:
            operands = []
            for gemm in gemms:
                operands += self._rewrite(out.graph, nodes[gemm.node.name], gemm)
                per_kind[gemm.role] += 1
            roles = [r for r in GEMMS if any(g.role == r for g in gemms)]
            layers.append(
                {
                    "module": layer.module,
                    "weight": layer.weight_name,
                    "gemms": roles,
                    "operands": operands,
                }
            )
        out.graph.lint()
        out.graph_module.recompile()
        out.metadata["mx_quantize"] = {
            "format": self.format,
            "scale": self.scale,
            "mode": self.mode,
            "block_size": BLOCK_SIZE,
            "layers": layers,
        }
        counts.update(per_kind)
        return PassResult(out, self.report(True, counts, notes))

    def measure(
        self,
        program: Program,
        report: PassReport,
        inputs: Callable[[], Sequence[Any]] | None,
    ) -> PassReport:
        """The notes as lines and, when the pass changed the program, the SQNR of each quantized
        operand on the example inputs (`mx_error_report`): a table, and the manifest's `layers`
        (None, with a line saying so, without example inputs)."""
        return measured(program, report, inputs)

    # ---- which layers ------------------------------------------------------------------------

    def _select(self, found: LinearGemms) -> tuple[list[Layer], list[str]]:
        """The layers to quantize, and a note per reason for the ones kept."""
        boundary = {}
        if self.keep_first_last:
            boundary = {id(layer): _LAST for layer in found.last}
            boundary.update({id(layer): _FIRST for layer in found.first})
        kept: dict[str, list[str]] = {}
        chosen = []
        for layer in found.layers:
            if id(layer) in boundary:
                kept.setdefault(boundary[id(layer)], []).append(layer.module)
            elif self.include is not None and not re.search(self.include, layer.module):
                kept.setdefault(f"not matched by include={self.include!r}", []).append(layer.module)
            elif self.exclude is not None and re.search(self.exclude, layer.module):
                kept.setdefault(f"matched by exclude={self.exclude!r}", []).append(layer.module)
            else:
                chosen.append(layer)
        notes = [f"kept in high precision, {why}: {', '.join(mods)}" for why, mods in kept.items()]
        if not found.layers:
            notes.append("no linear layer (mm/addmm with a parameter operand) in the program")
        return chosen, notes

    # ---- the rewrite -------------------------------------------------------------------------

    def _rewrite(self, graph: torch.fx.Graph, node: Node, gemm: Gemm) -> list[dict[str, Any]]:
        # mm(a, b) -> mm(dq(q(a, 1)), dq(q(b, 0)))  (operands t(u) quantize u, see the module doc)
        operands: dict[str, Node] = {}
        records = []
        for side, (name, label) in enumerate(zip(gemm.operand_names, gemm.labels, strict=True)):
            contraction = 1 - side  # lhs [M', C] along dim 1, rhs [C, N'] along dim 0
            source, swapped = _through_transposes(bind(node).node(name))  # `node`: in the copy
            axis = 1 - contraction if swapped else contraction
            q, dq = self._qdq(graph, source, axis, node)
            operands[name] = _transpose(graph, dq, node) if swapped else dq
            records.append(
                {
                    "gemm": gemm.role,
                    "node": node.name,
                    "operand": label,
                    "dim": CONTRACTION[gemm.role],
                    "size": gemm.contraction_size,
                    "tensor": source.name,
                    "axis": axis,
                    "quantize": q.name,
                    "dequantize": dq.name,
                }
            )
        r, old = Rewriter(graph), node.args
        r.set_args(node, operands)
        for value in old:
            r.erase_dead(value)
        return records

    def _qdq(self, graph: torch.fx.Graph, x: Node, axis: int, gemm: Node) -> tuple[Node, Node]:
        """Insert `q = mx_quantize(x)`, `dq = mx_dequantize(q)` before `gemm`."""
        spec = x.meta["tensor"]
        shape, fmt = list(spec.shape), self.format
        codes_spec = TensorSpec(tuple(codes_shape(shape, fmt, axis)), torch.uint8)
        scales_spec = TensorSpec(tuple(scales_shape(shape, axis, BLOCK_SIZE)), torch.uint8)
        portable, r = torch.ops.portable, Rewriter(graph)
        with graph.inserting_before(gemm):
            # new ops carry the GEMM's source and a fake value where their inputs have one
            q = r.call(
                portable.mx_quantize.default,
                (x, fmt, axis, self.scale),
                tensor=(codes_spec, scales_spec),
                like=gemm,
                fake="available",
            )
            codes = r.call(operator.getitem, (q, 0), tensor=codes_spec, like=gemm, fake="available")
            scales = r.call(
                operator.getitem, (q, 1), tensor=scales_spec, like=gemm, fake="available"
            )
            dq = r.call(
                portable.mx_dequantize.default,
                (codes, scales, fmt, axis, spec.dtype),
                tensor=spec,
                like=gemm,
                fake="available",
            )
        return q, dq


def _plan(layer: Layer, notes: list[str]) -> list[Gemm]:
    """The layer's GEMMs that MX can take: contraction a multiple of 32, float operands."""
    ok = []
    for gemm in layer.gemms:
        size = gemm.contraction_size
        dtypes = {gemm.operand(side).meta["tensor"].dtype for side in (0, 1)}
        dim = CONTRACTION[gemm.role]
        if not isinstance(size, int) or size % BLOCK_SIZE:
            why = f"contraction dim {dim}={size} is not a multiple of {BLOCK_SIZE}"
        elif not dtypes <= set(_DTYPES):
            why = f"operand dtype {', '.join(sorted(map(str, dtypes)))} is not float32/bf16/fp16"
        else:
            ok.append(gemm)
            continue
        notes.append(f"{layer.module} {gemm.role} ({gemm.node.name}) kept: {why}")
    return ok


def _through_transposes(value: Node) -> tuple[Node, bool]:
    """(u, swapped): `value` is u, or a chain of 2-D transposes of u that swaps its dims."""
    swapped = False
    while (
        value.op == "call_function"
        and value.target in _TRANSPOSES
        and len(value.meta["tensor"].shape) == 2
    ):
        args = bind(value)
        if value.target is aten.permute.default:
            swap = [d % 2 for d in args.dims] == [1, 0]
        elif value.target is aten.transpose.int:
            swap = args.dim0 % 2 != args.dim1 % 2
        else:
            swap = True
        swapped ^= swap
        value = args.node("self")
    return value, swapped


def _transpose(graph: torch.fx.Graph, x: Node, gemm: Node) -> Node:
    spec = x.meta["tensor"]
    t_spec = TensorSpec(spec.shape[::-1], spec.dtype)
    return Rewriter(graph).call(
        aten.t.default, (x,), tensor=t_spec, like=gemm, fake="available", before=gemm
    )


def _brief(record: object) -> str:
    if isinstance(record, dict):
        return ", ".join(f"{k}={record.get(k)}" for k in ("format", "scale", "mode"))
    return repr(record)


# ---- the error report --------------------------------------------------------------------------

_SQNR_HEADER = ("module", "GEMM", "operand", "dim", "SQNR dB")


def measured(
    program: Program, report: PassReport, inputs: Callable[[], Sequence[Any]] | None
) -> PassReport:
    """`report` with its notes as lines and the SQNR table and `layers` of `MxQuantize.measure`."""
    lines = tuple(report.notes)
    if not report.changed:
        return dataclasses.replace(report, lines=lines)
    if inputs is None:
        lines += ("SQNR not measured: an archive has no example inputs",)
        return dataclasses.replace(report, lines=lines, record={"layers": None})
    rows = mx_error_report(program, inputs())
    cells = tuple((r["module"], r["gemm"], r["operand"], r["dim"], _db(r["sqnr_db"])) for r in rows)
    return dataclasses.replace(
        report,
        lines=lines,
        tables=(ReportTable(_SQNR_HEADER, cells),),
        record={"layers": _layers(rows)},
    )


def _layers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The error report grouped by layer, as the manifest records it."""
    layers: dict[str, dict[str, Any]] = {}
    for row in rows:
        layer = layers.setdefault(
            row["module"], {"module": row["module"], "gemms": [], "operands": []}
        )
        if row["gemm"] not in layer["gemms"]:
            layer["gemms"].append(row["gemm"])
        layer["operands"].append({k: v for k, v in row.items() if k != "module"})
    return list(layers.values())


def _db(value: float | None) -> str:
    return "exact" if value is None else f"{value:.1f}"


def mx_error_report(program: Program, inputs: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """Quantization error of every operand `mx-quantize` quantized in `program`, on `inputs`
    (the user inputs of an inference program, the batch of a training step).

    Runs the program's graph once on the CPU reference (an fx Interpreter over the graph, the
    program's weights as state) and records each quantized operand's high-precision value x and
    its dequantized value. One row per operand, in the order of `metadata["mx_quantize"]`:
    `module`, `gemm`, `operand` (x, w, dy), `dim` (K, N, M), `shape`, and `sqnr_db` =
    10 log10(sum x^2 / sum (x - dq(q(x)))^2), None when the error is zero (exact) or x is all
    zero. An empty list for a program the pass did not change."""
    record = program.metadata.get("mx_quantize")
    if not isinstance(record, dict):
        return []
    program.require_values("mx-quantize's error report (it runs the program)")
    rows = [
        {"module": layer["module"], **operand}
        for layer in record.get("layers", [])
        for operand in layer["operands"]
    ]
    wanted = {r["quantize"] for r in rows} | {r["dequantize"] for r in rows}
    values = _Recorder(program.graph_module, wanted).record(
        *flatten_inputs(program, inputs, program.weights)
    )
    report = []
    for row in rows:
        x, dq = values.get(row["quantize"]), values.get(row["dequantize"])
        if x is None or dq is None:  # a later pass removed the node
            continue
        report.append(
            {
                "module": row["module"],
                "gemm": row["gemm"],
                "operand": row["operand"],
                "dim": f"{row['dim']}={row['size']}",
                "shape": list(x.shape),
                "sqnr_db": sqnr_db(x, dq),
            }
        )
    return report


def sqnr_db(x: torch.Tensor, approx: torch.Tensor) -> float | None:
    """10 log10(sum x^2 / sum (x - approx)^2) in float64; None if either sum is zero."""
    x64, a64 = x.detach().double(), approx.detach().double()
    signal = float((x64 * x64).sum())
    noise = float(((x64 - a64) ** 2).sum())
    if signal == 0 or noise == 0 or not math.isfinite(signal / noise):
        return None
    return 10 * math.log10(signal / noise)


class _Recorder(torch.fx.Interpreter):
    """Runs the graph; keeps the input of each wanted mx_quantize and each wanted node's value."""

    def __init__(self, gm: torch.fx.GraphModule, wanted: set[str]) -> None:
        super().__init__(gm)
        self.wanted = wanted
        self.values: dict[str, torch.Tensor] = {}

    def record(self, *args: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            self.run(*args)
        return self.values

    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.name in self.wanted:
            is_quantize = n.target is torch.ops.portable.mx_quantize.default
            x = self.env[bind(n).node("x")] if is_quantize else None
            self.values[n.name] = result if x is None else x  # a quantize's input
        return result
