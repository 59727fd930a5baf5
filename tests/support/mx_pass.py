"""What the mx-quantize tests share: running the pass checked, the captured examples, and
finding quantize / dequantize nodes."""

from __future__ import annotations

import torch

import portable
from portable import mx
from portable.passes import PassManager, parse_pipeline

__all__ = ["DQ", "GEMMS", "Q", "aten", "calls", "captured", "dequantized", "qdq", "run_pass"]

aten = torch.ops.aten
Q = torch.ops.portable.mx_quantize.default
DQ = torch.ops.portable.mx_dequantize.default
GEMMS = ("forward", "input_grad", "weight_grad")


def run_pass(program: portable.Program, text: str = "mx-quantize"):
    before = program.text()
    out, (report,) = PassManager(parse_pipeline(text), verify_each=True).run(program)
    assert program.text() == before, "the input program was mutated"
    portable.verify(out)
    return out, report


def qdq(x: torch.Tensor, axis: int, fmt: str = "e4m3", rule: str = "rceil") -> torch.Tensor:
    codes, scales = mx.quantize(x, fmt, axis, rule, 32)
    return mx.dequantize(codes, scales, fmt, axis, x.dtype, 32)


def calls(program: portable.Program, target) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op == "call_function" and n.target is target]


def dequantized(value) -> torch.fx.Node | None:
    """The mx_dequantize that `value` is, directly or through one 2-D transpose."""
    if isinstance(value, torch.fx.Node) and value.target is aten.t.default:
        value = value.args[0]
    return value if isinstance(value, torch.fx.Node) and value.target is DQ else None


_CAPTURED: dict = {}


def captured(example_spec, stem: str, training: bool):
    if (stem, training) not in _CAPTURED:
        spec = example_spec(stem)
        _CAPTURED[stem, training] = (portable.capture_spec(spec, training=training), spec)
    return _CAPTURED[stem, training]
