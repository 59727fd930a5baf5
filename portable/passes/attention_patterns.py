"""Matchers for attention as captured (decomposed) graphs write it; used by `softmax-fusion`.

Each matcher reads the graph and returns a description of what it found, or a `Miss` that says
why not (the near-miss notes of `softmax-fusion{verbose=true}`); none of them changes the graph.
The shapes below are those of 4-D attention, [B, H, L, D]; `~>` is a chain of reshapes, clones
and same-shape expands (value-preserving, so the 3-D bmm operand is the 4-D tensor flattened):

    # scores:  S = view(bmm(q ~> [B*H, Lq, D], kt ~> [B*H, D, Lk]), [B, H, Lq, Lk])
    #          kt = transpose(k, -2, -1) | permute(k', p)         (k = k^T^T)
    #          (or S = S' ~> with views, unsqueezes and size-1 permutes that keep the element
    #          order: einsum's spelling; element_order.py)
    # chain:   s = S | s * c | s / c | s + m | where(c, fill, s) | where(c, s, fill)
    #              | _to_copy(s) | clone(s)                          (walked from softmax back)
    #          softmax(S * c + m) -- the mask after the scale; fill <= -1e30 (or -inf), a number,
    #          a 0-d tensor or a program constant; s + m1 + m2 => mask m1 + m2 (T5)
    # probs:   P = _softmax(s, -1) ~> _to_copy / clone (dropout p=0) ~> P3 [B*H, Lq, Lk]
    # output:  O = view(bmm(P3, v ~> [B*H, Lk, D]), [B, H, Lq, D])
    #          => O = attention(q, k, v, mask, scale=c)
    #          (an operand with no [B, H, L, D] value in the graph: reshape(x3, [B, H, L, D]))
    # GQA:     k = _unsafe_view(clone(expand(unsqueeze(kv, 2), [B, Hkv, n, L, D])), [B, H, L, D])
    #          (repeat_kv / repeat_interleave) => attention(q, kv, ...) (heads repeat inside)
    # q scale: q = q' * c  => attention(q', ..., scale=scale * c)
    # causal:  bool mask tril(full([Lq, Lk], True)) => attention(..., is_causal=True)

In a training step the backward of that chain is matched from the forward's saved values:

    # dV3 = bmm(transpose(P3, 1, 2), dO3)      dP3 = bmm(dO3, transpose(V3, 1, 2))
    # dS  = _softmax_backward_data(dP ~> , P) ~> where(c, 0, .) / * c / casts ~> dS3
    # dQ3 = bmm(dS3, transpose(Kt3, 1, 2))     dKt3 = bmm(transpose(Q3, 1, 2), dS3)
    #          => (dq, dk, dv) = attention_backward(dO, q, k, v, mask, scale=c)
    # trained additive mask: dS (before the scale is undone) also feeds the mask's gradient
    #          => (dq, dk, dv, dS) = attention_backward.mask_grad(dO, q, k, v,
    #                                   expand(mask, [B, H, Lq, Lk]), scale=c)
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any

import torch
from torch.fx import Node

from portable.opset import bind
from portable.opset.table import CAST, IDENTITY, RESHAPE, ops_with

from . import element_order

__all__ = [
    "Attention",
    "Backward",
    "Flat",
    "Miss",
    "ScaleMask",
    "match_attention",
    "match_scale_mask",
]

aten = torch.ops.aten

RESHAPES = ops_with(RESHAPE)
THROUGH = RESHAPES | ops_with(IDENTITY) | {aten.expand.default}
CASTS = ops_with(CAST)
MUL = frozenset({aten.mul.Tensor, aten.mul.Scalar})
DIV = frozenset({aten.div.Tensor, aten.div.Scalar})
ADD = frozenset({aten.add.Tensor})
WHERE = frozenset({aten.where.self})
SOFTMAX = aten._softmax.default
SOFTMAX_BACKWARD = aten._softmax_backward_data.default
BMM = aten.bmm.default
CONSTANTS = frozenset({aten.scalar_tensor.default, aten.full.default})
_COPIES = ops_with(IDENTITY)
# a fill at or below this is a mask: exp(fill - max) is 0 in every float format
MASK_FILL = -1e30


@dataclasses.dataclass(frozen=True)
class Miss:
    """Why a softmax is not attention (or not a scale-mask-softmax)."""

    why: str


@dataclasses.dataclass
class ScaleMask:
    """softmax(x * scale + mask) as found walking back from the softmax: `x` is the unscaled
    input, `mask` a float (added) or bool (kept where True) tensor, `negate` when the kept
    positions are `~mask`; `chain` the nodes between x and the softmax."""

    x: Node
    scale: float = 1.0
    mask: Node | None = None
    negate: bool = False
    chain: list[Node] = dataclasses.field(default_factory=list)
    tags: list[str] = dataclasses.field(default_factory=list)
    more_masks: list[Node] = dataclasses.field(default_factory=list)  # added before `mask`
    stopped: str | None = None  # why the walk stopped at `x`, when that is worth saying

    @property
    def masks(self) -> list[Node]:
        """Every additive mask, in the order the graph adds them (their sum is the mask)."""
        return [*reversed(self.more_masks), *([self.mask] if self.mask is not None else [])]


@dataclasses.dataclass
class Backward:
    """The training-step backward of one attention: the gradient in (`d_out3`, 3-D) and the
    gradient bmm's that the rewrite replaces."""

    d_out3: Node
    dq3: Node
    dkt3: Node
    dv3: Node
    # the score gradient d(q @ k^T * c + m) that a trainable mask's gradient also reads
    d_scores: Node | None = None


