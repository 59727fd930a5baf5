"""`softmax-fusion`: written-out attention -> `portable::attention`, and a standalone
softmax(x * scale + mask) -> `portable::scale_mask_softmax`.

The patterns (matchers in `attention_patterns.py`, whose docstring has the full algebra):

    # softmax(q @ k^T * c + m) @ v                  -> attention(q, k, v, m, scale=c)
    # softmax(where(~b, -inf, q @ k^T * c)) @ v      -> attention(q, k, v, b, scale=c)
    # ... with k, v repeated per kv head (GQA)      -> attention(q, kv, vv, ...)  (inference)
    # backward of the above (training step):
    #   dV, dQ, dK^T bmm's around _softmax_backward_data -> attention_backward(dO, q, k, v, ...)
    #   ... and a trained mask's gradient                -> attention_backward.mask_grad(...)
    # softmax(x * c + m), not attention             -> scale_mask_softmax(x, m, c)

In a training step the forward and its backward are replaced together, so the L x L
probabilities are no longer kept for the backward (`attention_backward` recomputes them).
An existing `portable::attention` (from `F.scaled_dot_product_attention`) is counted as
`already-fused`. Counts: `attention`, `attention-backward`, `scale-mask-softmax`,
`already-fused`, the sub-patterns each match used (`scale-mul`, `scale-div`, `scale-on-q`,
`additive-mask`, `bool-mask`, `causal-tril`, `gqa-repeat`, `fp32-softmax`, `dropout-identity`) and
`near-miss` (softmaxes left as they are). `verbose=true` adds a note per softmax that is not
attention saying which condition failed (also when it became a scale_mask_softmax).
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from collections import Counter

import torch
import torch.fx
from torch.fx import Node

from portable.ir.program import Program, ProgramKind
from portable.ir.rewriter import Rewriter
from portable.ir.signature import InputKind
from portable.opset import bind

from . import attention_patterns as ap
from .base import Pass, PassResult

__all__ = ["SoftmaxFusion"]

aten = torch.ops.aten
portable = torch.ops.portable


@dataclasses.dataclass(frozen=True)
class SoftmaxFusion(Pass):
    """Fuse written-out attention (and its backward) and scale-mask-softmax (module doc).

    Options: `attention` (fuse attention), `softmax` (fuse standalone scale-mask-softmax),
    `verbose` (a note for every softmax left alone, with the reason)."""

    name = "softmax-fusion"
    attention: bool = True
    softmax: bool = True
    verbose: bool = False

    def apply(self, program: Program) -> PassResult:
        counts: Counter[str] = Counter(attention=0, **{"attention-backward": 0})
        counts["already-fused"] = sum(
            n.op == "call_function" and n.target is portable.attention.default
            for n in program.graph.nodes
        )
        training = program.kind is ProgramKind.TRAINING_STEP
        out = program.replace()
        graph = out.graph
        constants = _scalar_constants(out)
        notes: list[str] = []
        changed = False
        for node in list(graph.nodes):
            if node.graph is not graph or not ap.is_op(node, ap.SOFTMAX) or not node.users:
                continue
            why = "attention fusion disabled (attention=false)"
            if self.attention:
                found = ap.match_attention(node, training, constants)
                if isinstance(found, ap.Attention):
                    _rewrite_attention(graph, found)
                    counts["attention"] += 1
                    counts["attention-backward"] += found.backward is not None
                    counts.update(found.tags)
                    changed = True
                    continue
                why = found.why
            where = f"softmax %{node.name} ({_where(node)})"
            if self.softmax and _rewrite_scale_mask(graph, node, counts, constants):
                changed = True
                if self.verbose and self.attention:
                    notes.append(f"{where} fused as scale_mask_softmax, not attention: {why}")
                continue
            counts["near-miss"] += 1
            if self.verbose:
                notes.append(f"{where} not fused: {why}")
        counts = Counter({k: v for k, v in counts.items() if v or k in _ALWAYS})
        if not changed:
            return PassResult(program, self.report(False, dict(counts), notes))
        graph.lint()
        out.graph_module.recompile()
        return PassResult(out, self.report(True, dict(counts), notes))


_ALWAYS = ("attention", "attention-backward", "scale-mask-softmax", "already-fused")


def _scalar_constants(program: Program) -> dict[Node, float]:
    """The program's one-element constant inputs (a lifted `torch.tensor(-inf)` fill) by
    placeholder, with their values."""
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
    found = {}
    for node, spec in zip(placeholders, program.signature.inputs, strict=True):
        value = program.weights.get(spec.key) if spec.kind is InputKind.CONSTANT else None
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            found[node] = float(value.item())
    return found


def _where(node: Node) -> str:
    source = node.meta.get("source")
    return str(source) if source is not None else "no source"


# ---- attention -----------------------------------------------------------------------------


def _rewrite_attention(graph: torch.fx.Graph, m: ap.Attention) -> None:
    # softmax(q @ k^T * c + m) @ v -> attention(q, k, v, m, scale=c); the backward's bmm's
    # (dV, dQ, dK^T) -> attention_backward(dO, q, k, v, m, scale=c)
    r = Rewriter(graph)
    like = m.softmax
    with graph.inserting_before(m.out3):
        k = _operand(graph, m.k, like=like)
        if m.k_perm is not None:
            k = r.call(aten.permute.default, (k, m.k_perm), like=like)
        mask = _mask(graph, m.masks, m.negate, like=like)
        q, v = _operand(graph, m.q, like=like), _operand(graph, m.v, like=like)
        args = (q, k, v, mask, m.is_causal, m.scale)
        att = _row_major(graph, r.call(portable.attention.default, args, like=like), like=like)
    dead = [m.out3]
    _replace_batched(graph, m.out3, att, like=like)
    if m.backward is not None:
        dead += _rewrite_backward(graph, m, args, like=like)
    for node in dead:
        r.erase_dead(node)


def _rewrite_backward(graph: torch.fx.Graph, m: ap.Attention, args: tuple, like: Node) -> list:
    # the backward's bmm's (dV, dQ, dK^T) -> attention_backward(dO, q, k, v, m, scale=c); with a
    # trainable mask, attention_backward.mask_grad(dO, q, k, v, expand(m, [B, H, Lq, Lk]), ...)
    # whose dmask is the score gradient the mask's own gradient reads
    r = Rewriter(graph)
    bw = typing.cast(ap.Backward, m.backward)
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = list(bw.d_scores.users) if bw.d_scores is not None else []
    first = min((bw.dq3, bw.dkt3, bw.dv3, *readers), key=order.__getitem__)
    with graph.inserting_before(first):
        d_out = ap.logical(bw.d_out3, m.out_shape)
        if d_out is None:
            d_out = r.call(aten.reshape.default, (bw.d_out3, list(m.out_shape)), like=like)
        if bw.d_scores is None:
            grads = r.call(portable.attention_backward.default, (d_out, *args), like=like)
        else:
            full = [*m.out_shape[:3], ap.shape(m.softmax)[-1]]
            mask = r.call(aten.expand.default, (args[3], full), like=like)
            args = (*args[:3], mask, *args[4:])
            grads = r.call(portable.attention_backward.mask_grad, (d_out, *args), like=like)
        dq, dk, dv = (r.call(operator.getitem, (grads, i), like=like) for i in range(3))
        # dK^T in the bmm's (contiguous) layout: the graph's views of it need that layout
        dkt = r.call(aten.transpose.int, (dk, -2, -1), like=like)
        dkt = r.call(aten.clone.default, (dkt,), _CONTIGUOUS, like=like)
        if bw.d_scores is not None:
            bw.d_scores.replace_all_uses_with(r.call(operator.getitem, (grads, 3), like=like))
    _replace_batched(graph, bw.dq3, dq, like=like)
    _replace_batched(graph, bw.dv3, dv, like=like)
    _replace_batched(graph, bw.dkt3, dkt, like=like)
    return [bw.dq3, bw.dv3, bw.dkt3, dkt, bw.d_scores]


def _operand(graph: torch.fx.Graph, x: Node | ap.Flat, like: Node) -> Node:
    # Flat(x3, [B, H, L, D]) -> reshape(x3, [B, H, L, D])
    r = Rewriter(graph)
    if isinstance(x, Node):
        return x
    return r.call(aten.reshape.default, (x.node, list(x.shape)), like=like)


def _mask(graph: torch.fx.Graph, masks: list[Node], negate: bool, like: Node) -> Node | None:
    # [m1, m2, ...] (additive, in the order added) -> m1 + m2 + ... ;  ~b when negated
    r = Rewriter(graph)
    if not masks:
        return None
    mask = masks[0]
    for more in masks[1:]:
        mask = r.call(aten.add.Tensor, (mask, more), like=like)
    return r.call(aten.bitwise_not.default, (mask,), like=like) if negate else mask


def _row_major(graph: torch.fx.Graph, att: Node, like: Node) -> Node:
    """`att` in the row-major layout of the bmm it replaces, which later views may rely on
    (attention's own layout follows q's when SDPA would take its fused kernel)."""
    r = Rewriter(graph)
    val = att.meta["val"]
    if val.is_contiguous():
        return att
    return r.call(aten.clone.default, (att,), _CONTIGUOUS, like=like)


def _replace_batched(graph: torch.fx.Graph, old3: Node, new: Node, like: Node) -> None:
    """Make `old3` ([B*H, L, D], a bmm) `new` ([B, H, L, D]) flattened: its reshapes back to
    [B, H, L, D] become `new`, other users get reshape(new, [B*H, L, D])."""
    r = Rewriter(graph)
    for user in list(old3.users):
        if ap.is_op(user, ap.RESHAPES) and ap.shape(user) == ap.shape(new):
            user.replace_all_uses_with(new)
            graph.erase_node(user)
    if old3.users:
        with graph.inserting_before(next(iter(old3.users))):
            flat = r.call(aten.reshape.default, (new, list(ap.shape(old3))), like=like)
        old3.replace_all_uses_with(flat)


# ---- scale-mask-softmax --------------------------------------------------------------------


def _rewrite_scale_mask(
    graph: torch.fx.Graph, softmax: Node, counts: Counter[str], constants: dict[Node, float]
) -> bool:
    # softmax(x * c + m, dim) -> scale_mask_softmax(x, m, c, dim)   (m after the scale)
    r = Rewriter(graph)
    sm = ap.match_scale_mask(softmax, constants)
    if isinstance(sm, ap.Miss) or (sm.mask is None and sm.scale == 1.0):
        return False
    if not ap.is_finite_scale(sm.scale):
        return False
    x_shape = ap.shape(sm.x)
    if sm.masks:
        try:
            fits = torch.broadcast_shapes(x_shape, *(ap.shape(m) for m in sm.masks)) == x_shape
        except (RuntimeError, TypeError):  # TypeError: symbolic dims, not decided here
            fits = False
        if not fits:
            return False
    if ap.shape(softmax) != x_shape or softmax.meta["tensor"].dtype != sm.x.meta["tensor"].dtype:
        return False
    with graph.inserting_before(softmax):
        mask = _mask(graph, sm.masks, sm.negate, softmax)
        dim = typing.cast(int, bind(softmax).dim)
        fused = r.call(
            portable.scale_mask_softmax.default, (sm.x, mask, sm.scale, dim), like=softmax
        )
    softmax.replace_all_uses_with(fused)
    r.erase_dead(softmax)
    counts["scale-mask-softmax"] += 1
    return True


_CONTIGUOUS = {"memory_format": torch.contiguous_format}
