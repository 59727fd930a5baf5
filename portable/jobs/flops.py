"""Model FLOPs of a program, counted from its own graph.

Model FLOPs are the multiply-adds of the program's matrix products, 2 per multiply-add:

    mm(a[M,K], b[K,N]), addmm(c, a, b)          2*M*K*N (the bias add is not counted)
    bmm / baddbmm / addbmm (batch B)            2*B*M*K*N
    matmul(a, b)                                2*prod(broadcast batch)*M*K*N
    linear(x[..., K], w[N, K])                  2*prod(x[:-1])*K*N
    convolution                                 2*numel(w)*N*prod(output spatial)
                                                (transposed: prod(input spatial))
    convolution_backward                        one forward's count per gradient asked for
                                                (grad_input, grad_weight in output_mask)
    attention(q[..., L, D], k[.., S, D], v[.., S, Dv])   2*b*L*S*(D + Dv), b = prod(q[:-2])
    attention backward                          twice the forward's count

Elementwise ops, reductions, softmax, norms and the optimizer update are not model FLOPs (the
convention of MFU, PaLM appendix B). Attention counts the full L x S score matrix whether or not
it is causal, the same as the written-out `q @ k^T` it fuses, so softmax-fusion leaves the count
unchanged. MX GEMMs are `mm` on dequantized operands: counted as `mm`.

A per-rank program (`Program.spmd`) holds per-rank shapes, so its count is per rank.

Recomputation is not model FLOPs: the copies the `remat` pass places in the backward (a
backward op computing the same op on the same arguments as a forward op, after mapping earlier
copies to their originals; portable/passes/remat.py) are left out of `total` and reported as
`by_op["recompute"]`.

Shapes come from each node's `meta["val"]` (fake tensors, right after capture), else
`meta["tensor"]` (what a saved program keeps), else the signature's spec of a placeholder. A
dynamic dim (`s0`, `2*s0`) is evaluated with `dims` (symbol -> value), else a SymInt's example
hint; one that stays unknown is a JobError naming the node.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from ..errors import JobError
from ..ir.symbolic import SizeExprError, parse_size
from ..opset.bind import arguments
from ..opset.table import op_name

if TYPE_CHECKING:
    from ..ir.program import Program

__all__ = ["RECOMPUTE", "FlopCount", "node_flops", "program_flops", "recomputed_nodes"]

RECOMPUTE = "recompute"  # by_op key of the FLOPs in remat's recomputed copies

aten = torch.ops.aten
Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """`total`: model FLOPs of one call of the program (recomputation excluded); `by_op`: FLOPs
    per op name (`aten.mm.default`, ...), and `recompute` for remat's copies when there are any."""

    total: int
    by_op: dict[str, int]


def program_flops(program: Program, *, dims: Mapping[str, int] | None = None) -> FlopCount:
    """Count the model FLOPs of one call of `program` (module docstring)."""
    recomputed = recomputed_nodes(program.graph)
    by_op: dict[str, int] = {}
    total = 0
    for node, flops in node_flops(program, dims=dims).items():
        key = RECOMPUTE if node in recomputed else op_name(node.target)
        by_op[key] = by_op.get(key, 0) + flops
        if node not in recomputed:
            total += flops
    return FlopCount(total=total, by_op=dict(sorted(by_op.items())))


def node_flops(program: Program, *, dims: Mapping[str, int] | None = None) -> dict[Node, int]:
    """The model FLOPs of each node of `program` that has some (matrix products, convolutions,
    attention; module docstring), recomputed copies included."""
    shapes = _Shapes(program, dict(dims or {}))
    out: dict[Node, int] = {}
    for node in program.graph.nodes:
        rule = _RULES.get(node.target) if node.op == "call_function" else None
        if rule is not None and (flops := rule(node, shapes)):
            out[node] = flops
    return out


def recomputed_nodes(graph: torch.fx.Graph) -> set[Node]:
    """Backward nodes that repeat a forward node: the same target on the same arguments, where
    an argument that is itself a repeat stands for its original (remat's copies)."""
    forward: dict[Any, Node] = {}
    original: dict[Node, Node] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        phase = node.meta.get("phase")
        if phase not in ("forward", "backward"):
            continue
        key = _key(node, original)
        if key is None:
            continue
        if phase == "forward":
            forward.setdefault(key, node)
        elif key in forward:
            original[node] = forward[key]
    return set(original)


def _key(node: Node, original: Mapping[Node, Node]) -> Any:
    """A hashable form of (target, args, kwargs) with repeats mapped to their originals."""

    def freeze(value: Any) -> Any:
        if isinstance(value, Node):
            return original.get(value, value)
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, *(freeze(v) for v in value))
        if isinstance(value, dict):
            return ("dict", *sorted((k, freeze(v)) for k, v in value.items()))
        return value

    key = (node.target, freeze(node.args), freeze(node.kwargs))
    try:
        hash(key)
    except TypeError:
        return None
    return key


# --- shapes ---------------------------------------------------------------------------------