@dataclasses.dataclass(frozen=True)
class Flat:
    """reshape(node, shape): a [B*H, L, D] bmm operand unflattened, where the graph holds no
    [B, H, L, D] value of it (einsum's spellings); the rewrite creates the reshape."""

    node: Node
    shape: tuple[Any, ...]


@dataclasses.dataclass
class Attention:
    softmax: Node
    out3: Node  # the output bmm, [B*H, Lq, D]
    q: Node | Flat
    k: Node | Flat
    v: Node | Flat
    k_perm: list[int] | None  # k = permute(kt's source, k_perm) when kt is not transpose(k)
    scale: float
    mask: Node | None
    negate: bool
    out_shape: tuple[int, ...]
    tags: list[str]
    backward: Backward | None = None
    is_causal: bool = False
    more_masks: list[Node] = dataclasses.field(default_factory=list)  # see ScaleMask

    @property
    def masks(self) -> list[Node]:
        return [*reversed(self.more_masks), *([self.mask] if self.mask is not None else [])]


# ---- small helpers -------------------------------------------------------------------------


def is_op(value: Any, targets: frozenset | Any) -> bool:
    if not isinstance(value, Node) or value.op != "call_function":
        return False
    return value.target in targets if isinstance(targets, frozenset) else value.target is targets


def shape(node: Node) -> tuple[Any, ...]:
    return tuple(node.meta["tensor"].shape)


def operand(node: Node, name: str) -> Node:
    """The argument `name` of `node` (see `bind`), as the tensor operand the patterns expect."""
    return typing.cast(Node, bind(node)[name])


