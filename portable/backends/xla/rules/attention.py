"""`portable::attention` and `attention_backward`: plain softmax, or blockwise for long keys.

Semantics are those of the CPU kernels in `portable/opset/nn_ops.py`: softmax(q @ k^T * scale +
mask) @ v with scale defaulting to 1/sqrt(head_dim); a bool mask keeps True positions, a float
mask is added; `is_causal` is top-left aligned (query i sees keys j <= i), also together with a
mask; kv heads repeat for grouped-query attention. Half inputs compute in float32 (opmath).

Two forms, chosen from the static key length Lk:

- Lk <= BLOCK (512): the plain form, softmax over the whole [Lq, Lk] score matrix; its backward
  is `jax.vjp` of it (GQA gradients sum over the repeated heads).
- Lk > BLOCK: FlashAttention-2 style, so no [Lq, Lk] intermediate exists in the HLO. Queries are
  cut into blocks of BLOCK rows and keys into blocks of BLOCK columns (a shorter last block of each
  is processed after the loop, with static shapes, so nothing is padded). For each query block
  the forward sweeps the key blocks with an online softmax, carrying the running row maximum m,
  row sum l and accumulator acc:
      s = q_i @ k_j^T * scale + mask_ij;  m' = max(m, rowmax s);  p = exp(s - m')
      l = l * exp(m - m') + rowsum p;     acc = acc * exp(m - m') + p @ v_j
  and ends with out_i = acc / l and the row logsumexp lse_i = m + log l. The backward recomputes
  the forward for (out, lse), then sweeps key blocks (outer) and query blocks (inner):
      p = exp(s - lse_i);  dv_j += p^T @ do_i;  ds = p * (do_i @ v_j^T - rowsum(do_i * out_i))
      dq_i += ds @ k_j * scale;  dk_j += ds^T @ q_i * scale
  Loops are `lax.while_loop`s on an int32 counter from 0 to a constant, the counted-loop form
  neuronx-cc needs (constant trip count) and the neuron validator recognises; never
  differentiated by JAX (the backward above is explicit). The largest intermediate is a
  [..., H, BLOCK, BLOCK] tile. A fully masked query row gives 0 (and zero gradients), as the
  CPU kernel does; the plain form gives NaN there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from . import RULES
from ._util import PRECISION, opmath, out_dtype

__all__ = ["BLOCK", "attention", "attention_blockwise", "attention_blockwise_backward"]

BLOCK = 512  # query rows and key columns per tile of the blockwise form


# --------------------------------------------------------------------------- plain form


def _expand_kv(q, t):
    """GQA: kv head j serves q heads j * group ... (j + 1) * group - 1."""
    hq, hk = q.shape[-3], t.shape[-3]
    return t if hq == hk else jnp.repeat(t, hq // hk, axis=-3)


def _einsum(spec: str, a: jax.Array, b: jax.Array, compute: DTypeLike) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=PRECISION, preferred_element_type=compute)


def attention(q, k, v, mask=None, is_causal=False, scale=None):
    """The reference attention on JAX arrays, in q's dtype (computed in opmath)."""
    dtype = q.dtype
    compute = opmath(dtype)
    k, v = _expand_kv(q, k), _expand_kv(q, v)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = _einsum("...qd,...kd->...qk", q.astype(compute), k.astype(compute), compute)
    scores = scores * jnp.asarray(scale, compute)
    minus_inf = jnp.asarray(-jnp.inf, compute)  # typed: a bare Python float is float64 under x64
    if mask is not None:
        if mask.dtype == jnp.bool_:
            scores = jnp.where(mask, scores, minus_inf)
        else:
            scores = scores + mask.astype(dtype).astype(compute)
    if is_causal:
        lq, lk = scores.shape[-2:]
        keep = jnp.tril(jnp.ones((lq, lk), jnp.bool_))
        scores = jnp.where(keep, scores, minus_inf)
    # a row whose every key is masked gives 0, as the CPU kernel does (softmax alone gives NaN);
    # the inner where keeps its gradient finite
    dead = jnp.isneginf(jnp.max(scores, axis=-1, keepdims=True))
    probs = jnp.where(dead, 0, jax.nn.softmax(jnp.where(dead, 0, scores), axis=-1))
    out = _einsum("...qk,...kd->...qd", probs, v.astype(compute), compute)
    return out.astype(dtype)


