"""bfloat16 on ONNX Runtime's CPU provider: compute in float32, round where torch rounds.

ORT's CPU kernels lack bfloat16 for most ops (Add, Sin, Sub, Gemm, ...), so a bfloat16 model
fails at session creation. Torch's CPU kernels compute a bfloat16 op in float32 and round its
result once ("opmath"). `compute_in_float32` rewrites an exported model the same way: every
bfloat16 value is carried as a float32 tensor holding a bfloat16-exact value; each node computes
in float32, and the values that are results of program ops (the exporter names them after the fx
nodes) are rounded to bfloat16 (Cast to bfloat16 and back); the values inside one op's
translation stay float32, as inside torch's kernel. Graph inputs and initializers keep their
bfloat16 type and are widened by a Cast (exact); graph outputs are cast back to bfloat16.

Nodes that make bfloat16 from nothing (Constant, ConstantOfShape, Cast to bfloat16, ...) keep
their bfloat16 result, which is then widened. Models with subgraphs or local functions holding
bfloat16 values are left as they are (the exporter writes neither for portable programs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["compute_in_float32"]

_BF16 = 16  # onnx.TensorProto.BFLOAT16
_F32 = 1  # onnx.TensorProto.FLOAT
# nodes whose result type comes from an attribute or the node itself, not from their inputs
_SOURCES = frozenset(
    {"Constant", "ConstantOfShape", "Cast", "EyeLike", "RandomNormal", "RandomUniform"}
    | {"RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)

_DTYPE_ATTRS = frozenset({"to", "dtype", "output_dtype"})


def _types(graph: Any) -> dict[str, int]:
    """Element type of every value the graph declares (inputs, initializers, value_info,
    outputs)."""
    found: dict[str, int] = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        if value.type.HasField("tensor_type"):
            found[value.name] = value.type.tensor_type.elem_type
    for tensor in graph.initializer:
        found[tensor.name] = tensor.data_type
    return found


def _holds_bf16(graph: Any) -> bool:
    return _BF16 in _types(graph).values() or any(
        a.t.data_type == _BF16 for n in graph.node for a in n.attribute if a.HasField("t")
    )


def compute_in_float32(model: Any, rounded: Iterable[str]) -> bool:
    """Rewrite `model` (an onnx.ModelProto, in place) to compute its bfloat16 values in float32,
    rounding each value named in `rounded` (and each graph output) to bfloat16. Whether it
    rewrote anything."""
    from onnx import helper

    graph = model.graph
    if not _holds_bf16(graph):
        return False
    has_subgraph = any(a.g.node or a.graphs for n in graph.node for a in n.attribute)
    if has_subgraph or model.functions:
        return False
    types = _types(graph)
    keep_rounded = set(rounded)
    renamed: dict[str, str] = {}  # bfloat16 value -> the float32 value that now carries it
    nodes: list[Any] = []

    def widen(name: str, source: str) -> None:
        wide = name + "__f32"
        nodes.append(helper.make_node("Cast", [source], [wide], to=_F32, name=wide + "_cast"))
        renamed[name] = wide

    inputs = [v.name for v in graph.input] + [t.name for t in graph.initializer]
    for name in inputs:
        if types.get(name) == _BF16:
            widen(name, name)
    for node in graph.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        bf16_outputs = [o for o in node.output if types.get(o) == _BF16]
        if not bf16_outputs:
            nodes.append(node)
            continue
        # a node whose result type is its own (an attribute), not its inputs', still makes
        # bfloat16: widen its result
        made_here = node.op_type in _SOURCES or any(a.name in _DTYPE_ATTRS for a in node.attribute)
        for position, name in enumerate(node.output):
            if name not in bf16_outputs:
                continue
            inner = name + ("__bf16" if made_here else "__f32raw")
            node.output[position] = inner
        nodes.append(node)
        for name in bf16_outputs:
            if made_here:
                widen(name, name + "__bf16")
            elif name in keep_rounded:
                rounded_bf16 = name + "__round"
                nodes.append(
                    helper.make_node(
                        "Cast", [name + "__f32raw"], [rounded_bf16], to=_BF16, name=rounded_bf16
                    )
                )
                widen(name, rounded_bf16)
            else:
                renamed[name] = name + "__f32raw"
    sources = set(inputs)
    narrowed: set[str] = set()
    for output in graph.output:
        if output.name in sources or output.name in narrowed:
            continue  # an input returned as is is bfloat16 already; a repeated output once
        if output.name in renamed:  # a bfloat16 output: round and narrow, under its own name
            narrowed.add(output.name)
            nodes.append(
                helper.make_node(
                    "Cast",
                    [renamed[output.name]],
                    [output.name],
                    to=_BF16,
                    name=output.name + "_out",
                )
            )
    del graph.node[:]
    graph.node.extend(nodes)
    stale = [v for v in graph.value_info if types.get(v.name) == _BF16]
    for value in stale:
        graph.value_info.remove(value)
    return True
