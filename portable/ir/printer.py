"""Stable text form of a program, for golden tests, `portable inspect` and diffs.

    program GPT (inference, opset 1.0)
      in  p_wte_weight: parameter wte.weight f32[128x64]
      %embedding = aten.embedding.default(%p_wte_weight, %idx) : float32[2x16x64]  # wte
      out 0: output = %view_3

Names are the graph's node names; the format changes only with a format version bump.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch.fx

from ..opset import bind, op_name
from .signature import TensorSpec
from .source import source_of

if TYPE_CHECKING:
    from .program import Program


def _arg(value: torch.fx.node.Argument) -> str:
    if isinstance(value, torch.fx.Node):
        return f"%{value.name}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_arg(v) for v in value)
        return f"[{inner}]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _meta(meta: object) -> str:
    if isinstance(meta, TensorSpec):
        return str(meta)
    if isinstance(meta, tuple):
        return "(" + ", ".join(_meta(m) for m in meta) + ")"
    return "?"


def format_node(node: torch.fx.Node) -> str:
    if node.target is operator.getitem:
        b = bind(node)
        text = f"%{node.name} = %{b.node('self').name}[{b.literal('index')}]"
    else:
        args = [_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()]
        text = f"%{node.name} = {op_name(node.target)}({', '.join(args)})"
    text += f" : {_meta(node.meta.get('tensor'))}"
    src = source_of(node)
    if src and src.module:
        text += f"  # {src.module}"
    return text


def format_program(program: Program) -> str:
    sig = program.signature
    lines = [f"program {program.name} ({program.kind.value}, opset {program.opset_version})"]
    for spec in sig.inputs:
        target = f" {spec.target}" if spec.target else ""
        lines.append(f"  in  {spec.name}: {spec.kind.value}{target} {spec.spec}")
    for node in program.graph.nodes:
        if node.op == "call_function":
            lines.append("  " + format_node(node))
    results = program.graph.output_node().args[0]
    assert isinstance(results, tuple | list), "a program's graph returns one flat tuple"
    for out, value in zip(sig.outputs, results, strict=True):
        alias = f" (aliases {out.aliases})" if out.aliases else ""
        lines.append(f"  out {out.name}: {out.kind.value} = {_arg(value)}{alias}")
    return "\n".join(lines) + "\n"
