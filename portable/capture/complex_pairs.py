"""Complex values as real pairs: capture rewrites complex arithmetic into real ops.

The opset, safetensors and every backend are real-valued, while some models rotate with complex
numbers: torchtitan's Llama 3 applies rotary embeddings as
`view_as_real(view_as_complex(x.reshape(..., -1, 2)) * freqs_cis)` with a complex64 buffer
`freqs_cis = polar(1, angles)`. This rewrite runs on torch.export's training IR, before
decomposition and autograd (so the joint graph differentiates the real form), and carries every
complex tensor of shape S as the real tensor of shape S + [2] that `torch.view_as_real` gives:
`[..., 0]` the real part, `[..., 1]` the imaginary part. Then

    view_as_complex(x)  ->  x                      view_as_real(z)  ->  z
    (a + ib) * (c + id) ->  stack(a*c - b*d, a*d + b*c)   (ATen's vectorized complex multiply)
    polar(r, t)         ->  stack(r * cos(t), r * sin(t))
    shape ops on z      ->  the same op on the pair, the trailing pair dim kept

and a complex buffer or constant becomes its `view_as_real` pairs in the program's weights.
Complex user inputs, outputs and parameters, and complex ops outside RULES, are refused with
a CaptureError that names the op and line.

Numerics: ATen multiplies complex64 vectors as the formula above (each product rounded, then one
subtraction or addition), so the rewrite is bit-identical to eager wherever eager takes its
vectorized loop; eager's scalar tail loop fuses one multiply-add, where results agree to one
rounding of the rotated value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind, InputSpec

from ..errors import CaptureError
from ..ir.source import SourceLoc
from ..opset import op_name
from ..opset.bind import arguments as _arguments

aten = torch.ops.aten

__all__ = ["RULES", "lower_complex"]

# node metadata that a replacement inherits from the node it replaces (source lines, modules)
_INHERITED_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "from_node")


def _is_complex(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_complex()


def _complex_node(value: Any) -> bool:
    return isinstance(value, torch.fx.Node) and _is_complex(value.meta.get("val"))


class _Emit:
    """Creates call_function nodes before `at`, with fake values and `at`'s source metadata."""

    def __init__(self, graph: torch.fx.Graph, at: torch.fx.Node) -> None:
        self.graph, self.at = graph, at

    def __call__(self, target: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with self.graph.inserting_before(self.at):
            node = self.graph.call_function(target, args, kwargs)
        values, kw = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
        node.meta["val"] = target(*values, **kw)
        for key in _INHERITED_META:
            if key in self.at.meta:
                node.meta[key] = self.at.meta[key]
        return node


def _rank(node: torch.fx.Node) -> int:
    return node.meta["val"].dim()


def _dim(dim: int, rank: int) -> int:
    """A dim of a complex tensor of `rank` dims as a non-negative dim of its pair tensor."""
    return dim + rank if dim < 0 else dim


def _again(
    emit: _Emit, node: torch.fx.Node, pair: Callable[[Any], Any], **changes: Any
) -> torch.fx.Node:
    """`node`'s op once more, on the pairs of its tensor arguments, with `changes` by name."""
    target = node.target
    assert isinstance(target, torch._ops.OpOverload), "RULES holds op overloads only"
    values = {**_arguments(node), **changes}
    args, kwargs = [], {}
    for arg in target._schema.arguments:
        value = torch.fx.node.map_aggregate(values[arg.name], pair)
        if arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            args.append(value)
    return emit(target, *args, **kwargs)


# -- rules: (emit, node, pair-of) -> the replacement node ------------------------------------
# `pair(x)` is the pair tensor of a complex node x (or x itself for a real value).

Rule = Callable[[_Emit, torch.fx.Node, Callable[[Any], Any]], torch.fx.Node | None]


def _view_as_complex(emit, node, pair):
    # view_as_complex(x [..., 2]) -> x: the pair form of the result is its input
    return _arguments(node)["self"]


def _view_as_real(emit, node, pair):
    return pair(_arguments(node)["self"])


def _parts(emit, z):
    return emit(aten.select.int, z, -1, 0), emit(aten.select.int, z, -1, 1)


def _complex_mul(emit, x, y):
    # (a + ib) * (c + id) = (a*c - b*d) + i(a*d + b*c), as ATen's vectorized kernel rounds it
    a, b = _parts(emit, x)
    c, d = _parts(emit, y)
    real = emit(aten.sub.Tensor, emit(aten.mul.Tensor, a, c), emit(aten.mul.Tensor, b, d))
    imag = emit(aten.add.Tensor, emit(aten.mul.Tensor, a, d), emit(aten.mul.Tensor, b, c))
    return emit(aten.stack.default, [real, imag], -1)


def _mul(emit, node, pair):
    x, y = _arguments(node)["self"], _arguments(node)["other"]
    if _complex_node(x) and _complex_node(y):
        return _complex_mul(emit, pair(x), pair(y))
    z, other = (x, y) if _complex_node(x) else (y, x)
    if not _complex_node(z) or isinstance(other, complex):
        raise _Unsupported("a complex Python scalar")
    if isinstance(other, torch.fx.Node):  # complex * real tensor: scale both parts
        other = emit(aten.unsqueeze.default, other, -1)
    return emit(aten.mul.Tensor, pair(z), other)


def _add_or_sub(emit, node, pair):
    # (a + ib) +- alpha (c + id) = (a +- alpha c) + i(b +- alpha d); alpha must be real
    a = _arguments(node)
    if not (_complex_node(a["self"]) and _complex_node(a["other"])):
        raise _Unsupported("a complex and a real operand")
    if isinstance(a["alpha"], complex):
        raise _Unsupported("a complex alpha")
    return _again(emit, node, pair)


def _polar(emit, node, pair):
    # polar(r, t) = r * cos(t) + i r * sin(t)
    a = _arguments(node)
    r, t = a["abs"], a["angle"]
    real = emit(aten.mul.Tensor, r, emit(aten.cos.default, t))
    imag = emit(aten.mul.Tensor, r, emit(aten.sin.default, t))
    return emit(aten.stack.default, [real, imag], -1)


def _same(emit, node, pair):
    # ops without dims or shapes (clone, alias, neg), or whose dims all lead (index: index
    # tensors address the leading dims, the pair dim follows): the same op on the pair
    return _again(emit, node, pair)


def _on_dim(emit, node, pair):
    # slice/select/index_select/gather(z, dim, ...): dim made non-negative, so it names the
    # same dim of the pair
    z = _arguments(node)["self"]
    return _again(emit, node, pair, dim=_dim(_arguments(node)["dim"], _rank(z)))


def _joined(emit, node, pair):
    # cat/stack(zs, dim): every operand complex; dim counted on the result's complex dims
    a = _arguments(node)
    if not all(_complex_node(z) for z in a["tensors"]):
        raise _Unsupported("a complex and a real operand")
    return _again(emit, node, pair, dim=_dim(a["dim"], _rank(node)))


def _unsqueeze(emit, node, pair):
    return _again(emit, node, pair, dim=_dim(_arguments(node)["dim"], _rank(node)))


def _with_shape(emit, node, pair):
    # view/reshape/_unsafe_view/expand(z, shape) -> the same with the pair dim appended
    name = node.target._schema.arguments[1].name  # "size" or "shape"
    return _again(emit, node, pair, **{name: [*_arguments(node)[name], 2]})


def _permute(emit, node, pair):
    rank = _rank(node)
    dims = [_dim(d, rank) for d in _arguments(node)["dims"]]
    return _again(emit, node, pair, dims=[*dims, rank])


def _transpose(emit, node, pair):
    a, rank = _arguments(node), _rank(node)
    return _again(emit, node, pair, dim0=_dim(a["dim0"], rank), dim1=_dim(a["dim1"], rank))


def _gather(emit, node, pair):
    # gather(z, dim, index): the index gets the pair dim (both parts of each element)
    index = _arguments(node)["index"]
    shape = [*index.meta["val"].shape, 2]
    index = emit(aten.expand.default, emit(aten.unsqueeze.default, index, -1), shape)
    z = _arguments(node)["self"]
    return _again(emit, node, pair, dim=_dim(_arguments(node)["dim"], _rank(z)), index=index)


def _to(emit, node, pair):
    # to(z, complex dtype): the pair converts to the matching real dtype; a real x becomes
    # the pair (x, 0)
    dtype, source = node.meta["val"].dtype, _arguments(node)["self"]
    if not dtype.is_complex:
        raise _Unsupported(f"a conversion to {dtype} (it drops the imaginary part)")
    real = emit(aten._to_copy.default, pair(source), dtype=dtype.to_real())
    if _complex_node(source):
        return real
    return emit(aten.stack.default, [real, emit(aten.zeros_like.default, real)], -1)


def _dropped(emit, node, pair):
    # export's runtime metadata asserts (`_assert_tensor_metadata(z, dtype=complex64)`): the
    # dtypes were checked at export and the verifier checks the pair form statically
    return None


def _part(index: int) -> Rule:
    def rule(emit, node, pair):
        return emit(aten.select.int, pair(_arguments(node)["self"]), -1, index)

    return rule


RULES: dict[Any, Rule] = {
    aten.view_as_complex.default: _view_as_complex,
    aten.view_as_real.default: _view_as_real,
    aten.mul.Tensor: _mul,
    aten.add.Tensor: _add_or_sub,
    aten.sub.Tensor: _add_or_sub,
    aten.polar.default: _polar,
    aten.real.default: _part(0),
    aten.imag.default: _part(1),
    aten.clone.default: _same,
    aten.alias.default: _same,
    aten.detach.default: _same,
    aten.neg.default: _same,
    aten.slice.Tensor: _on_dim,
    aten.select.int: _on_dim,
    aten.index_select.default: _on_dim,
    aten.unsqueeze.default: _unsqueeze,
    aten.view.default: _with_shape,
    aten.reshape.default: _with_shape,
    aten._unsafe_view.default: _with_shape,
    aten.expand.default: _with_shape,
    aten.permute.default: _permute,
    aten.transpose.int: _transpose,
    aten.index.Tensor: _same,
    aten.gather.default: _gather,
    aten.cat.default: _joined,
    aten.stack.default: _joined,
    aten.to.dtype: _to,
    aten._to_copy.default: _to,
    aten._assert_tensor_metadata.default: _dropped,
}


# -- the pass ---------------------------------------------------------------------------------


class _Unsupported(Exception):
    """A rule cannot take this use of complex values; `lower_complex` makes it a CaptureError."""


def lower_complex(
    ep: torch.export.ExportedProgram, source_of: Callable[[torch.fx.Node], SourceLoc | None]
) -> int:
    """Rewrite every complex value of `ep` (torch.export training IR) into real pairs, in place;
    complex buffers and constants become their pairs. Returns the number of ops rewritten.
    `source_of(node)` locates refusals."""
    gm = ep.graph_module
    if not any(_complex_node(n) for n in gm.graph.nodes):
        return 0
    _pair_state(ep)
    pairs: dict[torch.fx.Node, Any] = {}

    def pair(value):
        return pairs.get(value, value) if isinstance(value, torch.fx.Node) else value

    rewritten = []
    for node in list(gm.graph.nodes):
        if node.op == "output" and any(_complex_node(n) for n in node.all_input_nodes):
            raise _refused(node, None, source_of)
        if node.op != "call_function" or not _touches_complex(node):
            continue
        try:
            new = _apply_rule(gm.graph, node, pair)
        except _Unsupported as exc:
            raise _refused(node, str(exc), source_of) from None
        if _complex_node(node):
            pairs[node] = new
        elif new is not None:
            node.replace_all_uses_with(new)
        rewritten.append(node)
    for node in reversed(rewritten):
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return len(rewritten)


def _apply_rule(
    graph: torch.fx.Graph, node: torch.fx.Node, pair: Callable[[Any], Any]
) -> torch.fx.Node | None:
    """The replacement of `node` (None: dropped); _Unsupported when no rule takes it."""
    rule = RULES.get(node.target)
    new = rule(_Emit(graph, node), node, pair) if rule is not None else None
    if rule is None or (new is None and node.users):
        raise _Unsupported("complex values")
    return new


def _touches_complex(node: torch.fx.Node) -> bool:
    return _complex_node(node) or any(_complex_node(n) for n in node.all_input_nodes)


def _pair_state(ep: torch.export.ExportedProgram) -> None:
    """Complex buffers and constants -> their real pairs, in the ExportedProgram's state and the
    placeholders' fake values; complex parameters and user inputs are refused."""
    placeholders = [n for n in ep.graph_module.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, ep.graph_signature.input_specs, strict=True):
        value = node.meta.get("val")
        if not _is_complex(value):
            continue
        if spec.kind not in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            raise _refused_input(node, spec)
        state = ep.state_dict if spec.target in ep.state_dict else ep.constants
        pairs = torch.view_as_real(state[spec.target].detach().resolve_conj()).clone()
        state[spec.target] = pairs
        node.meta["val"] = value.fake_mode.from_tensor(pairs, static_shapes=True)
        node.meta.pop("tensor_meta", None)


def _refused_input(node: torch.fx.Node, spec: InputSpec) -> CaptureError:
    if spec.kind == InputKind.USER_INPUT:
        what = f"input {node.name} is complex"
        fix = (
            "pass torch.view_as_real(x) (a real tensor with a trailing dim of 2) and call "
            "torch.view_as_complex on it inside the model"
        )
    else:
        what = f"{spec.kind.name.lower()} {spec.target} is complex"
        fix = (
            "store it as torch.view_as_real pairs (a real tensor with a trailing dim of 2) and "
            "call torch.view_as_complex on it in forward"
        )
    return CaptureError(
        f"{what}: portable programs, their weights and every backend are real-valued", fix=fix
    )


def _refused(
    node: torch.fx.Node,
    what: str | None,
    source_of: Callable[[torch.fx.Node], SourceLoc | None],
) -> CaptureError:
    """The CaptureError for a complex op no rule takes (`what` None: a complex output)."""
    if what is None:
        return CaptureError(
            "the model returns a complex tensor: portable programs are real-valued",
            fix="return torch.view_as_real(z) and view it as complex after the call",
        )
    src = source_of(node)
    op = op_name(node.target)
    supported = ", ".join(sorted({op_name(t).split(".")[1] for t in RULES}))
    return CaptureError(
        f"{op} on {what} is not supported: capture turns complex values into real pairs for "
        f"{supported}",
        op=op,
        module=src.module if src else None,
        source=src.location() if src else None,
        fix="write that line with real tensors (for rotary embeddings: x * cos + rotate(x) * sin)",
    )
