"""Selection, scans and indexing beyond the core (opset family `selection`): order statistics,
running extrema, bucketing, histograms, strided and masked writes, copies of views.

Torch's CPU kernels are sequential loops; the rules below reproduce their decisions exactly
(which index a tie keeps, where NaN goes, the binary search's probes), not just their values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import RULES
from ._util import norm_dim, opmath, out_dtype, unsupported


def _running_extreme(ctx, x, dim, later_wins):
    # torch's loop: `if (isnan(v) || (!isnan(best) && later_wins(v, best))) best, at = v, i`.
    # That picks the maximum of a total order (NaN above every number, among numbers the
    # larger; ties, NaNs included, to the later index), so it is an associative scan.
    index_dtype = out_dtype(ctx, 1)
    if x.ndim == 0:
        return x, jnp.zeros((), index_dtype)
    d = norm_dim(dim, x.ndim)
    iota = jax.lax.broadcasted_iota(index_dtype, x.shape, d)

    def combine(first, second):
        (v1, i1), (v2, i2) = first, second
        take = jnp.isnan(v2) | (jnp.logical_not(jnp.isnan(v1)) & later_wins(v2, v1))
        return jnp.where(take, v2, v1), jnp.where(take, i2, i1)

    if not jnp.issubdtype(x.dtype, jnp.floating):

        def combine(first, second):  # noqa: F811 (no NaN in integers)
            (v1, i1), (v2, i2) = first, second
            take = later_wins(v2, v1)
            return jnp.where(take, v2, v1), jnp.where(take, i2, i1)

    return jax.lax.associative_scan(combine, (x, iota), axis=d)


@RULES.register("aten.cummax.default")
def cummax(ctx, x, dim):
    return _running_extreme(ctx, x, dim, jnp.greater_equal)


@RULES.register("aten.cummin.default")
def cummin(ctx, x, dim):
    return _running_extreme(ctx, x, dim, jnp.less_equal)


@RULES.register("aten.logcumsumexp.default")
def logcumsumexp(ctx, x, dim):
    # torch's loop, in float32 for half types, rounding each output:
    # acc = -inf; acc = (lo != hi or finite(lo)) ? log1p(exp(lo - hi)) + hi : v,
    # lo, hi = min, max of (v, acc), NaN propagating. A sequential scan keeps its order.
    out = out_dtype(ctx)
    if x.ndim == 0:
        return x.astype(out)
    d = norm_dim(dim, x.ndim)
    acc = opmath(out)
    moved = jnp.moveaxis(x.astype(acc), d, 0)

    def step(total, v):
        lo, hi = jnp.minimum(v, total), jnp.maximum(v, total)
        keep = (lo != hi) | jnp.isfinite(lo)
        total = jnp.where(keep, jnp.log1p(jnp.exp(lo - hi)) + hi, v)
        return total, total

    start = jnp.full(moved.shape[1:], -jnp.inf, acc)
    _, running = jax.lax.scan(step, start, moved)
    return jnp.moveaxis(running, 0, d).astype(out)


def _search(ctx, sorted_seq, values, right, sorter=None):
    # torch's binary search, probe for probe: start, end = 0, n; while start < end:
    # mid = start + (end - start) // 2; if not (v < s[mid]) (right) / not (v <= s[mid]) (left):
    # start = mid + 1 else end = mid. Run for every value at once, ceil(log2(n + 1)) rounds.
    # With NaN in the sequence the predicate is not monotone, so only the same probes give
    # torch's answer.
    dtype = out_dtype(ctx)
    common = jnp.promote_types(sorted_seq.dtype, values.dtype)
    seq, vals = sorted_seq.astype(common), values.astype(common)
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter.astype(jnp.int32), axis=-1)
    n = seq.shape[-1]
    start = jnp.zeros(vals.shape, jnp.int32)
    end = jnp.full(vals.shape, n, jnp.int32)
    for _ in range(n.bit_length()):
        active = start < end
        mid = start + (end - start) // 2
        probe = jnp.clip(mid, 0, max(n - 1, 0))
        # a 1-d sequence serves every value; an n-d one its row ([..., n] against [..., m])
        at = seq[probe] if seq.ndim == 1 else jnp.take_along_axis(seq, probe, axis=-1)
        below = jnp.logical_not(vals < at) if right else jnp.logical_not(vals <= at)
        start = jnp.where(active & below, mid + 1, start)
        end = jnp.where(active & jnp.logical_not(below), mid, end)
    return start.astype(dtype)


@RULES.register("aten.searchsorted.Tensor")
def searchsorted(ctx, sorted_seq, values, *, out_int32=False, right=False, side=None, sorter=None):
    return _search(ctx, sorted_seq, values, right or side == "right", sorter)


@RULES.register("aten.bucketize.Tensor")
def bucketize(ctx, values, boundaries, *, out_int32=False, right=False):
    return _search(ctx, boundaries, values, right)


def _lower_median(ctx, x, ignore_nan):
    # sort all elements (NaN last); torch's median is sorted[(n - 1) // 2], NaN if any is NaN;
    # nanmedian takes the lower median of the k non-NaN ones, sorted[(k - 1) // 2]
    out = out_dtype(ctx)
    flat = jnp.sort(x.reshape(-1))
    n = flat.shape[0]
    if n == 0:
        raise unsupported(ctx, "median of an empty tensor", "eager PyTorch refuses it too")
    if not jnp.issubdtype(flat.dtype, jnp.floating):
        return flat[(n - 1) // 2].astype(out)
    nan = jnp.isnan(flat)
    count = n - jnp.sum(nan) if ignore_nan else n
    pick = jnp.maximum((count - 1) // 2, 0)
    value = jnp.take(flat, pick)
    if ignore_nan:
        return value.astype(out)
    return jnp.where(jnp.any(nan), jnp.asarray(jnp.nan, flat.dtype), value).astype(out)


@RULES.register("aten.median.default")
def median(ctx, x):
    return _lower_median(ctx, x, ignore_nan=False)


@RULES.register("aten.nanmedian.default")
def nanmedian(ctx, x):
    return _lower_median(ctx, x, ignore_nan=True)


def _median_along(ctx, x, dim, keepdim, ignore_nan):
    # torch's CPU kernel: nth_element under the strict order (value, index), NaN last, so the
    # pick is the stable sort's: position (n - 1) // 2 (median; a row with a NaN gives its
    # first NaN) or (k - 1) // 2 of the k non-NaN values (nanmedian). An all-NaN row gives NaN;
    # its index is unspecified (torch's comparator is no strict order there), 0 here.
    index_dtype = out_dtype(ctx, 1)
    if x.ndim == 0:
        return x, jnp.zeros((), index_dtype)
    d = norm_dim(dim, x.ndim)
    n = x.shape[d]
    if n == 0:
        raise unsupported(ctx, "median along an empty dim", "eager PyTorch refuses it too")
    moved = jnp.moveaxis(x, d, -1)
    keys = moved.astype(jnp.int8) if moved.dtype == jnp.bool_ else moved
    iota = jax.lax.broadcasted_iota(index_dtype, keys.shape, keys.ndim - 1)
    _, order = jax.lax.sort((keys, iota), dimension=keys.ndim - 1, is_stable=True, num_keys=1)
    if jnp.issubdtype(moved.dtype, jnp.floating):
        nan = jnp.isnan(moved)
        if ignore_nan:
            pick = jnp.maximum((n - jnp.sum(nan, axis=-1) - 1) // 2, 0)
            at = jnp.take_along_axis(order, pick[..., None], -1)[..., 0]
        else:
            at = jnp.take_along_axis(order, jnp.full(order.shape[:-1] + (1,), (n - 1) // 2), -1)
            at = jnp.where(jnp.any(nan, -1), jnp.argmax(nan, -1).astype(index_dtype), at[..., 0])
    else:
        at = order[..., (n - 1) // 2]
    value = jnp.take_along_axis(moved, at[..., None], -1)[..., 0]
    if keepdim:
        value, at = jnp.expand_dims(value, d), jnp.expand_dims(at, d)
    return value, at


@RULES.register("aten.median.dim")
def median_dim(ctx, x, dim, keepdim=False):
    return _median_along(ctx, x, dim, keepdim, ignore_nan=False)


@RULES.register("aten.nanmedian.dim")
def nanmedian_dim(ctx, x, dim, keepdim=False):
    return _median_along(ctx, x, dim, keepdim, ignore_nan=True)


def _quick_select(values, index, k):
    # torch's quick_select_template (aten/src/ATen/native/SortingUtils.h) on one row, swap for
    # swap, so that the index it leaves at k among equal values is torch's: median-of-three
    # pivot at L + (R - L) / 2, Hoare partition, [L, R] narrowed to the side holding k. `gt`
    # is torch's order (NaN above every number). The scans' bounds never bind on a live row
    # (the median of three leaves sentinels at both ends); they stop the rows vmap carries on.
    def gt(a, b):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return (jnp.isnan(a) & jnp.logical_not(jnp.isnan(b))) | (a > b)
        return a > b

    def swap_if(state, cond, p, q):
        a, ix = state
        sa = a.at[p].set(a[q]).at[q].set(a[p])
        six = ix.at[p].set(ix[q]).at[q].set(ix[p])
        return jnp.where(cond, sa, a), jnp.where(cond, six, ix)

    def partition(state, lo, hi):
        state = swap_if(state, True, lo + (hi - lo) // 2, lo + 1)
        state = swap_if(state, gt(state[0][lo + 1], state[0][hi]), lo + 1, hi)
        state = swap_if(state, gt(state[0][lo], state[0][hi]), lo, hi)
        state = swap_if(state, gt(state[0][lo + 1], state[0][lo]), lo + 1, lo)
        pivot = state[0][lo]

        def scan(carry):
            a, ix, i, j, _ = carry
            i = jax.lax.while_loop(lambda i: (i < hi) & gt(pivot, a[i]), lambda i: i + 1, i + 1)
            j = jax.lax.while_loop(lambda j: (j > lo) & gt(a[j], pivot), lambda j: j - 1, j - 1)
            crossed = j < i
            a, ix = swap_if((a, ix), jnp.logical_not(crossed), i, j)
            return a, ix, i, j, crossed

        init = (*state, lo + 1, hi, jnp.asarray(False))
        a, ix, i, j, _ = jax.lax.while_loop(lambda c: jnp.logical_not(c[4]), scan, init)
        a, ix = swap_if((a, ix), True, lo, j)
        return (a, ix), jnp.where(j <= k, i, lo), jnp.where(j >= k, j - 1, hi)

    def step(carry):
        a, ix, lo, hi, _ = carry
        two = hi == lo + 1
        (pa, pix), plo, phi = partition((a, ix), lo, jnp.maximum(hi, lo + 2))
        sa, six = swap_if((a, ix), gt(a[lo], a[hi]), lo, hi)
        return jnp.where(two, sa, pa), jnp.where(two, six, pix), plo, phi, two

    def running(carry):
        _, _, lo, hi, stop = carry
        return jnp.logical_not(stop) & (hi > lo)

    last = values.shape[0] - 1
    start = (values, index, jnp.asarray(0), jnp.asarray(last), jnp.asarray(False))
    a, ix, *_ = jax.lax.while_loop(running, step, start)
    return a[k], ix[k]


@RULES.register("aten.kthvalue.default")
def kthvalue(ctx, x, k, dim=-1, keepdim=False):
    index_dtype = out_dtype(ctx, 1)
    if x.ndim == 0:
        return x, jnp.zeros((), index_dtype)
    d = norm_dim(dim, x.ndim)
    moved = jnp.moveaxis(x, d, -1)
    n = moved.shape[-1]
    if not 1 <= k <= n:
        raise unsupported(ctx, f"kthvalue with k={k} of {n} values", "take 1 <= k <= the dim size")
    rows = moved.reshape(-1, n)
    iota = jax.lax.broadcasted_iota(index_dtype, rows.shape, 1)
    value, at = jax.vmap(lambda r, i: _quick_select(r, i, k - 1))(rows, iota)
    value, at = value.reshape(moved.shape[:-1]), at.reshape(moved.shape[:-1])
    if keepdim:
        value, at = jnp.expand_dims(value, d), jnp.expand_dims(at, d)
    return value, at


# torch's CPU mode sorts each row's (value, index) pairs by value with std::sort, which is an
# insertion sort up to 16 elements; past that the order among equal values (so the index
# reported) is its introsort's, not a stated rule
_MODE_INSERTION_SORT_UP_TO = 16


def _insertion_sort(values, index):
    # libstdc++'s __insertion_sort with `a < b`, along the last dim, step for step: element i
    # goes to the front if it is below the first, else moves left while below its left
    # neighbour. With NaN (never below, never above) this is not a sort, and torch's order
    # is exactly this one.
    n = values.shape[-1]
    for i in range(1, n):
        v, ix = values[..., i], index[..., i]
        shifts = jnp.zeros(v.shape, jnp.int32)
        moving = jnp.ones(v.shape, bool)
        for j in range(i, 0, -1):
            moving = moving & (v < values[..., j - 1])
            shifts = shifts + moving
        shifts = jnp.where(v < values[..., 0], i, shifts)
        goal = i - shifts
        new_v, new_ix = [], []
        for p in range(n):
            if p > i:
                new_v.append(values[..., p])
                new_ix.append(index[..., p])
                continue
            left = max(p - 1, 0)
            v_p = jnp.where(p > goal, values[..., left], values[..., p])
            ix_p = jnp.where(p > goal, index[..., left], index[..., p])
            new_v.append(jnp.where(p == goal, v, v_p))
            new_ix.append(jnp.where(p == goal, ix, ix_p))
        values, index = jnp.stack(new_v, -1), jnp.stack(new_ix, -1)
    return values, index


@RULES.register("aten.mode.default")
def mode(ctx, x, dim=-1, keepdim=False):
    # torch: order the (value, index) pairs (above); walk them counting the current run of
    # equal values (`!=` ends a run, so each NaN is its own); a run longer than every earlier
    # one takes the mode and its last pair's index
    index_dtype = out_dtype(ctx, 1)
    if x.ndim == 0:
        return x, jnp.zeros((), index_dtype)
    d = norm_dim(dim, x.ndim)
    n = x.shape[d]
    if n > _MODE_INSERTION_SORT_UP_TO or n == 0:
        raise unsupported(
            ctx,
            f"mode along a dim of size {n}: past {_MODE_INSERTION_SORT_UP_TO} elements torch's "
            "index among equal values is its introsort's order (and an empty dim has no mode)",
            f"reduce along a dim of 1 to {_MODE_INSERTION_SORT_UP_TO} elements, or use the cpu "
            "backend",
        )
    moved = jnp.moveaxis(x, d, -1)
    iota = jax.lax.broadcasted_iota(index_dtype, moved.shape, moved.ndim - 1)
    values, index = _insertion_sort(moved, iota)
    batch = values.shape[:-1]
    best_v, best_ix = values[..., 0], index[..., 0]
    best = jnp.zeros(batch, jnp.int32)
    run = jnp.zeros(batch, jnp.int32)
    for i in range(n):
        run = run + 1
        ends = (values[..., i] != values[..., i + 1]) if i + 1 < n else jnp.ones(batch, bool)
        wins = ends & (run > best)
        best_v = jnp.where(wins, values[..., i], best_v)
        best_ix = jnp.where(wins, index[..., i], best_ix)
        best = jnp.where(wins, run, best)
        run = jnp.where(ends, 0, run)
    if keepdim:
        best_v, best_ix = jnp.expand_dims(best_v, d), jnp.expand_dims(best_ix, d)
    return best_v, best_ix


@RULES.register("aten.nonzero_static.default")
def nonzero_static(ctx, x, *, size, fill_value=-1):
    # the first `size` nonzero positions in row-major order (jnp.nonzero's order), each a row of
    # ndim indices; rows past the count hold fill_value in every column
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    found = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(found, axis=1).astype(out_dtype(ctx))
