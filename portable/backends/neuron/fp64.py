"""fp64 downcast: the program as Neuron computes it, with every float64 value made float32.

No NeuronCore computes in float64. With `NeuronOptions(fp64="downcast")` (the default) the
program is rewritten before lowering: recorded result types (`node.meta["tensor"]`), `dtype=`
arguments, signature specs and weights that are float64 become float32, so every lowering rule
(which takes its result dtype from the node) computes in float32. Each changed node is reported
as a warning. Where float64 appears in practice: AdamW's bias corrections (0-d, computed in
float64 as torch.optim does); float32 changes the step by about one float32 ulp.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from portable.ir.program import Program
from portable.ir.signature import InputSpec, OutputSpec, Signature, TensorSpec

__all__ = ["downcast_fp64", "uses_fp64"]


def uses_fp64(program: Program) -> bool:
    sig = program.signature
    specs = [s.spec for s in sig.inputs] + [s.spec for s in sig.outputs]
    if any(s.dtype == torch.float64 for s in specs):
        return True
    return any(_has_fp64(n.meta.get("tensor")) for n in program.graph.nodes)


def downcast_fp64(program: Program) -> tuple[Program, list[str]]:
    """(the float32 program, names of the nodes whose results or arguments were float64)."""
    if not uses_fp64(program):
        return program, []
    sig = program.signature
    signature = Signature(
        tuple(_input(i) for i in sig.inputs), tuple(_output(o) for o in sig.outputs)
    )
    weights = {
        k: v.to(torch.float32) if v.dtype == torch.float64 else v
        for k, v in program.weights.items()
    }
    new = program.replace(signature=signature, weights=weights)
    changed = []
    for node in new.graph.nodes:
        spec = node.meta.get("tensor")
        args = torch.fx.node.map_aggregate(node.args, _arg)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, _arg)
        if _has_fp64(spec) or args != node.args or kwargs != node.kwargs:
            node.meta["tensor"] = _spec(spec)
            node.args, node.kwargs = args, kwargs
            if node.op == "call_function":
                changed.append(node.name)
    new.graph_module.recompile()
    return new, changed


def _has_fp64(spec: Any) -> bool:
    if isinstance(spec, tuple):
        return any(_has_fp64(s) for s in spec)
    return isinstance(spec, TensorSpec) and spec.dtype == torch.float64


def _spec(spec: Any) -> Any:
    if isinstance(spec, tuple):
        return tuple(_spec(s) for s in spec)
    if isinstance(spec, TensorSpec) and spec.dtype == torch.float64:
        return TensorSpec(spec.shape, torch.float32)
    return spec


def _arg(value: Any) -> Any:
    return torch.float32 if value is torch.float64 else value


def _input(spec: InputSpec) -> InputSpec:
    return InputSpec(spec.name, spec.kind, _spec(spec.spec), spec.target)


def _output(spec: OutputSpec) -> OutputSpec:
    return OutputSpec(spec.name, spec.kind, _spec(spec.spec), spec.target, spec.aliases)
