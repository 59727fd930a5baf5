"""nn ops: softmax, norms and their backward, attention and its backward, embedding and its
backward, nll_loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx

from portable.ir.sharding import Sharding
from portable.opset.bind import bind

from .base import (
    Decision,
    Key,
    RuleContext,
    drop_partial,
    merged_dims,
    norm_dim,
    replicate_all,
    replicated_like,
    rule,
    unshard_dims,
)

aten = torch.ops.aten
portable_ops = torch.ops.portable


@rule(aten._softmax.default, aten._log_softmax.default)
def softmax(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    s = drop_partial(ctx.sh(bound.node("self")))
    s = unshard_dims(s, [norm_dim(bound.literal("dim"), len(s.dims))])
    return Decision({"self": s}, s)


@rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    s = drop_partial(ctx.sh(bound.node("output")))
    s = unshard_dims(s, [norm_dim(bound.literal("dim"), len(s.dims))])
    return Decision({"grad_output": s, "output": s}, s)


def _norm_input(ctx: RuleContext, x: torch.fx.Node, nnorm: int) -> Sharding:
    s = drop_partial(ctx.sh(x))
    nd = len(s.dims)
    return unshard_dims(s, list(range(nd - nnorm, nd)))


def _stats(s: Sharding, nnorm: int) -> Sharding:
    nd = len(s.dims)
    return Sharding(s.dims[: nd - nnorm] + ((),) * nnorm)


def _leading_partial(s: Sharding, ndim: int) -> Sharding:
    """A per-feature gradient summed over the leading (batch) dims: partial over their axes."""
    return Sharding(((),) * ndim, tuple(sorted((a, "sum") for a in s.axes())))


def _replicated_args(
    ctx: RuleContext, node: torch.fx.Node, names: Sequence[str]
) -> dict[Key, Sharding]:
    """Full copies of the tensor arguments `names` (weights, biases); an omitted or None one
    needs nothing."""
    bound = bind(node)
    return {
        name: replicated_like(ctx, bound[name])
        for name in names
        if isinstance(bound.get(name), torch.fx.Node)
    }


@rule(aten.native_layer_norm.default)
def native_layer_norm(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    nnorm = len(bound.literal("normalized_shape"))
    s = _norm_input(ctx, bound.node("input"), nnorm)
    return Decision(
        {"input": s, **_replicated_args(ctx, node, ("weight", "bias"))},
        (s, _stats(s, nnorm), _stats(s, nnorm)),
    )


@rule(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    nnorm = len(bound.literal("normalized_shape"))
    s = _norm_input(ctx, bound.node("input"), nnorm)
    stats = _stats(s, nnorm)
    inputs: dict[Key, Sharding] = {"grad_out": s, "input": s, "mean": stats, "rstd": stats}
    inputs.update(_replicated_args(ctx, node, ("weight", "bias")))
    outs: list[Sharding | None] = []
    for i, meta in enumerate(node.meta["tensor"]):
        if meta is None:
            outs.append(None)
        elif i == 0:
            outs.append(s)
        else:
            outs.append(_leading_partial(s, len(meta.shape)))
    return Decision(inputs, tuple(outs))


@rule(portable_ops.layer_norm.default)
def layer_norm(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    s = _norm_input(ctx, bound.node("x"), len(bound.literal("normalized_shape")))
    return Decision({"x": s, **_replicated_args(ctx, node, ("weight", "bias"))}, s)


@rule(portable_ops.rms_norm.default)
def rms_norm(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    s = _norm_input(ctx, bound.node("x"), len(bound.literal("normalized_shape")))
    return Decision({"x": s, **_replicated_args(ctx, node, ("weight",))}, s)


@rule(portable_ops.rms_norm_backward.default)
def rms_norm_backward(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    s = _norm_input(ctx, bound.node("x"), len(bound.literal("normalized_shape")))
    w = bound.weight
    inputs: dict[Key, Sharding] = {"grad": s, "x": s, **_replicated_args(ctx, node, ("weight",))}
    wmeta = node.meta["tensor"][1]
    dw = (
        _leading_partial(s, len(wmeta.shape))
        if isinstance(w, torch.fx.Node)
        else Sharding.replicated(len(wmeta.shape))
    )
    return Decision(inputs, (s, dw))


def _attention_sharding(
    ctx: RuleContext, q: torch.fx.Node, k: torch.fx.Node, causal: bool
) -> Sharding:
    """Batch (0) and head (1) dims may be split; head_dim stays whole, and so does the sequence
    except under context parallelism: q's tokens split over the context axis stay split (each
    rank attends with its own queries to every key) unless the op's own causal mask, aligned
    to the local rows, would be wrong (the pass gives causal attention an explicit mask first).
    GQA: k/v have fewer heads, so heads stay split only if that count divides too."""
    s = drop_partial(ctx.sh(q))
    axis = ctx.context_axis
    local_queries = axis is not None and s.dims[2] == (axis,) and not causal
    s = unshard_dims(s, [3] if local_queries else [2, 3])
    if s.dims[1]:
        factor = s.factor(ctx.mesh, 1)
        if ctx.shape(k)[1] % factor:
            s = unshard_dims(s, [1])
    return s


def _kv_sharding(s: Sharding) -> Sharding:
    """k and v split like q but for the sequence, which is whole: with q's tokens split over
    the context axis, every rank gathers all keys and values (the all-gather form of context
    parallelism)."""
    return unshard_dims(s, [2])


def _kv_gradient(s: Sharding) -> Sharding:
    """dk and dv: each rank's queries contribute to every key's gradient, so with q's tokens
    split they are partial sums over the context axis (the walker reduce-scatters them onto the
    sequence)."""
    kv = _kv_sharding(s)
    return Sharding(kv.dims, tuple((a, "sum") for a in s.dims[2]))


def _mask_sharding(
    ctx: RuleContext, mask: torch.fx.Node, s: Sharding, full: Sequence[int]
) -> Sharding:
    """The mask, aligned from the right to [batch, heads, queries, keys], split like q where it
    does not broadcast (keys whole)."""
    shape = ctx.shape(mask)
    off = len(full) - len(shape)
    dims = tuple(
        s.dims[d + off] if (d + off < 3 and shape[d] == full[d + off]) else ()
        for d in range(len(shape))
    )
    return Sharding(dims)


@rule(portable_ops.attention.default)
def attention(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    q, k, mask = bound.node("q"), bound.node("k"), bound.optional_node("mask")
    s = _attention_sharding(ctx, q, k, bool(bound.is_causal))
    kv = _kv_sharding(s)
    inputs: dict[Key, Sharding] = {"q": s, "k": kv, "v": kv}
    if mask is not None:
        inputs["mask"] = _mask_sharding(ctx, mask, s, ctx.shape(q)[:3] + ctx.shape(k)[2:3])
    return Decision(inputs, s)


@rule(portable_ops.attention_backward.default)
def attention_backward(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    q, k, mask = bound.node("q"), bound.node("k"), bound.optional_node("mask")
    s = _attention_sharding(ctx, q, k, bool(bound.is_causal))
    kv = _kv_sharding(s)
    inputs: dict[Key, Sharding] = {"grad": s, "q": s, "k": kv, "v": kv}
    if mask is not None:
        inputs["mask"] = _mask_sharding(ctx, mask, s, ctx.shape(q)[:3] + ctx.shape(k)[2:3])
    return Decision(inputs, (s, _kv_gradient(s), _kv_gradient(s)))


@rule(portable_ops.attention_backward.mask_grad)
def attention_backward_mask_grad(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """As attention_backward; dmask is split like the mask, and a partial sum over the axes
    that split dims the mask broadcasts along (its gradient is summed over them)."""
    bound = bind(node)
    q, k, mask = bound.node("q"), bound.node("k"), bound.node("mask")
    s = _attention_sharding(ctx, q, k, bool(bound.is_causal))
    kv = _kv_sharding(s)
    ms = _mask_sharding(ctx, mask, s, ctx.shape(q)[:3] + ctx.shape(k)[2:3])
    partial = tuple(sorted((a, "sum") for a in set(s.axes()) - set(ms.axes())))
    dmask = Sharding(ms.dims, partial)
    inputs: dict[Key, Sharding] = {"grad": s, "q": s, "k": kv, "v": kv, "mask": ms}
    return Decision(inputs, (s, _kv_gradient(s), _kv_gradient(s), dmask))


@rule(aten.embedding.default)
def embedding(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """A table split on the vocabulary over one axis is looked up on the shard (the walker's
    masked lookup: ids outside the shard give zeros, the result is a partial sum over the axis);
    otherwise the vocabulary dim is gathered first."""
    bound = bind(node)
    weight, indices = bound.node("weight"), bound.node("indices")
    ws = drop_partial(ctx.sh(weight))
    xs = drop_partial(ctx.sh(indices))
    used = set(xs.axes())
    if used & set(ws.dims[1]):
        ws = unshard_dims(ws, [1])
    if len(ws.dims[0]) == 1 and not used & set(ws.dims[0]) and not ws.dims[1]:
        (axis,) = ws.dims[0]
        out = Sharding(xs.dims + ((),), ((axis, "sum"),))
        return Decision({"weight": ws, "indices": xs}, out, vocab_parallel=axis)
    ws = unshard_dims(ws, [0])
    return Decision({"weight": ws, "indices": xs}, Sharding(xs.dims + (ws.dims[1],)))


@rule(aten.embedding_dense_backward.default)
def embedding_dense_backward(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """grad [*ids, hidden] scattered into the table by ids; each rank's table gradient is a
    partial sum over the axes splitting the ids' dims, the hidden dim keeps the gradient's split.

    Where only the gradient is split (ids replicated: BERT's token types expanded from a buffer,
    or a sequence-parallel gradient), slicing the ids to match costs an all-reduce of the table
    gradient (2 x table per rank, ring) instead of an all-gather of the gradient (1 x grad):
    the cheaper one is taken."""
    bound = bind(node)
    grad, indices = bound.node("grad_output"), bound.node("indices")
    xs = drop_partial(ctx.sh(indices))
    gs = drop_partial(ctx.sh(grad))
    table = int(bound.literal("num_weights")) * ctx.shape(grad)[-1]
    grad_only = Sharding(gs.dims[:-1]) if 2 * table < ctx.numel(grad) else xs
    lead = merged_dims([xs, grad_only])
    used = {a for d in lead for a in d}
    last = gs.dims[-1] if not (set(gs.dims[-1]) & used) else ()
    # the scatter-add is linear in the gradient: a gradient that is a partial sum (a position
    # table's, summed over a split batch) stays one, reduced once where it is consumed (once
    # per step under accumulation), not here
    partial = tuple(
        (a, kind) for a, kind in ctx.sh(grad).partial if kind == "sum" and a not in used
    )
    out = Sharding(((), last), tuple(sorted({(a, "sum") for a in used} | set(partial))))
    want = Sharding(lead + (last,), partial)
    return Decision({"grad_output": want, "indices": Sharding(lead)}, out)


@rule(aten.nll_loss_forward.default)
def nll_loss_forward(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """Only reduction=sum splits (the pass rewrites mean as sum / total_weight first)."""
    bound = bind(node)
    x = bound.node("self")
    if bound.reduction != 2 or isinstance(bound.weight, torch.fx.Node):
        return replicate_all(ctx, node)
    xs = unshard_dims(drop_partial(ctx.sh(x)), [len(ctx.shape(x)) - 1])
    ts = Sharding(xs.dims[:-1])
    partial = tuple(sorted((a, "sum") for a in xs.axes()))
    return Decision({"self": xs, "target": ts}, (Sharding((), partial), Sharding((), partial)))


@rule(aten.nll_loss_backward.default)
def nll_loss_backward(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    grad, x, total = bound.node("grad_output"), bound.node("self"), bound.node("total_weight")
    if isinstance(bound.weight, torch.fx.Node) or bound.reduction == 0:
        return replicate_all(ctx, node)
    xs = unshard_dims(drop_partial(ctx.sh(x)), [len(ctx.shape(x)) - 1])
    inputs: dict[Key, Sharding] = {
        "grad_output": replicated_like(ctx, grad),
        "self": xs,
        "target": Sharding(xs.dims[:-1]),
        "total_weight": replicated_like(ctx, total),
    }
    return Decision(inputs, xs)