class _Shapes:
    """Concrete shapes of a program's values (module docstring, last paragraph)."""

    def __init__(self, program: Program, dims: dict[str, int]) -> None:
        self.dims = dims
        self.inputs = {spec.name: spec.spec for spec in program.signature.inputs}

    def of(self, value: Any, where: Node) -> Shape:
        if not isinstance(value, Node):
            raise JobError(
                f"cannot count FLOPs of {where.name}: an operand is a {type(value).__name__}, "
                "not a graph value"
            )
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return tuple(self._dim(d, where) for d in val.shape)
        spec = value.meta.get("tensor")
        if spec is None and value.op == "placeholder":
            spec = self.inputs.get(value.name)
        shape = getattr(spec, "shape", None)
        if shape is None:
            raise JobError(
                f"cannot count FLOPs of {where.name}: {value.name} has no shape "
                "(no meta['val'] or meta['tensor'])",
                fix="count FLOPs of a program as capture or portable.load made it",
            )
        return tuple(self._dim(d, where) for d in shape)

    def _dim(self, dim: Any, where: Node) -> int:
        if isinstance(dim, int):
            return dim
        text = str(dim)
        try:
            value = parse_size(text).evaluate(self.dims)
            if isinstance(value, int):
                return value
        except (SizeExprError, KeyError, ValueError):
            pass
        hint = getattr(getattr(dim, "node", None), "hint", None)
        if isinstance(hint, int):
            return hint
        raise JobError(
            f"cannot count FLOPs of {where.name}: its dynamic dim {text} has no value",
            fix=f"pass dims={{...}} with a value for each symbol of {text}",
        )


# --- rules ----------------------------------------------------------------------------------


def _matmul_2d(a: Shape, b: Shape) -> int:
    return 2 * a[-2] * a[-1] * b[-1]


def _mm(node: Node, s: _Shapes) -> int:
    args = arguments(node)
    return _matmul_2d(s.of(args["self"], node), s.of(args["mat2"], node))


def _addmm(node: Node, s: _Shapes) -> int:
    args = arguments(node)
    return _matmul_2d(s.of(args["mat1"], node), s.of(args["mat2"], node))


def _bmm(node: Node, s: _Shapes) -> int:
    args = arguments(node)
    a = s.of(args["self"], node)
    return a[0] * _matmul_2d(a, s.of(args["mat2"], node))


def _batched(node: Node, s: _Shapes) -> int:  # baddbmm, addbmm
    args = arguments(node)
    a = s.of(args["batch1"], node)
    return a[0] * _matmul_2d(a, s.of(args["batch2"], node))


def _matmul(node: Node, s: _Shapes) -> int:
    args = arguments(node)
    a, b = s.of(args["self"], node), s.of(args["other"], node)
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    batch = torch.broadcast_shapes(torch.Size(a2[:-2]), torch.Size(b2[:-2]))
    return math.prod(batch) * _matmul_2d(a2, b2)


def _linear(node: Node, s: _Shapes) -> int:
    args = arguments(node)
    x, w = s.of(args["input"], node), s.of(args["weight"], node)
    return 2 * math.prod(x[:-1]) * x[-1] * (w[0] if len(w) == 2 else 1)


def _conv_count(x: Shape, w: Shape, out: Shape, transposed: bool) -> int:
    spatial = x[2:] if transposed else out[2:]
    return 2 * math.prod(w) * x[0] * math.prod(spatial)


def _convolution(node: Node, s: _Shapes) -> int:
    args = arguments(node)
    x, w = s.of(args["input"], node), s.of(args["weight"], node)
    return _conv_count(x, w, s.of(node, node), bool(args["transposed"]))


def _convolution_backward(node: Node, s: _Shapes) -> int:
    args = arguments(node)
    x, w = s.of(args["input"], node), s.of(args["weight"], node)
    once = _conv_count(x, w, s.of(args["grad_output"], node), bool(args["transposed"]))
    mask = list(args["output_mask"])
    return once * (int(bool(mask[0])) + int(bool(mask[1])))


def _attention_count(q: Shape, k: Shape, v: Shape) -> int:
    return 2 * math.prod(q[:-2]) * q[-2] * k[-2] * (q[-1] + v[-1])


def _attention(names: Sequence[str], factor: int) -> Callable[[Node, _Shapes], int]:
    def rule(node: Node, s: _Shapes) -> int:
        args = arguments(node)
        q, k, v = (s.of(args[n], node) for n in names)
        return factor * _attention_count(q, k, v)

    return rule


def _overloads(*names: str) -> list[Any]:
    """The aten overloads of `names` that this torch has (`op.overload`, `op` for default)."""
    found = []
    for name in names:
        op, _, overload = name.partition(".")
        packet = getattr(aten, op, None)
        target = getattr(packet, overload or "default", None) if packet is not None else None
        if target is not None:
            found.append(target)
    return found


def _rules() -> dict[Any, Callable[[Node, _Shapes], int]]:
    rules: dict[Any, Callable[[Node, _Shapes], int]] = {}
    table: list[tuple[list[Any], Callable[[Node, _Shapes], int]]] = [
        (_overloads("mm"), _mm),
        (_overloads("addmm"), _addmm),
        (_overloads("bmm"), _bmm),
        (_overloads("baddbmm", "addbmm"), _batched),
        (_overloads("matmul"), _matmul),
        (_overloads("linear"), _linear),
        (_overloads("convolution"), _convolution),
        (_overloads("convolution_backward"), _convolution_backward),
        (
            _overloads(
                "scaled_dot_product_attention",
                "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention",
            ),
            _attention(("query", "key", "value"), 1),
        ),
        (
            _overloads(
                "_scaled_dot_product_flash_attention_backward",
                "_scaled_dot_product_flash_attention_for_cpu_backward",
                "_scaled_dot_product_efficient_attention_backward",
                "_scaled_dot_product_cudnn_attention_backward",
            ),
            _attention(("query", "key", "value"), 2),
        ),
    ]
    portable_ops = torch.ops.portable
    table += [
        ([portable_ops.attention.default], _attention(("q", "k", "v"), 1)),
        (
            [portable_ops.attention_backward.default, portable_ops.attention_backward.mask_grad],
            _attention(("q", "k", "v"), 2),
        ),
    ]
    for targets, rule in table:
        rules.update(dict.fromkeys(targets, rule))
    return rules


_RULES = _rules()