def constant(value: Any, constants: Mapping[Node, float] | None = None) -> float | None:
    """A Python number, a 0-d `scalar_tensor(c)` / `full([], c)`, or a program constant in
    `constants` (a lifted `torch.tensor(c)`): its value; else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    source = value
    while is_op(source, _COPIES):
        source = operand(typing.cast(Node, source), "self")
    if constants and isinstance(source, Node) and source in constants:
        return constants[source]
    if is_op(value, CONSTANTS):
        node = typing.cast(Node, value)
        is_full = node.target is aten.full.default
        if is_full and list(typing.cast(list, bind(node).size)):
            return None
        c = bind(node).fill_value if is_full else bind(node).s
        if isinstance(c, (int, float)) and not isinstance(c, bool):
            return float(c)
    return None


def dtype_only_cast(node: Node) -> bool:
    allowed = {"dtype", "layout", "device", "memory_format"}
    return is_op(node, CASTS) and set(node.kwargs) <= allowed and len(node.args) == 1


def logical(node: Node, want: tuple[Any, ...]) -> Node | None:
    """The tensor of shape `want` that `node` is a flattening of (`~>` in the module doc): the
    first one of that shape up the chain (past clones and same-shape expands)."""
    found = None
    while True:
        if shape(node) == want:
            found = node
        if not is_op(node, THROUGH):
            return found
        if node.target is aten.expand.default and shape(operand(node, "self")) != shape(node):
            return found
        node = operand(node, "self")


def transpose_of(node: Node, rank: int) -> Node | None:
    """x when `node` is transpose(x, a, b) swapping the last two dims (3-D batched matmul)."""
    if is_op(node, aten.transpose.int):
        dims = {typing.cast(int, d) % rank for d in (bind(node).dim0, bind(node).dim1)}
        if dims == {rank - 2, rank - 1}:
            return operand(node, "self")
    return None


def _single_user(node: Node, nxt: Node) -> bool:
    return set(node.users) == {nxt}


# ---- scale and mask ------------------------------------------------------------------------


def match_scale_mask(
    softmax: Node, constants: Mapping[Node, float] | None = None
) -> ScaleMask | Miss:
    """softmax(x * c + m): walk back from the softmax through masks, scales and casts.
    `constants`: the program's 0-d constants by placeholder (fills written as tensors)."""
    if bind(softmax).half_to_float:
        return Miss("softmax with half_to_float=True")
    found = ScaleMask(x=operand(softmax, "self"))
    node, nxt = found.x, softmax
    scaled = False
    while True:
        if not _single_user(node, nxt):
            break  # used elsewhere too: the chain stops here
        if dtype_only_cast(node) or is_op(node, aten.clone.default):
            if dtype_only_cast(node):
                found.tags.append("fp32-softmax")
        elif is_op(node, MUL | DIV) and constant(bind(node).other, constants) is not None:
            c = typing.cast(float, constant(bind(node).other, constants))
            found.scale *= c if node.target in MUL else 1.0 / c
            found.tags.append("scale-mul" if node.target in MUL else "scale-div")
            scaled = True
        elif is_op(node, ADD) and _additive_slot(found) and not _has_alpha(node):
            a, b = operand(node, "self"), operand(node, "other")
            cont, mask = (b, a) if _scores_side(b) and not _scores_side(a) else (a, b)
            if not isinstance(mask, Node) or not isinstance(cont, Node):
                break
            if scaled:
                return Miss(f"%{node.name}: mask added before the scale ((s + m) * c)")
            if found.mask is None:
                found.mask, found.negate = mask, False
            else:  # s + m1 + m2 (T5: position bias, then the padding mask): mask m1 + m2
                found.more_masks.append(mask)
            found.tags.append("additive-mask")
            found.chain.append(node)
            nxt, node = node, cont
            continue
        elif is_op(node, ADD) and found.mask is not None and not _additive_slot(found):
            return Miss(f"%{node.name}: an additive mask together with a bool mask")
        elif is_op(node, WHERE):
            where = bind(node)
            cond, a, b = where.condition, where.self, where.other
            fill_a, fill_b = constant(a, constants), constant(b, constants)
            if fill_a is not None and fill_a <= MASK_FILL and isinstance(b, Node):
                mask, negate, cont = cond, True, b  # where(c, -inf, s): keep ~c
            elif fill_b is not None and fill_b <= MASK_FILL and isinstance(a, Node):
                mask, negate, cont = cond, False, a  # where(c, s, -inf): keep c
            else:
                found.stopped = _where_miss(node, fill_a, fill_b)
                break
            if scaled:
                return Miss(f"%{node.name}: mask applied before the scale")
            if found.mask is not None:
                return Miss(f"%{node.name}: a bool mask together with an additive mask")
            if is_op(mask, aten.bitwise_not.default) or is_op(mask, aten.logical_not.default):
                mask, negate = operand(mask, "self"), not negate
            found.mask, found.negate = mask, negate
            found.tags.append("bool-mask")
            found.chain.append(node)
            nxt, node = node, cont
            continue
        else:
            break
        found.chain.append(node)
        nxt, node = node, operand(node, "self")
    found.x = node
    return found


def _where_miss(node: Node, fill_a: float | None, fill_b: float | None) -> str:
    fills = [f for f in (fill_a, fill_b) if f is not None]
    if not fills:
        return f"%{node.name}: where(c, a, b) with no constant fill (a mask fills -inf)"
    return f"%{node.name}: where fills {fills[0]:g}, not a mask fill (<= {MASK_FILL:g})"


def _additive_slot(found: ScaleMask) -> bool:
    """Whether another additive mask can join `found` (no bool mask found)."""
    return "bool-mask" not in found.tags


