"""Sharding rules: for one op, given its inputs' shardings, the shardings its inputs must have
and the sharding of its result(s), plus any size arguments rewritten to local sizes.

A rule returns a `Decision`; the walker (spmd_partition.py) inserts the collectives that bring
each input to the required sharding. An op without a rule gets `replicate_all`: every input is
gathered and reduced to a full copy, the op runs on global shapes and its result is replicated.
That is always correct, only slower, so rules exist for the ops that carry the big tensors:
pointwise ops, reductions, matmuls, views, norms, attention, softmax, embeddings and losses.

Partial values (a sum still to be taken across an axis) pass through ops that are linear in
them (`neg`, `mul` by a replicated value, `add` of two partial sums, `sum`, matmul with one partial
operand), and are reduced before anything else.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from portable.ir.plan import Mesh
from portable.ir.sharding import Sharding

__all__ = ["RULES", "Decision", "RuleContext", "replicate_all"]

aten = torch.ops.aten
portable_ops = torch.ops.portable

Key = int | tuple[int, int] | str


@dataclasses.dataclass
class Decision:
    inputs: dict[Key, Sharding]
    output: Any  # Sharding, or a tuple of them (None for non-tensor results)
    args: dict[int, Any] = dataclasses.field(default_factory=dict)  # replaced positional args


class RuleContext:
    def __init__(
        self,
        mesh: Mesh,
        sharding: dict,
        shapes: dict,
        dtypes: dict,
        sequence_parallel: str | None = None,
        parameters: frozenset[torch.fx.Node] = frozenset(),
    ) -> None:
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self._parameters = parameters
        self._sharding = sharding
        self._shapes = shapes
        self._dtypes = dtypes

    def sh(self, node: torch.fx.Node) -> Sharding:
        return self._sharding[node]

    def shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        return self._shapes[node]

    def dtype(self, node: torch.fx.Node) -> torch.dtype:
        return self._dtypes[node]

    def numel(self, node: torch.fx.Node) -> int:
        return math.prod(self.shape(node))

    def is_parameter(self, node: torch.fx.Node) -> bool:
        """Whether `node` is a parameter or a view/cast of one (no activation flows into it)."""
        return node in self._parameters


RULES: dict[Any, Callable[[RuleContext, torch.fx.Node], Decision]] = {}


def rule(*targets):
    def register(fn):
        for t in targets:
            RULES[t] = fn
        return fn

    return register


# --------------------------------------------------------------------------- helpers


def tensor_args(node: torch.fx.Node) -> list[tuple[Key, torch.fx.Node]]:
    out: list[tuple[Key, torch.fx.Node]] = []
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node):
            out.append((i, a))
        elif isinstance(a, (list, tuple)):
            out.extend(((i, j), x) for j, x in enumerate(a) if isinstance(x, torch.fx.Node))
    for k, a in node.kwargs.items():
        if isinstance(a, torch.fx.Node):
            out.append((k, a))
    return out


def replicated_like(ctx: RuleContext, node: torch.fx.Node) -> Sharding:
    return Sharding.replicated(len(ctx.shape(node)))


def out_ndim(node: torch.fx.Node) -> int:
    return len(node.meta["tensor"].shape)


def replicate_all(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """The fallback: full copies in, full copy out."""
    inputs = {k: replicated_like(ctx, a) for k, a in tensor_args(node)}
    meta = node.meta["tensor"]
    if isinstance(meta, tuple):
        out = tuple(Sharding.replicated(len(m.shape)) if m is not None else None for m in meta)
    else:
        out = Sharding.replicated(len(meta.shape)) if meta is not None else None
    return Decision(inputs, out)


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _drop_partial(s: Sharding) -> Sharding:
    return Sharding(s.dims)


def _unshard_dims(s: Sharding, dims: Sequence[int]) -> Sharding:
    new = [() if i in dims else d for i, d in enumerate(s.dims)]
    return Sharding(tuple(new), s.partial)


# --------------------------------------------------------------------------- pointwise

_LINEAR_UNARY = {aten.neg.default, aten.clone.default, aten.alias.default}
_ADDITIVE = {aten.add.Tensor, aten.sub.Tensor}
_MULTIPLICATIVE = {aten.mul.Tensor}
_DIVISION = {aten.div.Tensor}


def _linear_partial(ctx: RuleContext, node: torch.fx.Node, partial_keys, ops) -> bool:
    """Whether a partial value over one axis may flow through `node` unreduced."""
    if len(set(ops)) != 1 or ops[0] not in ("sum", "avg"):
        return False
    tensors = tensor_args(node)
    keys = [k for k, _ in tensors]
    if any(len(a.users) > 1 for k, a in tensors if k in partial_keys):
        return False  # reduce a shared partial value once, not once per linear consumer
    if node.target in _LINEAR_UNARY:
        return True
    if node.target is aten._to_copy.default:
        src = ctx.dtype(tensors[0][1])
        dst = node.kwargs.get("dtype", src)
        return dst.is_floating_point and dst.itemsize >= src.itemsize
    if node.target in _ADDITIVE:
        return len(partial_keys) == len(keys) == 2 and node.kwargs.get("alpha", 1) == 1
    if node.target in _MULTIPLICATIVE:
        return len(partial_keys) == 1
    if node.target in _DIVISION:
        return partial_keys == [keys[0]]
    return False


def pointwise(ctx: RuleContext, node: torch.fx.Node, *, keep_partial: bool = True) -> Decision:
    """Broadcasting n-ary elementwise op: inputs aligned from the right; a dim split on any input
    is split on the output (replicated inputs are sliced locally, broadcast dims stay whole)."""
    tensors = tensor_args(node)
    nd = out_ndim(node)
    oshape = node.meta["tensor"].shape
    target: list[tuple[str, ...]] = [() for _ in range(nd)]
    used: set[str] = set()
    for _, arg in tensors:
        s, shape = ctx.sh(arg), ctx.shape(arg)
        off = nd - len(shape)
        for d, axes in enumerate(s.dims):
            if not axes or target[d + off] or used & set(axes):
                continue
            if shape[d] != oshape[d + off]:
                continue
            target[d + off] = axes
            used |= set(axes)
    partial: dict[str, str] = {}
    if keep_partial:
        for axis in ctx.mesh.names:
            if axis in used:
                continue
            pkeys = [k for k, a in tensors if ctx.sh(a).partial_op(axis)]
            if not pkeys:
                continue
            ops = [ctx.sh(a).partial_op(axis) for k, a in tensors if k in pkeys]
            if _linear_partial(ctx, node, pkeys, ops):
                partial[axis] = ops[0]
            elif _sequence_split(ctx, axis, oshape, target):
                # sequence parallelism: reduce-scatter the partial sum onto the sequence dim
                # instead of all-reducing it; token-wise ops then run on a slice of the sequence
                target[1] = target[1] + (axis,)
                used.add(axis)
    out = Sharding(tuple(target), tuple(sorted(partial.items())))
    inputs = {}
    for key, arg in tensors:
        shape = ctx.shape(arg)
        off = nd - len(shape)
        dims = tuple(
            target[d + off] if shape[d] == oshape[d + off] else () for d in range(len(shape))
        )
        keep = {a: op for a, op in partial.items() if ctx.sh(arg).partial_op(a)}
        inputs[key] = Sharding(dims, tuple(sorted(keep.items())))
    return Decision(inputs, out)


def _sequence_split(ctx: RuleContext, axis: str, oshape, target) -> bool:
    """Whether a [batch, seq, hidden] activation may be split on seq over `axis`."""
    if ctx.sequence_parallel != axis or len(oshape) != 3:
        return False
    factor = math.prod(ctx.mesh.axis_size(a) for a in (*target[1], axis))
    return oshape[1] % factor == 0


_POINTWISE = [
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.neg.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.addcmul.default,
    aten.addcdiv.default,
    aten.pow.Scalar,
    aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor,
    aten.reciprocal.default,
    aten.rsub.Scalar,
    aten.sqrt.default,
    aten.rsqrt.default,
    aten.lerp.Scalar,
    aten.lerp.Tensor,
    aten.gelu.default,
    aten.gelu_backward.default,
    aten.silu.default,
    aten.silu_backward.default,
    aten.relu.default,
    aten.threshold_backward.default,
    aten.sigmoid.default,
    aten.sigmoid_backward.default,
    aten.tanh.default,
    aten.tanh_backward.default,
    aten.exp.default,
    aten.log.default,
    aten.abs.default,
    aten.sin.default,
    aten.cos.default,
    aten.bitwise_not.default,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.logical_not.default,
    aten.eq.Scalar,
    aten.eq.Tensor,
    aten.ne.Scalar,
    aten.gt.Scalar,
    aten.lt.Scalar,
    aten.ge.Scalar,
    aten.le.Scalar,
    aten.where.self,
    aten.maximum.default,
    aten.minimum.default,
    aten.clamp.default,
    aten.masked_fill.Scalar,
    aten.sign.default,
    aten.erf.default,
]
for _t in _POINTWISE:
    RULES[_t] = pointwise


@rule(aten.ones_like.default, aten.zeros_like.default, aten.full_like.default)
def like(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    s = _drop_partial(ctx.sh(node.args[0]))
    return Decision({0: ctx.sh(node.args[0])}, s)


# --------------------------------------------------------------------------- reductions


def _reduction(ctx: RuleContext, node: torch.fx.Node, dims, keepdim: bool, kind: str) -> Decision:
    x = node.args[0]
    s = ctx.sh(x)
    nd = len(ctx.shape(x))
    rdims = set(range(nd)) if dims is None or len(dims) == 0 else {_norm_dim(d, nd) for d in dims}
    # partial inputs stay partial only through a sum
    want_in = s if kind == "sum" else _drop_partial(s)
    partial = dict(want_in.partial)
    out_dims = []
    for d in range(nd):
        if d in rdims:
            for a in s.dims[d]:
                partial[a] = kind
            if keepdim:
                out_dims.append(())
        else:
            out_dims.append(s.dims[d])
    return Decision({0: want_in}, Sharding(tuple(out_dims), tuple(sorted(partial.items()))))


@rule(aten.sum.dim_IntList)
def sum_dim(ctx, node):
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return _reduction(ctx, node, dims, keep, "sum")


@rule(aten.sum.default)
def sum_all(ctx, node):
    return _reduction(ctx, node, None, False, "sum")


@rule(aten.mean.dim)
def mean_dim(ctx, node):
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return _reduction(ctx, node, dims, keep, "avg")


@rule(aten.amax.default, aten.amin.default)
def amax(ctx, node):
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    kind = "max" if node.target is aten.amax.default else "min"
    return _reduction(ctx, node, dims, keep, kind)


# --------------------------------------------------------------------------- matmuls


def _axis_state(s: Sharding, axis: str) -> tuple[str, int | None]:
    d = s.dim_of(axis)
    if d is not None:
        return "S", d
    if s.partial_op(axis):
        return "P", None
    return "R", None


def _matmul(ctx: RuleContext, a: torch.fx.Node, b: torch.fx.Node, nbatch: int):
    """Shardings for a [batch..., m, k] x b [batch..., k, n]; returns (a_req, b_req, out)."""
    sa, sb = ctx.sh(a), ctx.sh(b)
    m_dim, ka_dim = nbatch, nbatch + 1
    kb_dim, n_dim = nbatch, nbatch + 1
    a_dims: list[list[str]] = [[] for _ in range(nbatch + 2)]
    b_dims: list[list[str]] = [[] for _ in range(nbatch + 2)]
    o_dims: list[list[str]] = [[] for _ in range(nbatch + 2)]
    a_part: dict[str, str] = {}
    b_part: dict[str, str] = {}
    o_part: dict[str, str] = {}
    # on a conflict, gather the parameter (FSDP: weights are gathered, activations never);
    # between two parameters or two activations, the smaller one
    a_param, b_param = ctx.is_parameter(a), ctx.is_parameter(b)
    a_big = (b_param and not a_param) or (a_param == b_param and ctx.numel(a) >= ctx.numel(b))
    for axis in ctx.mesh.names:
        (ka, da), (kb, db) = _axis_state(sa, axis), _axis_state(sb, axis)
        # partial operands: linear in one of them
        if ka == "P" and kb == "P":
            ka = "R"  # reduce a
        if ka == "P":
            if kb == "R" and sa.partial_op(axis) in ("sum", "avg") and len(a.users) == 1:
                a_part[axis] = o_part[axis] = sa.partial_op(axis)
                continue
            ka = "R"
        if kb == "P":
            if ka == "R" and sb.partial_op(axis) in ("sum", "avg") and len(b.users) == 1:
                b_part[axis] = o_part[axis] = sb.partial_op(axis)
                continue
            kb = "R"
        a_role = None if ka == "R" else ("batch" if da < nbatch else "m" if da == m_dim else "k")
        b_role = None if kb == "R" else ("batch" if db < nbatch else "k" if db == kb_dim else "n")
        if a_role and b_role and not (a_role == b_role and (a_role != "batch" or da == db)):
            # conflict: gather the smaller operand along this axis
            if a_big:
                b_role = None
            else:
                a_role = None
        role = a_role or b_role
        if role is None:
            continue
        if role == "batch":
            d = da if a_role else db
            a_dims[d].append(axis)
            b_dims[d].append(axis)
            o_dims[d].append(axis)
        elif role == "m":
            a_dims[m_dim].append(axis)
            o_dims[m_dim].append(axis)
        elif role == "n":
            b_dims[n_dim].append(axis)
            o_dims[n_dim].append(axis)
        else:  # k on both: a partial sum
            a_dims[ka_dim].append(axis)
            b_dims[kb_dim].append(axis)
            o_part[axis] = "sum"
    mk = lambda dims, part: Sharding(tuple(tuple(d) for d in dims), tuple(sorted(part.items())))  # noqa: E731
    return mk(a_dims, a_part), mk(b_dims, b_part), mk(o_dims, o_part)


@rule(aten.mm.default)
def mm(ctx, node):
    a_req, b_req, out = _matmul(ctx, node.args[0], node.args[1], 0)
    return Decision({0: a_req, 1: b_req}, out)


@rule(aten.bmm.default)
def bmm(ctx, node):
    a_req, b_req, out = _matmul(ctx, node.args[0], node.args[1], 1)
    return Decision({0: a_req, 1: b_req}, out)


@rule(aten.addmm.default)
def addmm(ctx, node):
    """bias + a @ b. The walker splits it into mm + add when the product would be partial."""
    bias, a, b = node.args[:3]
    a_req, b_req, out = _matmul(ctx, a, b, 0)
    if out.partial:
        return Decision({}, None, args={"split": True})
    bshape = ctx.shape(bias)
    off = 2 - len(bshape)
    full = node.meta["tensor"].shape
    bdims = tuple(
        out.dims[d + off] if bshape[d] == full[d + off] else () for d in range(len(bshape))
    )
    return Decision({0: Sharding(bdims), 1: a_req, 2: b_req}, out)


# --------------------------------------------------------------------------- layout ops


@rule(aten.t.default)
def t(ctx, node):
    s = ctx.sh(node.args[0])
    dims = s.dims[::-1] if len(s.dims) == 2 else s.dims
    return Decision({0: s}, Sharding(dims, s.partial))


@rule(aten.transpose.int)
def transpose(ctx, node):
    s = ctx.sh(node.args[0])
    nd = len(s.dims)
    d0, d1 = _norm_dim(node.args[1], nd), _norm_dim(node.args[2], nd)
    dims = list(s.dims)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return Decision({0: s}, Sharding(tuple(dims), s.partial))


@rule(aten.permute.default)
def permute(ctx, node):
    s = ctx.sh(node.args[0])
    nd = len(s.dims)
    order = [_norm_dim(d, nd) for d in node.args[1]]
    return Decision({0: s}, Sharding(tuple(s.dims[d] for d in order), s.partial))


def _groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair up runs of src dims and dst dims with equal products (a reshape's dim mapping)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        if i < len(src):
            gi.append(i)
            pi *= src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pj *= dst[j]
            j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif pj < pi and j < len(dst):
                gj.append(j)
                pj *= dst[j]
                j += 1
            else:
                return None
        # absorb trailing size-1 dims into this group
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _reshape(ctx, node) -> tuple[Sharding, Sharding] | None:
    """(required input, output) shardings of a reshape: a split dim stays split when it leads
    its group of merged/split dims and the axes divide the output dim it maps to; other split
    dims are gathered first. None when the dims do not group (then: full copies)."""
    x = node.args[0]
    s, src, dst = ctx.sh(x), ctx.shape(x), tuple(node.meta["tensor"].shape)
    groups = _groups(src, dst)
    if groups is None:
        return None
    in_dims = [list(d) for d in s.dims]
    out_dims: list[tuple[str, ...]] = [() for _ in dst]
    for gi, gj in groups:
        lead_i = next((d for d in gi if src[d] != 1), None)
        lead_j = next((d for d in gj if dst[d] != 1), None)
        for d in gi:
            if not in_dims[d]:
                continue
            factor = math.prod(ctx.mesh.axis_size(a) for a in in_dims[d])
            if d == lead_i and lead_j is not None and dst[lead_j] % factor == 0:
                out_dims[lead_j] = tuple(in_dims[d])
            else:
                in_dims[d] = []
    return Sharding(tuple(tuple(d) for d in in_dims), s.partial), Sharding(
        tuple(out_dims), s.partial
    )


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view(ctx, node):
    shardings = _reshape(ctx, node)
    if shardings is None:
        return replicate_all(ctx, node)
    req, out = shardings
    local = list(out.local_shape(node.meta["tensor"].shape, ctx.mesh))
    return Decision({0: req}, out, args={1: local})


@rule(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def view_like(ctx, node):
    """A reshape whose size argument is implied: no argument to rewrite."""
    shardings = _reshape(ctx, node)
    if shardings is None:
        return replicate_all(ctx, node)
    return Decision({0: shardings[0]}, shardings[1])


@rule(aten.expand.default)
def expand(ctx, node):
    x = node.args[0]
    s, src = ctx.sh(x), ctx.shape(x)
    dst = tuple(node.meta["tensor"].shape)
    off = len(dst) - len(src)
    out_dims = [()] * off + [s.dims[d] if src[d] == dst[d + off] else () for d in range(len(src))]
    out = Sharding(tuple(out_dims), s.partial)
    local = list(out.local_shape(dst, ctx.mesh))
    sizes = [-1 if (d >= off and node.args[1][d] == -1) else local[d] for d in range(len(dst))]
    return Decision({0: Sharding(tuple(out_dims[off:]), s.partial)}, out, args={1: sizes})


@rule(aten.slice.Tensor)
def slice_(ctx, node):
    x = node.args[0]
    s, shape = ctx.sh(x), ctx.shape(x)
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    out_shape = node.meta["tensor"].shape
    if s.dims[dim] and out_shape[dim] != shape[dim]:
        s = _unshard_dims(s, [dim])
    return Decision({0: s}, s)


@rule(aten.select.int)
def select(ctx, node):
    x = node.args[0]
    s = ctx.sh(x)
    dim = _norm_dim(node.args[1], len(s.dims))
    s = _unshard_dims(s, [dim])
    out = Sharding(s.dims[:dim] + s.dims[dim + 1 :], s.partial)
    return Decision({0: s}, out)


@rule(aten.split_with_sizes.default, aten.split.Tensor)
def split(ctx, node):
    x = node.args[0]
    s = ctx.sh(x)
    dim = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(s.dims))
    s = _unshard_dims(s, [dim])
    return Decision({0: s}, tuple(s for _ in node.meta["tensor"]))


@rule(aten.cat.default)
def cat(ctx, node):
    tensors = node.args[0]
    nd = out_ndim(node)
    dim = _norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
    first = _unshard_dims(_drop_partial(ctx.sh(tensors[0])), [dim])
    return Decision({(0, j): first for j in range(len(tensors))}, first)


# --------------------------------------------------------------------------- nn ops


@rule(aten._softmax.default, aten._log_softmax.default)
def softmax(ctx, node):
    s = _drop_partial(ctx.sh(node.args[0]))
    s = _unshard_dims(s, [_norm_dim(node.args[1], len(s.dims))])
    return Decision({0: s}, s)


@rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward(ctx, node):
    s = _drop_partial(ctx.sh(node.args[1]))
    s = _unshard_dims(s, [_norm_dim(node.args[2], len(s.dims))])
    return Decision({0: s, 1: s}, s)


def _norm_input(ctx, x, nnorm: int) -> Sharding:
    s = _drop_partial(ctx.sh(x))
    nd = len(s.dims)
    return _unshard_dims(s, list(range(nd - nnorm, nd)))


def _stats(s: Sharding, nnorm: int) -> Sharding:
    nd = len(s.dims)
    return Sharding(s.dims[: nd - nnorm] + ((),) * nnorm)


def _leading_partial(s: Sharding, ndim: int) -> Sharding:
    """A per-feature gradient summed over the leading (batch) dims: partial over their axes."""
    return Sharding(((),) * ndim, tuple(sorted((a, "sum") for a in s.axes())))


def _replicated_args(ctx, node, positions) -> dict:
    return {
        i: replicated_like(ctx, node.args[i])
        for i in positions
        if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)
    }


@rule(aten.native_layer_norm.default)
def native_layer_norm(ctx, node):
    nnorm = len(node.args[1])
    s = _norm_input(ctx, node.args[0], nnorm)
    return Decision(
        {0: s, **_replicated_args(ctx, node, (2, 3))}, (s, _stats(s, nnorm), _stats(s, nnorm))
    )


@rule(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(ctx, node):
    nnorm = len(node.args[2])
    s = _norm_input(ctx, node.args[1], nnorm)
    inputs = {0: s, 1: s, 3: _stats(s, nnorm), 4: _stats(s, nnorm)}
    inputs.update(_replicated_args(ctx, node, (5, 6)))
    outs = []
    for i, meta in enumerate(node.meta["tensor"]):
        if meta is None:
            outs.append(None)
        elif i == 0:
            outs.append(s)
        else:
            outs.append(_leading_partial(s, len(meta.shape)))
    return Decision(inputs, tuple(outs))


@rule(portable_ops.layer_norm.default)
def layer_norm(ctx, node):
    s = _norm_input(ctx, node.args[0], len(node.args[1]))
    return Decision({0: s, **_replicated_args(ctx, node, (2, 3))}, s)


@rule(portable_ops.rms_norm.default)
def rms_norm(ctx, node):
    s = _norm_input(ctx, node.args[0], len(node.args[1]))
    return Decision({0: s, **_replicated_args(ctx, node, (2,))}, s)


@rule(portable_ops.rms_norm_backward.default)
def rms_norm_backward(ctx, node):
    s = _norm_input(ctx, node.args[1], len(node.args[2]))
    w = node.args[3] if len(node.args) > 3 else None
    inputs = {0: s, 1: s, **_replicated_args(ctx, node, (3,))}
    wmeta = node.meta["tensor"][1]
    dw = (
        _leading_partial(s, len(wmeta.shape))
        if isinstance(w, torch.fx.Node)
        else Sharding.replicated(len(wmeta.shape))
    )
    return Decision(inputs, (s, dw))


def _attention_sharding(ctx, q, k) -> Sharding:
    """Batch (0) and head (1) dims may be split; sequence and head_dim stay whole. GQA: k/v have
    fewer heads, so heads stay split only if that count divides too."""
    s = _drop_partial(ctx.sh(q))
    s = _unshard_dims(s, [2, 3])
    if s.dims[1]:
        factor = s.factor(ctx.mesh, 1)
        if ctx.shape(k)[1] % factor:
            s = _unshard_dims(s, [1])
    return s


def _mask_sharding(ctx, mask, s: Sharding, full: Sequence[int]) -> Sharding:
    shape = ctx.shape(mask)
    off = len(full) - len(shape)
    dims = tuple(
        s.dims[d + off] if (d + off < 2 and shape[d] == full[d + off]) else ()
        for d in range(len(shape))
    )
    return Sharding(dims)


@rule(portable_ops.attention.default)
def attention(ctx, node):
    q, k, v = node.args[:3]
    s = _attention_sharding(ctx, q, k)
    inputs = {0: s, 1: s, 2: s}
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("mask")
    if isinstance(mask, torch.fx.Node):
        key = 3 if len(node.args) > 3 else "mask"
        inputs[key] = _mask_sharding(ctx, mask, s, ctx.shape(q)[:2] + ctx.shape(k)[2:3])
    return Decision(inputs, s)


@rule(portable_ops.attention_backward.default)
def attention_backward(ctx, node):
    grad, q, k, v = node.args[:4]
    s = _attention_sharding(ctx, q, k)
    inputs = {0: s, 1: s, 2: s, 3: s}
    mask = node.args[4] if len(node.args) > 4 else node.kwargs.get("mask")
    if isinstance(mask, torch.fx.Node):
        key = 4 if len(node.args) > 4 else "mask"
        inputs[key] = _mask_sharding(ctx, mask, s, ctx.shape(q)[:2] + ctx.shape(k)[2:3])
    return Decision(inputs, (s, s, s))


@rule(aten.embedding.default)
def embedding(ctx, node):
    """A table split on the vocabulary over one axis is looked up on the shard (the walker's
    masked lookup: ids outside the shard give zeros, the result is a partial sum over the axis);
    otherwise the vocabulary dim is gathered first."""
    weight, indices = node.args[:2]
    ws = _drop_partial(ctx.sh(weight))
    xs = _drop_partial(ctx.sh(indices))
    used = set(xs.axes())
    if used & set(ws.dims[1]):
        ws = _unshard_dims(ws, [1])
    if len(ws.dims[0]) == 1 and not used & set(ws.dims[0]) and not ws.dims[1]:
        (axis,) = ws.dims[0]
        out = Sharding(xs.dims + ((),), ((axis, "sum"),))
        return Decision({0: ws, 1: xs}, out, args={"vocab_parallel": axis})
    ws = _unshard_dims(ws, [0])
    return Decision({0: ws, 1: xs}, Sharding(xs.dims + (ws.dims[1],)))


@rule(aten.embedding_dense_backward.default)
def embedding_dense_backward(ctx, node):
    grad, indices = node.args[:2]
    xs = _drop_partial(ctx.sh(indices))
    gs = _drop_partial(ctx.sh(grad))
    last = gs.dims[-1] if not (set(gs.dims[-1]) & set(xs.axes())) else ()
    g_req = Sharding(xs.dims + (last,))
    out = Sharding(((), last), tuple(sorted((a, "sum") for a in xs.axes())))
    return Decision({0: g_req, 1: xs}, out)


@rule(aten.nll_loss_forward.default)
def nll_loss_forward(ctx, node):
    """Only reduction=sum splits (the pass rewrites mean as sum / total_weight first)."""
    x, target = node.args[:2]
    reduction = node.args[3] if len(node.args) > 3 else 1
    if reduction != 2 or (len(node.args) > 2 and isinstance(node.args[2], torch.fx.Node)):
        return replicate_all(ctx, node)
    xs = _unshard_dims(_drop_partial(ctx.sh(x)), [len(ctx.shape(x)) - 1])
    ts = Sharding(xs.dims[:-1])
    partial = tuple(sorted((a, "sum") for a in xs.axes()))
    return Decision({0: xs, 1: ts}, (Sharding((), partial), Sharding((), partial)))


@rule(aten.nll_loss_backward.default)
def nll_loss_backward(ctx, node):
    grad, x, target, weight, reduction, ignore, total = node.args[:7]
    if isinstance(weight, torch.fx.Node) or reduction == 0:
        return replicate_all(ctx, node)
    xs = _unshard_dims(_drop_partial(ctx.sh(x)), [len(ctx.shape(x)) - 1])
    inputs = {
        0: replicated_like(ctx, grad),
        1: xs,
        2: Sharding(xs.dims[:-1]),
        6: replicated_like(ctx, total),
    }
    return Decision(inputs, xs)


@rule(
    aten.scalar_tensor.default,
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.empty.memory_format,
)
def creation(ctx, node):
    """No tensor inputs: every rank creates the whole (replicated) value."""
    return Decision({}, Sharding.replicated(out_ndim(node)))


@rule(operator.getitem)
def getitem(ctx, node):
    parent = ctx.sh(node.args[0])
    return Decision({}, parent[node.args[1]])
