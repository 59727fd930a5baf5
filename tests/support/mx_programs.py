"""MX test material shared by the backend tests (tests/test_mx_backends.py, tests/test_mx_neuron.py):
the format and rule lists, the shared corpus, bit-exact comparison, and one-op (or hand-built)
programs of `portable::mx_quantize` / `mx_dequantize`."""

from __future__ import annotations

import functools
import operator

import torch

from portable import mx
from portable.ir.program import Program, ProgramKind
from portable.ir.signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    Signature,
    TensorSpec,
)
from portable.mx.vectors import VECTORS, edge_blocks, fuzz

FORMATS = list(mx.FORMATS)
RULES = list(mx.SCALE_RULES)
ROWS = 512  # blocks in the shared corpus (vectors + edge blocks + fuzz)
# one rule per format where a case does not depend on the rule (input dtype, axis)
RULE_OF = {fmt: RULES[i % len(RULES)] for i, fmt in enumerate(FORMATS)}

Q_OP = torch.ops.portable.mx_quantize.default
DQ_OP = torch.ops.portable.mx_dequantize.default


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN matches any NaN (payloads are unspecified)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = torch.isnan(a)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(ints), b[~nan].view(ints))


@functools.cache
def corpus() -> torch.Tensor:
    """[ROWS, 32] fp32 blocks: row i < len(VECTORS) is VECTORS[i], then the edge blocks, then
    fuzz."""
    vectors = torch.tensor([v.block() for v in VECTORS], dtype=torch.float32)
    edges = edge_blocks()
    return torch.cat([vectors, edges, fuzz(2024, ROWS - len(vectors) - len(edges))])


def middle_axis_input(seed: int) -> torch.Tensor:
    """[4, 64, 3] fp32 whose blocks along dim 1 are fuzz blocks."""
    return fuzz(seed, 4 * 2 * 3).view(4, 3, 64).transpose(1, 2).contiguous()


def build_program(name: str, inputs: list[TensorSpec], build) -> Program:
    """An inference Program over `inputs`: `build(graph, placeholders)` adds nodes and returns
    [(node, spec)] for the outputs."""
    graph = torch.fx.Graph()
    placeholders = []
    for i, spec in enumerate(inputs):
        node = graph.placeholder(f"in{i}")
        node.meta["tensor"] = spec
        placeholders.append(node)
    outputs = build(graph, placeholders)
    graph.output(tuple(node for node, _ in outputs))
    signature = Signature(
        tuple(
            InputSpec(n.name, InputKind.USER_INPUT, s)
            for n, s in zip(placeholders, inputs, strict=True)
        ),
        tuple(OutputSpec(f"out{i}", OutputKind.OUTPUT, s) for i, (_, s) in enumerate(outputs)),
    )
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    return Program(ProgramKind.INFERENCE, module, signature, {}, metadata={"name": name})


def add_quantize(graph, x, x_spec: TensorSpec, fmt, axis, rule, block_size=32):
    """mx_quantize node on `x`; returns [(codes, spec), (scales, spec)]."""
    lay = mx.check_quantize(x_spec.shape, x_spec.dtype, fmt, axis, rule, block_size)
    specs = (TensorSpec(lay.codes_shape, torch.uint8), TensorSpec(lay.scales_shape, torch.uint8))
    node = graph.call_function(Q_OP, (x, fmt, axis, rule, block_size))
    node.meta["tensor"] = specs
    items = []
    for i, spec in enumerate(specs):
        item = graph.call_function(operator.getitem, (node, i))
        item.meta["tensor"] = spec
        items.append((item, spec))
    return items


def add_dequantize(graph, codes, scales, codes_shape, fmt, axis, dtype, block_size=32):
    lay = mx.dequantize_layout(codes_shape, fmt, axis, dtype, block_size)
    node = graph.call_function(DQ_OP, (codes, scales, fmt, axis, dtype, block_size))
    node.meta["tensor"] = spec = TensorSpec(lay.shape, dtype)
    return node, spec


def quantize_program(shape, dtype, fmt, axis, rule, block_size=32) -> Program:
    spec = TensorSpec(tuple(shape), dtype)
    return build_program(
        "mx_quantize",
        [spec],
        lambda g, ph: add_quantize(g, ph[0], spec, fmt, axis, rule, block_size),
    )


def dequantize_program(codes_shape, scales_shape, fmt, axis, dtype, block_size=32) -> Program:
    inputs = [TensorSpec(tuple(shape), torch.uint8) for shape in (codes_shape, scales_shape)]
    return build_program(
        "mx_dequantize",
        inputs,
        lambda g, ph: [add_dequantize(g, *ph, tuple(codes_shape), fmt, axis, dtype, block_size)],
    )