def _has_alpha(node: Node) -> bool:
    return bind(node).get("alpha") != 1


def _scores_side(value: Any) -> bool:
    """Whether `value` leads back (through the scale/cast chain) to a bmm: the scores."""
    for _ in range(8):
        if not isinstance(value, Node):
            return False
        if is_op(value, BMM):
            return True
        if not is_op(value, THROUGH | CASTS | MUL | DIV):
            return False
        value = bind(value).self
    return False


# ---- attention -----------------------------------------------------------------------------


def match_attention(
    softmax: Node, training: bool, constants: Mapping[Node, float] | None = None
) -> Attention | Miss:
    """softmax(q @ k^T * c + m) @ v around `softmax` (see the module doc)."""
    sm = match_scale_mask(softmax, constants)
    if isinstance(sm, Miss):
        return sm
    scores = sm.x
    if len(shape(scores)) != 4:
        return Miss(f"scores %{scores.name} are {len(shape(scores))}-D, not [B, H, Lq, Lk]")
    bmm_s = _scores_bmm(scores, sm)
    if isinstance(bmm_s, Miss):
        return bmm_s
    dim = typing.cast(int, bind(softmax).dim) % 4
    if dim != 3:
        return Miss(f"softmax over dim {bind(softmax).dim}, not the keys (dim -1)")
    b, h, lq, lk = shape(scores)
    q3, kt3 = operand(bmm_s, "self"), operand(bmm_s, "mat2")
    d = shape(q3)[-1]
    q = _operand(q3, (b, h, lq, d))
    kt = logical(kt3, (b, h, d, lk))
    k: Node | Flat | None = transpose_of(kt, 4) if kt is not None else None
    k_perm: list[int] | None = None
    if k is None and is_op(kt, aten.permute.default):
        perm = list(typing.cast(list, bind(typing.cast(Node, kt)).dims))
        k_perm = perm[:2] + [perm[3], perm[2]]
        k = operand(typing.cast(Node, kt), "self")
    if k is None:  # k^T computed some other way (einsum): k = permute(k^T, [0, 1, 3, 2])
        k, k_perm = (kt if kt is not None else Flat(kt3, (b, h, d, lk))), [0, 1, 3, 2]
    probs = _probs(softmax, training)
    if isinstance(probs, Miss):
        return probs
    p3, out3, tags = probs
    v3 = operand(out3, "mat2")
    dv = shape(v3)[-1]
    v = _operand(v3, (b, h, lk, dv))
    found = Attention(
        softmax,
        out3,
        q,
        k,
        v,
        k_perm,
        sm.scale,
        sm.mask,
        sm.negate,
        (b, h, lq, dv),
        sm.tags + tags,
        more_masks=list(sm.more_masks),
    )
    if sm.mask is not None and not sm.more_masks and not sm.negate and _causal(sm.mask, lq, lk):
        found.mask, found.is_causal = None, True  # tril(ones(Lq, Lk)) keeps j <= i: causal
        found.tags.append("causal-tril")
    sbd = [u for u in softmax.users if is_op(u, SOFTMAX_BACKWARD)]
    if sbd:
        bwd = _backward(sbd, sm, p3, q3, kt3, v3)
        if isinstance(bwd, Miss):
            return bwd
        found.backward = bwd
    elif training is False:
        _peel_inference(found)
    return found


def _scores_bmm(scores: Node, sm: ScaleMask) -> Node | Miss:
    """The bmm whose [B*H, Lq, Lk] result `scores` is, unflattened (through views, unsqueezes
    and permutes of size-1 dims that keep the element order: einsum's spelling)."""
    chain = element_order.layout_chain(scores, lambda n: is_op(n, BMM))
    if isinstance(chain, str):
        why = sm.stopped or f"it reaches {chain}"
        return Miss(f"softmax input %{scores.name} is not a batched matmul q @ k^T: {why}")
    if len(chain) == 1:
        return Miss(f"softmax input %{scores.name} is the 3-D bmm itself, not [B, H, Lq, Lk]")
    if not element_order.keeps_order(chain):
        return Miss(f"scores %{scores.name} reorder the elements of bmm %{chain[0].name}")
    return chain[0]


