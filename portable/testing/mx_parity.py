"""Parity of MX-quantized programs: compare backends under the same quantization decisions.

An element that lies within rounding of an MX rounding boundary (or a block whose amax lies at a
power of two) is quantized to one code by one backend and to its neighbour by another when
their inputs differ by one ulp; the GEMM that reads it then differs by a whole element step
(6 % of the element for FP8), far outside rounding. Such a flip is correct on both sides, so
elementwise tolerances on a quantized program's outputs test nothing but luck. Instead, step by
step (`observed` adds every quantizer's input x, codes and scales as outputs):

1. **The quantizers are exact**: each backend's codes and scales equal `mx_quantize` applied on
   the CPU reference to that backend's own input x (bit for bit).
2. **Everything else agrees given the same decisions**: the reference re-runs the step from the
   backend's state before it, with every `mx_quantize` replaced by the backend's codes and
   scales (`_fed`). The backend's outputs, loss, updated state and every quantizer input x must
   equal that run's within the tolerance policy (`tolerance.py`, its allowance measured on the
   fed reference and a perturbed fed run).

Together: the backend computes the program up to rounding, the quantizers' boundary decisions
included, and nothing else. The report's codes rows also count the codes that differ from the
reference's own choice on the reference's x (the boundary flips).
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from collections.abc import Iterator, Sequence

import torch
import torch.fx
from torch.fx import Node

from ..ir.program import Program, ProgramKind
from ..ir.signature import OutputKind, OutputSpec, Signature
from ..opset import bind
from ..runtime import Executable
from .compare import ParityRow, compare
from .runs import Reference
from .stepwise import StepReference

__all__ = ["FedReference", "is_quantized", "observed"]

QUANTIZE = torch.ops.portable.mx_quantize.default
PARTS = ("x", "codes", "scales")


def is_quantized(program: Program) -> bool:
    return any(_quantizers(program.graph))


def observed(program: Program) -> Program:
    """`program` with each `mx_quantize`'s input and its codes and scales as extra outputs,
    named `mx_<node>_<part>` (an inference program's outputs; a training step's state that no
    input reads, so each step reports them and no step consumes them)."""
    out = program.replace()
    graph = out.graph
    output = graph.output_node()
    values = list(typing.cast(tuple, output.args[0]))
    specs = list(out.signature.outputs)
    training = out.kind is ProgramKind.TRAINING_STEP
    kind = OutputKind.UPDATED_STATE if training else OutputKind.OUTPUT
    for q in _quantizers(graph):
        codes, scales = _results(q)
        for part, node in zip(PARTS, (bind(q).node("x"), codes, scales), strict=True):
            name = _name(q.name, part)
            specs.append(OutputSpec(name, kind, node.meta["tensor"], name if training else None))
            values.append(node)
    output.args = (tuple(values),)
    out.signature = Signature(out.signature.inputs, tuple(specs))
    graph.lint()
    out.graph_module.recompile()
    return out


def _codes_row(backend: str, q: Node, got: dict[str, torch.Tensor], ref: Reference) -> ParityRow:
    """The backend's codes and scales against the reference quantizer applied to the backend's
    x (exact), noting how many codes the reference chose otherwise on its own x."""
    codes, scales = _part(got, q.name, "codes"), _part(got, q.name, "scales")
    want_codes, want_scales = _quantize(q, _part(got, q.name, "x"))
    row = compare(
        backend,
        f"mx codes {q.name}",
        torch.cat([codes.flatten(), scales.flatten()]),
        torch.cat([want_codes.flatten(), want_scales.flatten()]),
        0.0,
        0.0,
    )
    own, _ = _quantize(q, _part(ref.values, q.name, "x"))
    flips = int((own != codes.to(own.device)).sum())
    if not flips:
        return row
    note = f"{flips} of {codes.numel()} code(s) differ from the reference's own choice"
    return dataclasses.replace(row, note=f"{row.note}; {note}" if row.note else note)


class FedReference(StepReference):
    """The CPU reference of `observed(program)` whose `mx_quantize` nodes return the codes and
    scales the backend computed in the same step (every other node as the cpu backend runs
    it); its rows add each quantizer's exactness (`_codes_row`)."""

    def __init__(self, program: Program) -> None:
        self.quantizers = list(_quantizers(program.graph))
        self.feed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        interpreter = _Interpreter(program.graph_module, self)

        def run(flat: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
            with torch.no_grad():
                return interpreter.run(*flat)

        super().__init__(Executable(program, run, "cpu"))

    def prepare(self, got: dict[str, torch.Tensor]) -> None:
        self.feed = {
            q.name: (_part(got, q.name, "codes"), _part(got, q.name, "scales"))
            for q in self.quantizers
        }

    def compares(self, key: str) -> bool:
        """The fed codes and scales are the backend's own: `_codes_row` judges them."""
        return not (key.startswith(("output mx_", "state mx_")) and key.endswith(_FED))

    def label(self, key: str) -> str:
        """`state mx_<q>_x` reads as `mx input <q>`."""
        for prefix in ("output mx_", "state mx_"):
            if key.startswith(prefix) and key.endswith("_x"):
                return f"mx input {key[len(prefix) : -2]}"
        return key

    def extra_rows(
        self, backend: str, got: dict[str, torch.Tensor], ref: Reference
    ) -> list[ParityRow]:
        return [_codes_row(backend, q, got, ref) for q in self.quantizers]


_FED = ("_codes", "_scales")


class _Interpreter(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, fed: FedReference) -> None:
        super().__init__(gm)
        self.fed = fed

    def run_node(self, n: Node) -> typing.Any:
        if n.op == "call_function" and n.target is QUANTIZE and n.name in self.fed.feed:
            return self.fed.feed[n.name]
        return super().run_node(n)


def _quantize(q: Node, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The node's own quantizer (its cpu kernel: `portable.mx`) applied to `x`."""
    b = bind(q)
    codes, scales = QUANTIZE(x.cpu(), **{name: b.literal(name) for name in b if name != "x"})
    return codes, scales


def _quantizers(graph: torch.fx.Graph) -> Iterator[Node]:
    return (n for n in graph.nodes if n.op == "call_function" and n.target is QUANTIZE)


def _results(q: Node) -> tuple[Node, Node]:
    """The `getitem` nodes of q's codes and scales (created when a result has none)."""
    found: dict[int, Node] = {}
    for user in q.users:
        index = bind(user).literal("index") if user.target is operator.getitem else None
        if index in (0, 1):
            found.setdefault(index, user)
    specs = q.meta["tensor"]
    for index in (0, 1):
        if index not in found:
            with q.graph.inserting_after(q):
                node = q.graph.call_function(operator.getitem, (q, index))
            node.meta["tensor"] = specs[index]
            if "source" in q.meta:
                node.meta["source"] = q.meta["source"]
            found[index] = node
    return found[0], found[1]


def _name(node: str, part: str) -> str:
    return f"mx_{node}_{part}"


def _part(quantities: dict[str, torch.Tensor], node: str, part: str) -> torch.Tensor:
    name = _name(node, part)
    output = f"output {name}"  # an output of inference, a state entry of a training step
    return quantities[output if output in quantities else f"state {name}"]