# --------------------------------------------------------------------------- blockwise form


# a loop carry is a pytree of arrays (its structure is the body's business)
Carry = Any


def _sweep(
    n: int, block: int, body: Callable[[ArrayLike, int, Carry], Carry], carry: Carry
) -> Carry:
    """body(start, size, carry) over [0, n) in blocks: a counted loop over the full blocks, then
    the shorter last block (static size) if n is not a multiple of `block`."""
    full, rest = divmod(n, block)
    if full:  # a counted loop on an int32 counter (neuronx-cc downcasts int64 ones, and warns)

        def step(state):
            i, c = state
            return i + np.int32(1), body(i * np.int32(block), block, c)

        state = (np.int32(0), carry)
        _, carry = lax.while_loop(lambda state: state[0] < np.int32(full), step, state)
    if rest:
        carry = body(np.int32(full * block), rest, carry)
    return carry


def _take(x: jax.Array, axis: int, start: ArrayLike, size: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put(x: jax.Array, update: jax.Array, axis: int, start: ArrayLike) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(x, update, start, axis=axis)


class _Problem:
    """Inputs of one attention call in opmath, with the score tile of any (q block, k block)."""

    def __init__(self, q, k, v, mask, is_causal, scale):
        self.dtype = q.dtype
        self.compute = compute = opmath(q.dtype)
        self.q = q.astype(compute)
        self.k = _expand_kv(q, k).astype(compute)
        self.v = _expand_kv(q, v).astype(compute)
        self.mask, self.is_causal = mask, is_causal
        self.scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        self.lq, self.lk = q.shape[-2], k.shape[-2]

    def rows(self, t, start, size):  # a block along the sequence dim of q / k / v-shaped values
        return _take(t, t.ndim - 2, start, size)

    def scores(
        self, qb: jax.Array, q0: ArrayLike, nq: int, kb: jax.Array, k0: ArrayLike, nk: int
    ) -> jax.Array:
        """The [..., nq, nk] tile of q @ k^T * scale + mask (masked positions -inf)."""
        c = self.compute
        s = _einsum("...qd,...kd->...qk", qb, kb, c) * jnp.asarray(self.scale, c)
        minus_inf = jnp.asarray(-jnp.inf, c)
        mask = self.mask
        if mask is not None:
            if mask.ndim >= 1 and mask.shape[-1] != 1:
                mask = _take(mask, mask.ndim - 1, k0, nk)
            if mask.ndim >= 2 and mask.shape[-2] != 1:
                mask = _take(mask, mask.ndim - 2, q0, nq)
            if mask.dtype == jnp.bool_:
                s = jnp.where(mask, s, minus_inf)
            else:
                s = s + mask.astype(self.dtype).astype(c)
        if self.is_causal:
            rows = q0 + lax.broadcasted_iota(jnp.int32, (nq, nk), 0)
            cols = k0 + lax.broadcasted_iota(jnp.int32, (nq, nk), 1)
            s = jnp.where(rows >= cols, s, minus_inf)
        return s


def _forward(pb: _Problem, block: int) -> tuple[jax.Array, jax.Array]:
    """(out, lse) in opmath: out [..., Lq, Dv]; lse [..., Lq], -inf on fully masked rows."""
    c = pb.compute
    lead = pb.q.shape[:-2]
    dv = pb.v.shape[-1]

    def q_block(q0, nq, carry):
        out, lse = carry
        qb = pb.rows(pb.q, q0, nq)

        def k_block(k0, nk, state):
            m, total, acc = state
            s = pb.scores(qb, q0, nq, pb.rows(pb.k, k0, nk), k0, nk)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isneginf(m_new), jnp.zeros_like(m_new), m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            total = total * alpha + jnp.sum(p, axis=-1)
            pv = _einsum("...qk,...kd->...qd", p, pb.rows(pb.v, k0, nk), c)
            return m_new, total, acc * alpha[..., None] + pv

        init = (
            jnp.full((*lead, nq), -jnp.inf, c),
            jnp.zeros((*lead, nq), c),
            jnp.zeros((*lead, nq, dv), c),
        )
        m, total, acc = _sweep(pb.lk, block, k_block, init)
        live = total > 0
        safe_l = jnp.where(live, total, jnp.ones_like(total))
        ob = jnp.where(live[..., None], acc / safe_l[..., None], jnp.zeros_like(acc))
        lb = jnp.where(live, m + jnp.log(safe_l), jnp.full_like(m, -jnp.inf))
        return _put(out, ob, out.ndim - 2, q0), _put(lse, lb, lse.ndim - 1, q0)

    init = (jnp.zeros((*lead, pb.lq, dv), c), jnp.zeros((*lead, pb.lq), c))
    return _sweep(pb.lq, block, q_block, init)


def _sum_groups(grad, like):
    """GQA: sum the gradient of the repeated kv heads back onto each kv head."""
    hq, hk = grad.shape[-3], like.shape[-3]
    if hq == hk:
        return grad
    shape = (*grad.shape[:-3], hk, hq // hk, *grad.shape[-2:])
    return jnp.sum(grad.reshape(shape), axis=-3)


def attention_blockwise(q, k, v, mask=None, is_causal=False, scale=None, block=BLOCK):
    """Attention in q's dtype, blockwise (online softmax over key blocks)."""
    pb = _Problem(q, k, v, mask, is_causal, scale)
    out, _ = _forward(pb, block)
    return out.astype(q.dtype)


def attention_blockwise_backward(
    grad, q, k, v, mask=None, is_causal=False, scale=None, block=BLOCK, mask_grad=False
):
    """(dq, dk, dv) of attention, blockwise: the forward is recomputed for (out, lse). With
    `mask_grad` (a float mask that requires grad) also dmask, the score gradient ds summed to
    the mask's shape tile by tile: (dq, dk, dv, dmask)."""
    pb = _Problem(q, k, v, mask, is_causal, scale)
    c = pb.compute
    out, lse = _forward(pb, block)
    do = grad.astype(q.dtype).astype(c)
    delta = jnp.sum(do * out, axis=-1)  # rowsum(do * out) = rowsum(p * (do @ v^T))
    lse = jnp.where(jnp.isneginf(lse), jnp.zeros_like(lse), lse)  # masked rows: p = exp(-inf) = 0
    sc = jnp.asarray(pb.scale, c)
    dmask = _MaskGrad(mask, c) if mask_grad else None

    def k_block(k0, nk, carry):
        dq, dk, dv, dm = carry
        kb, vb = pb.rows(pb.k, k0, nk), pb.rows(pb.v, k0, nk)

        def q_block(q0, nq, state):
            dq, dkb, dvb, dm = state
            qb, dob = pb.rows(pb.q, q0, nq), pb.rows(do, q0, nq)
            s = pb.scores(qb, q0, nq, kb, k0, nk)
            p = jnp.exp(s - _take(lse, lse.ndim - 1, q0, nq)[..., None])
            dvb = dvb + _einsum("...qk,...qd->...kd", p, dob, c)
            dp = _einsum("...qd,...kd->...qk", dob, vb, c)
            ds = p * (dp - _take(delta, delta.ndim - 1, q0, nq)[..., None])
            dqb = pb.rows(dq, q0, nq) + _einsum("...qk,...kd->...qd", ds, kb, c) * sc
            dkb = dkb + _einsum("...qk,...qd->...kd", ds, qb, c) * sc
            if dmask is not None:
                dm = dmask.add(dm, ds, q0, k0)
            return _put(dq, dqb, dq.ndim - 2, q0), dkb, dvb, dm

        init = (dq, jnp.zeros_like(kb), jnp.zeros_like(vb), dm)
        dq, dkb, dvb, dm = _sweep(pb.lq, block, q_block, init)
        return dq, _put(dk, dkb, dk.ndim - 2, k0), _put(dv, dvb, dv.ndim - 2, k0), dm

    dm0 = dmask.zeros() if dmask is not None else jnp.zeros((), c)
    init = (jnp.zeros_like(pb.q), jnp.zeros_like(pb.k), jnp.zeros_like(pb.v), dm0)
    dq, dk, dv, dm = _sweep(pb.lk, block, k_block, init)
    grads = (dq, _sum_groups(dk, k), _sum_groups(dv, v))
    return (*grads, dm) if dmask is not None else grads


class _MaskGrad:
    """Accumulates dmask: each [..., nq, nk] tile of ds (the score gradient; the mask is added
    to the scores) summed over the dims the mask broadcasts along, added at the tile's place."""

    def __init__(self, mask, compute):
        self.shape, self.compute = tuple(mask.shape), compute

    def zeros(self):
        return jnp.zeros(self.shape, self.compute)

    def add(self, dm, ds, q0, k0):
        """dm plus the contribution of ds, the [..., nq, nk] score-gradient tile at (q0, k0)."""
        rank = len(self.shape)
        tile = ds.sum(axis=tuple(range(ds.ndim - rank)))  # leading dims the mask lacks
        tile = _sum_to(
            tile, tuple(1 if m == 1 else n for m, n in zip(self.shape, tile.shape, strict=True))
        )
        starts = [np.int32(0)] * rank
        for axis, start in ((rank - 1, k0), (rank - 2, q0)):
            if axis >= 0 and self.shape[axis] != 1:
                starts[axis] = start
        here = lax.dynamic_slice(dm, starts, tile.shape)
        return lax.dynamic_update_slice(dm, here + tile, starts)


def _sum_to(x, shape):
    """x summed (keeping dims) over the dims where `shape` is 1 and x is not."""
    axes = tuple(d for d, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 != n)
    return x.sum(axis=axes, keepdims=True) if axes else x


# --------------------------------------------------------------------------- rules


def _blockwise(k: jax.Array) -> bool:
    return k.shape[-2] > BLOCK


@RULES.register("portable.attention.default")
def attention_rule(ctx, q, k, v, mask=None, is_causal=False, scale=None):
    form = attention_blockwise if _blockwise(k) else attention
    return form(q, k, v, mask, is_causal, scale).astype(out_dtype(ctx))


@RULES.register("portable.attention_backward.default")
def attention_backward(ctx, grad, q, k, v, mask=None, is_causal=False, scale=None):
    if _blockwise(k):
        grads = attention_blockwise_backward(grad, q, k, v, mask, is_causal, scale)
        return tuple(g.astype(out_dtype(ctx, i)) for i, g in enumerate(grads))
    _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, mask, is_causal, scale), q, k, v)
    return vjp(grad.astype(q.dtype))


@RULES.register("portable.attention_backward.mask_grad")
def attention_backward_mask_grad(ctx, grad, q, k, v, mask, is_causal=False, scale=None):
    """(dq, dk, dv, dmask): dmask is the score gradient summed to the mask's shape."""
    if _blockwise(k):
        grads = attention_blockwise_backward(grad, q, k, v, mask, is_causal, scale, mask_grad=True)
    else:
        _, vjp = jax.vjp(lambda q, k, v, m: attention(q, k, v, m, is_causal, scale), q, k, v, mask)
        grads = vjp(grad.astype(q.dtype))
    return tuple(g.astype(out_dtype(ctx, i)) for i, g in enumerate(grads))