def _operand(x3: Node, want: tuple[Any, ...]) -> Node | Flat:
    """The [B, H, L, D] value that bmm operand `x3` flattens: a node of the graph when there is
    one (see `logical`), else reshape(x3, want), created by the rewrite."""
    found = logical(x3, want)
    return found if found is not None else Flat(x3, want)


def _causal(mask: Node, lq: int, lk: int) -> bool:
    """mask = tril(full([Lq, Lk], True)): the top-left causal mask."""
    if not is_op(mask, aten.tril.default) or bind(mask).diagonal != 0:
        return False
    full = operand(mask, "self")
    return (
        is_op(full, aten.full.default)
        and list(typing.cast(list, bind(full).size)) == [lq, lk]
        and bind(full).fill_value is True
    )


def _probs(softmax: Node, training: bool) -> tuple[Node, Node, list[str]] | Miss:
    """(P3, the output bmm, tags): softmax ~> P3 with bmm(P3, v3) among P3's users; `~>` here
    also passes permutes of size-1 dims and unsqueezes that keep the element order."""
    node, chain = softmax, [softmax]
    tags: list[str] = []
    for _ in range(12):
        forward = [u for u in node.users if not is_op(u, SOFTMAX_BACKWARD)]
        out = [u for u in forward if is_op(u, BMM) and bind(u).self is node]
        if out and len(shape(node)) == 3:
            others = [u for u in forward if u is not out[0] and not _bwd_transpose(u)]
            if others or len(out) != 1:
                return Miss(f"probabilities %{node.name} are used elsewhere too")
            if not element_order.keeps_order(chain):
                return Miss(f"bmm operand %{node.name} reorders the probabilities")
            return node, out[0], tags
        layout = is_op(forward[0], element_order.LAYOUT_OPS) if len(forward) == 1 else False
        if not (layout or len(forward) == 1 and dtype_only_cast(forward[0])):
            names = ", ".join(f"%{u.name}" for u in forward) or "nothing"
            return Miss(f"probabilities %{node.name} go to {names}, not a matmul with v")
        if node is not softmax and len(node.users) != 1:
            return Miss(f"probabilities %{node.name} are used elsewhere too")
        nxt = forward[0]
        if is_op(nxt, aten.clone.default) and len(shape(nxt)) == 4:
            tags.append("dropout-identity")
        elif dtype_only_cast(nxt):
            tags.append("fp32-softmax")
        node = nxt
        chain.append(node)
    return Miss(f"no matmul with v after %{softmax.name}")


def _bwd_transpose(node: Node) -> bool:
    return transpose_of(node, 3) is not None and len(shape(node)) == 3


def _peel_inference(found: Attention) -> None:
    """Fold a scale on q or k and undo key/value repetition (GQA) into the attention op."""
    for side in ("q", "k"):
        x = getattr(found, side)
        if is_op(x, MUL | DIV) and constant(bind(x).other) is not None and len(x.users) == 1:
            c = typing.cast(float, constant(bind(x).other))
            if shape(operand(x, "self")) == shape(x) and found.k_perm is None:
                found.scale *= c if x.target in MUL else 1.0 / c
                setattr(found, side, operand(x, "self"))
                found.tags.append(f"scale-on-{side}")
    if found.k_perm is None:
        k, v = _unrepeat(found.k), _unrepeat(found.v)
        if k is not None and v is not None and shape(k)[1] == shape(v)[1]:
            found.k, found.v = k, v
            found.tags.append("gqa-repeat")


def _unrepeat(x: Node | Flat) -> Node | None:
    """kv for x = reshape(clone(expand(unsqueeze(kv, 2), [B, Hkv, n, L, D])), [B, Hkv*n, L, D])."""
    if not isinstance(x, Node) or not is_op(x, RESHAPES):
        return None
    e = operand(x, "self")
    while is_op(e, aten.clone.default):
        e = operand(e, "self")
    if not is_op(e, aten.expand.default) or len(shape(e)) != 5:
        return None
    u = operand(e, "self")
    b, hkv, n, length, d = shape(e)
    if shape(u) != (b, hkv, 1, length, d) or shape(x) != (b, hkv * n, length, d):
        return None
    if is_op(u, aten.unsqueeze.default) and typing.cast(int, bind(u).dim) % 5 == 2:
        return operand(u, "self")
    if is_op(u, RESHAPES) and shape(operand(u, "self")) == (b, hkv, length, d):
        return operand(u, "self")
    return None


# ---- training backward ---------------------------------------------------------------------


def _backward(
    sbd: list[Node], sm: ScaleMask, p3: Node, q3: Node, kt3: Node, v3: Node
) -> Backward | Miss:
    if len(sbd) != 1:
        return Miss("the probabilities have several softmax backward users")
    grad_in = sbd[0]
    dv3 = _bwd_bmm(p3, lhs=True)
    if dv3 is None:
        return Miss(f"no dV = P^T @ dO for %{p3.name} in the backward")
    d_out3 = operand(dv3, "mat2")
    dp3 = _bwd_bmm(v3, lhs=False)
    if dp3 is None or bind(dp3).self is not d_out3:
        return Miss(f"no dP = dO @ V^T for %{v3.name} in the backward")
    node = operand(grad_in, "grad_output")
    for _ in range(8):
        if node is dp3:
            break
        if not (is_op(node, THROUGH) or dtype_only_cast(node)):
            return Miss(f"softmax backward input %{node.name} is not dO @ V^T")
        node = operand(node, "self")
    else:
        return Miss("softmax backward input is not dO @ V^T")
    dkt3, dq3 = _bwd_bmm(q3, lhs=True), _bwd_bmm(kt3, lhs=False)
    if dkt3 is None or dq3 is None or bind(dkt3).mat2 is not bind(dq3).self:
        return Miss("no dQ / dK bmm's sharing one score gradient in the backward")
    ds3 = operand(dq3, "self")
    return _score_gradient(grad_in, ds3, sm, Backward(d_out3, dq3, dkt3, dv3))


_SCORE_GRAD_STEPS = 10


def _score_gradient(grad_in: Node, ds3: Node, sm: ScaleMask, found: Backward) -> Backward | Miss:
    """Walk sbd ~> where(c, 0, .) / * c / casts ~> dS3. A trainable additive mask reads the
    score gradient where it branches off, before the scale is undone: `found.d_scores`."""
    node, undone = grad_in, False
    for _ in range(_SCORE_GRAD_STEPS):
        if node is ds3:
            return found
        path = [u for u in node.users if _leads_to(u, ds3)]
        if len(path) != 1:
            (user, *_) = node.users
            if len(node.users) == 1:
                return Miss(f"score gradient goes through %{user.name} ({user.target})")
            return Miss(f"score gradient %{node.name} does not reach the dQ / dK bmm's once")
        if len(node.users) > 1:
            why = _mask_gradient_miss(node, sm, undone, found)
            if why:
                return Miss(why)
            found.d_scores = node
        node = path[0]
        undone = undone or is_op(node, MUL | DIV | WHERE)
    return Miss("score gradient does not reach the dQ / dK bmm's")


def _leads_to(node: Node, ds3: Node) -> bool:
    for _ in range(_SCORE_GRAD_STEPS):
        if node is ds3:
            return True
        ok = is_op(node, THROUGH) or dtype_only_cast(node) or is_op(node, MUL | DIV | WHERE)
        if not ok or len(node.users) != 1:
            return False
        node = next(iter(node.users))
    return False


def _mask_gradient_miss(node: Node, sm: ScaleMask, undone: bool, found: Backward) -> str | None:
    """Why the other users of score gradient `node` are not a mask's gradient we can give."""
    if found.d_scores is not None or undone or not sm.masks or "bool-mask" in sm.tags:
        return f"score gradient %{node.name} is used elsewhere too (not an additive mask's)"
    spec = node.meta["tensor"]
    dtypes = {m.meta["tensor"].dtype for m in sm.masks}
    if tuple(spec.shape) != shape(sm.x) or dtypes != {spec.dtype}:
        names = ", ".join(str(d) for d in sorted(dtypes, key=str))
        return f"score gradient %{node.name} is {spec.dtype}, the masks {names}"
    return None


def _bwd_bmm(saved: Node, lhs: bool) -> Node | None:
    """The bmm that takes transpose(saved, 1, 2) as its left (`lhs`) or right operand."""
    for t in saved.users:
        if transpose_of(t, 3) is not saved:
            continue
        for u in t.users:
            if is_op(u, BMM) and bind(u)["self" if lhs else "mat2"] is t:
                return u
    return None


def is_finite_scale(scale: float) -> bool:
    return math.isfinite(scale) and scale != 0.0
