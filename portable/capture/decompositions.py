"""The decomposition table of capture: core ATen, minus what the opset keeps whole, plus the
decompositions of ops real models use that core ATen keeps (`aten.copy`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._decomp import core_aten_decompositions

from ..opset import op_name, opset_table

aten = torch.ops.aten


def _copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    # copy(self, src) -> clone(expand(src.to(self.dtype), self.shape))
    # The functional form of `self.copy_(src)` (e.g. DeepSeek-V3 writing k_nope and k_rot into
    # slices of one key tensor): src broadcast to self's shape, in self's dtype, in new memory.
    # `_to_copy` rounds as `copy_` does (to nearest even), so the result is bit-identical.
    value = src if src.dtype == self.dtype else aten._to_copy.default(src, dtype=self.dtype)
    return aten.clone.default(aten.expand.default(value, list(self.shape)))


def _batch_norm_with_update(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    # _batch_norm_with_update_functional (what `F.batch_norm(training=True)` on running stats
    # it is passed functionalizes to) is the legit kernel in training mode, the same CPU kernel
    # (bit-identical), plus cuDNN's reserve space, which is empty on CPU
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        x, weight, bias, running_mean, running_var, True, momentum, eps
    )
    reserve = aten.empty.memory_format([0], dtype=torch.uint8, device=x.device)
    return out, mean, rstd, reserve, new_mean, new_var


# The *_copy ops (what functionalization names a view taken out of place): the view, then
# `clone` into new contiguous memory. The same elements, so bit-identical.
def _view_copy(x: torch.Tensor, size: list[int]) -> torch.Tensor:
    return aten.clone.default(aten.view.default(x, size), memory_format=torch.contiguous_format)


def _permute_copy(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    view = aten.permute.default(x, dims)
    return aten.clone.default(view, memory_format=torch.contiguous_format)


def _narrow_copy(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    # narrow(x, dim, start, length) -> slice(x, dim, start, start + length), start wrapped
    start = start + x.shape[dim] if start < 0 else start
    view = aten.slice.Tensor(x, dim, start, start + length)
    return aten.clone.default(view, memory_format=torch.contiguous_format)


def _unbind_copy(x: torch.Tensor, dim: int = 0) -> list[torch.Tensor]:
    # unbind(x, dim) -> [select(x, dim, i) for i < x.shape[dim]]
    return [
        aten.clone.default(aten.select.int(x, dim, i), memory_format=torch.contiguous_format)
        for i in range(x.shape[dim])
    ]


def _unfold(x: torch.Tensor, dim: int, size: int, step: int) -> torch.Tensor:
    # unfold(x, dim, size, step)[..., w, ..., j] = x[..., w * step + j, ...]: one index_select
    # with the window starts plus offsets, the window axis split in two and its offsets moved
    # last. Pure selection, so exact.
    if x.dim() == 0:  # a 0-d x is one window of its one element (size 1) or none (size 0)
        return aten.slice.Tensor(aten.view.default(x, [1]), 0, 0, size)
    dim = dim % x.dim()
    windows = (x.shape[dim] - size) // step + 1
    starts = aten.mul.Scalar(aten.arange.start_step(0, windows, 1, device=x.device), step)
    offsets = aten.arange.start_step(0, size, 1, device=x.device)
    index = aten.add.Tensor(aten.unsqueeze.default(starts, 1), aten.unsqueeze.default(offsets, 0))
    picked = aten.index_select.default(x, dim, aten.view.default(index, [windows * size]))
    split = list(x.shape[:dim]) + [windows, size] + list(x.shape[dim + 1 :])
    order = [d for d in range(len(split)) if d != dim + 1] + [dim + 1]
    return aten.permute.default(aten.view.default(picked, split), order)


def _put(
    x: torch.Tensor, index: torch.Tensor, source: torch.Tensor, accumulate: bool = False
) -> torch.Tensor:
    # put(x, index, source) -> index_put(x.reshape(-1), [index.reshape(-1)], source.reshape(-1))
    # viewed back: put indexes x as if flat (negative indices wrap, as in index_put)
    flat = aten.view.default(x, [x.numel()])
    where = [aten.view.default(index, [index.numel()])]
    values = aten.view.default(source, [source.numel()])
    return aten.view.default(aten.index_put.default(flat, where, values, accumulate), list(x.shape))


def _index_reduce(
    x: torch.Tensor,
    dim: int,
    index: torch.Tensor,
    source: torch.Tensor,
    reduce: str,
    include_self: bool = True,
) -> torch.Tensor:
    # index_reduce(x, dim, index, source, r) -> scatter_reduce(x, dim, index broadcast over
    # source, source, r): the same reduction, taken in the same order on CPU
    if source.dim() == 0:  # one element reduced into x's one element: the same on 1-element views
        one = _index_reduce(
            aten.view.default(x, [1]),
            0,
            index,
            aten.view.default(source, [1]),
            reduce,
            include_self,
        )
        return aten.view.default(one, list(x.shape))
    dim = dim % source.dim()
    shape = [1] * source.dim()
    shape[dim] = index.numel()
    spread = aten.expand.default(aten.view.default(index, shape), list(source.shape))
    return aten.scatter_reduce.two(x, dim, spread, source, reduce, include_self=include_self)


def _masked_scatter(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    # masked_scatter(x, mask, source): the k-th True of mask (row-major) takes source's k-th
    # element. k = cumsum(mask) - 1, a gather from flat source, then where(mask, gathered, x).
    shape = list(torch.broadcast_shapes(x.shape, mask.shape))
    n = 1
    for d in shape:
        n *= d
    if source.numel() == 0 or n == 0:
        return NotImplemented
    flat_mask = aten.view.default(aten.clone.default(aten.expand.default(mask, shape)), [n])
    rank = aten.sub.Scalar(aten.cumsum.default(flat_mask, 0, dtype=torch.int64), 1)
    rank = aten.clamp.default(rank, 0, source.numel() - 1)
    taken = aten.index.Tensor(aten.view.default(source, [source.numel()]), [rank])
    flat_x = aten.view.default(aten.clone.default(aten.expand.default(x, shape)), [n])
    return aten.view.default(aten.where.self(flat_mask, taken, flat_x), shape)


def _masked_scatter_backward(
    grad: torch.Tensor, mask: torch.Tensor, sizes: list[int]
) -> torch.Tensor:
    # the source's gradient: grad's elements where mask is True, in row-major order, then
    # zeros, shaped as source. Each True goes to its rank (cumsum(mask) - 1), each False to a
    # spare slot past the end that is dropped.
    n = grad.numel()
    total = 1
    for d in sizes:
        total *= d
    flat_mask = aten.view.default(
        aten.clone.default(aten.expand.default(mask, list(grad.shape))), [n]
    )
    rank = aten.sub.Scalar(aten.cumsum.default(flat_mask, 0, dtype=torch.int64), 1)
    spare = aten.full.default([n], total, dtype=torch.int64, device=grad.device)
    slot = aten.clamp.default(aten.where.self(flat_mask, rank, spare), 0, total)
    zeros = aten.full.default([total + 1], 0, dtype=grad.dtype, device=grad.device)
    placed = aten.index_put.default(zeros, [slot], aten.view.default(grad, [n]))
    return aten.view.default(aten.slice.Tensor(placed, 0, 0, total), list(sizes))


def _strided_index(
    x: torch.Tensor, size: list[int], stride: list[int], storage_offset: int | None
) -> torch.Tensor | None:
    # as_strided(x, size, stride, offset)[i...] = storage[offset + sum(i_k * stride_k)]: for a
    # contiguous x the storage from x's own offset is x.reshape(-1), so the view is a gather
    # of these flat indices. None where the view would read outside x's elements (or x is
    # not contiguous): there the storage is not x's values.
    if not x.is_contiguous() or any(s < 0 for s in stride):
        return None
    start = (x.storage_offset() if storage_offset is None else storage_offset) - x.storage_offset()
    last = start + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if 0 not in size and (start < 0 or last >= x.numel()):
        return None
    index = aten.full.default([1] * len(size), start, dtype=torch.int64, device=x.device)
    for k, (n, s) in enumerate(zip(size, stride, strict=True)):
        axis = aten.mul.Scalar(aten.arange.start_step(0, n, 1, device=x.device), s)
        shape = [1] * len(size)
        shape[k] = n
        index = aten.add.Tensor(index, aten.view.default(axis, shape))
    return aten.expand.default(index, list(size))


def _as_strided(
    x: torch.Tensor, size: list[int], stride: list[int], storage_offset: int | None = None
) -> torch.Tensor:
    index = _strided_index(x, size, stride, storage_offset)
    if index is None:
        return NotImplemented
    return aten.index.Tensor(aten.view.default(x, [x.numel()]), [index])


def _as_strided_scatter(
    x: torch.Tensor,
    src: torch.Tensor,
    size: list[int],
    stride: list[int],
    storage_offset: int | None = None,
) -> torch.Tensor:
    # as_strided_scatter(x, src, ...) = x with its strided view overwritten by src: index_put
    # at the view's flat indices. Only where no two view elements share a storage element
    # (otherwise which write lands is the kernel's order, not a value we can state).
    index = _strided_index(x, size, stride, storage_offset)
    if index is None or _overlaps(size, stride):
        return NotImplemented
    flat = aten.view.default(x, [x.numel()])
    return aten.view.default(aten.index_put.default(flat, [index], src), list(x.shape))


def _overlaps(size: list[int], stride: list[int]) -> bool:
    """Whether two indices of a strided view of this size and stride reach one element."""
    dims = sorted((s, n) for n, s in zip(size, stride, strict=True) if n > 1)
    span = 1
    for s, n in dims:
        if s < span:
            return True
        span = s * (n - 1) + span
    return False


def _pinv(
    x: torch.Tensor,
    *,
    atol: torch.Tensor | None = None,
    rtol: torch.Tensor | None = None,
    hermitian: bool = False,
) -> torch.Tensor:
    # pinv(A) = V diag(1/s if s > max(atol, rtol * s_max) else 0) U^H, from the SVD (or, when
    # hermitian, the eigendecomposition, with s = |eigenvalue|): torch's kernel step by step,
    # the tolerances in float64 as there, so the cutoff and the result are eager's bit for bit
    f64 = torch.float64
    zero = aten.zeros.default([], dtype=f64)
    atol_t = zero if atol is None else atol
    if rtol is None:
        n = max(x.shape[-1], x.shape[-2])
        default = aten.full.default([], torch.finfo(x.dtype).eps * n, dtype=f64)
        rtol = default if atol is None else aten.where.self(atol > 0, zero, default)
    if x.numel() == 0:  # an empty result: torch's kernel takes the SVD without a cutoff
        u, s, vh = aten._linalg_svd.default(x, False)
        v_scaled = aten.transpose.int(vh, -2, -1) * aten.reciprocal.default(s).unsqueeze(-2)
        return aten.matmul.default(v_scaled, aten.transpose.int(u, -2, -1))
    if hermitian:
        s, u = aten._linalg_eigh.default(x)
        magnitude = aten.abs.default(s)
        largest = aten.amax.default(magnitude, [-1], True)
        vh_t, ut = u, aten.transpose.int(u, -2, -1)
    else:
        u, s, vh = aten._linalg_svd.default(x, False)
        magnitude = s
        largest = aten.slice.Tensor(s, -1, 0, 1)
        vh_t, ut = aten.transpose.int(vh, -2, -1), aten.transpose.int(u, -2, -1)
    tol = aten.maximum.default(atol_t.unsqueeze(-1), rtol.unsqueeze(-1) * largest)
    inverse = aten.where.self(
        magnitude > tol, aten.reciprocal.default(s), aten.zeros.default([], dtype=s.dtype)
    )
    return aten.matmul.default(vh_t * inverse.to(x.dtype).unsqueeze(-2), ut)


def _replication_pad_backward(
    grad_output: torch.Tensor, x: torch.Tensor, padding: list[int]
) -> torch.Tensor:
    # replicate padding is one gather per padded dim with clamped indices (core ATen's
    # decomposition of replication_pad*d); its gradient is the scatter-add of each gather,
    # last gather first: grad_output's elements summed into the input positions they copy
    dims = len(padding) // 2
    leading = x.dim() - dims
    grad = grad_output
    for i in reversed(range(dims)):
        size = x.shape[leading + i]
        left, right = padding[2 * (dims - 1 - i)], padding[2 * (dims - 1 - i) + 1]
        index = aten.clamp.default(
            aten.arange.start_step(-left, size + right, 1, device=x.device), 0, size - 1
        )
        shape = list(grad.shape)
        shape[leading + i] = size
        zeros = aten.full.default(shape, 0, dtype=grad.dtype, device=grad.device)
        where: list[torch.Tensor | None] = [None] * grad.dim()
        where[leading + i] = index
        grad = aten.index_put.default(zeros, where, grad, True)
    return grad


def _logit(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    # torch's CPU kernel, step by step in x's dtype (a bfloat16 x rounds after the clamp, 1 - x,
    # the division and the log, as its vectorized kernel does): x clamped to [eps, 1 - eps],
    # log(x / (1 - x)). Core ATen's decomposition computes a 16-bit x in float32 and rounds once
    # (0.0156 from eager). Integers compute in the default float dtype.
    if not x.is_floating_point():
        x = aten._to_copy.default(x, dtype=torch.get_default_dtype())
    if eps is not None:
        x = aten.clamp.default(x, eps, 1 - eps)
    return aten.log.default(aten.div.Tensor(x, aten.rsub.Scalar(x, 1)))


def _empty_strided(
    size: list[int],
    stride: list[int],
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
) -> torch.Tensor:
    # uninitialized memory of a shape: a functional program has no strides to honour
    return aten.empty.memory_format(size, dtype=dtype or torch.get_default_dtype(), device=device)


def _new_empty_strided(
    x: torch.Tensor,
    size: list[int],
    stride: list[int],
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
) -> torch.Tensor:
    return _empty_strided(size, stride, dtype=dtype or x.dtype, device=device or x.device)


def _shift(op: Any) -> Callable[..., torch.Tensor]:
    # x << y and x >> y (`__lshift__` / `__rshift__`, which core ATen keeps) are the
    # bitwise shift ops of the same kernels; a Python shift becomes a 0-d tensor of x's dtype
    def shift(x: torch.Tensor, y: Any) -> torch.Tensor:
        if not isinstance(y, torch.Tensor):
            y = aten.scalar_tensor.default(y, dtype=x.dtype, device=x.device)
        return op(x, y)

    return shift


def _triangle_indices(lower: bool) -> Callable[..., torch.Tensor]:
    # tril_indices / triu_indices(row, col, offset): the (i, j) of the triangle in row-major
    # order, [2, n]. Every argument is static: the flat positions of the row x col grid, those
    # outside the triangle keyed past the end, sorted (the keys are distinct), the first n kept
    def indices(
        row: int,
        col: int,
        offset: int = 0,
        *,
        dtype: torch.dtype | None = None,
        layout: torch.layout | None = None,
        device: torch.device | None = None,
        pin_memory: bool | None = None,
    ) -> torch.Tensor:
        dtype = dtype or torch.int64
        per_row = [
            min(max(i + offset + 1, 0), col)
            if lower
            else min(max(col - max(i + offset, 0), 0), col)
            for i in range(row)
        ]
        n, total = sum(per_row), row * col
        if n == 0:
            return aten.full.default([2, 0], 0, dtype=dtype, device=device)
        flat = aten.arange.start_step(0, total, 1, dtype=torch.int64, device=device)
        width = aten.scalar_tensor.default(col, dtype=torch.int64, device=device)
        i = aten.div.Tensor_mode(flat, width, rounding_mode="floor")
        j = aten.remainder.Scalar(flat, col)
        diagonal = aten.sub.Tensor(j, i)
        keep = aten.le.Scalar(diagonal, offset) if lower else aten.ge.Scalar(diagonal, offset)
        key = aten.where.self(keep, flat, aten.add.Scalar(flat, total))
        chosen = aten.slice.Tensor(aten.sort.default(key)[0], 0, 0, n)
        rows = aten.div.Tensor_mode(chosen, width, rounding_mode="floor")
        pairs = aten.stack.default([rows, aten.remainder.Scalar(chosen, col)])
        return pairs if dtype == torch.int64 else aten._to_copy.default(pairs, dtype=dtype)

    return indices


# ops core ATen keeps whole that the opset spells with other ops
def _efficient_zeros(
    size: list[int],
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: torch.device | None = None,
    pin_memory: bool | None = None,
) -> torch.Tensor:
    # the zero gradients autograd formulas write as _efficientzerotensor (sgn's backward): zeros
    return aten.full.default(size, 0, dtype=dtype or torch.float32, device=device)


_EXTRA = {
    aten._efficientzerotensor.default: _efficient_zeros,
    aten.linalg_pinv.atol_rtol_tensor: _pinv,
    aten.copy.default: _copy,
    aten._batch_norm_with_update_functional.default: _batch_norm_with_update,
    aten.view_copy.default: _view_copy,
    aten.permute_copy.default: _permute_copy,
    aten.narrow_copy.default: _narrow_copy,
    aten.unbind_copy.int: _unbind_copy,
    aten.unfold.default: _unfold,
    aten.as_strided.default: _as_strided,
    aten.as_strided_copy.default: _as_strided,
    aten.as_strided_scatter.default: _as_strided_scatter,
    aten.put.default: _put,
    aten.index_reduce.default: _index_reduce,
    aten.masked_scatter.default: _masked_scatter,
    aten.masked_scatter_backward.default: _masked_scatter_backward,
    aten.logit.default: _logit,
    aten.tril_indices.default: _triangle_indices(lower=True),
    aten.triu_indices.default: _triangle_indices(lower=False),
    aten.__lshift__.Tensor: _shift(aten.bitwise_left_shift.Tensor),
    aten.__lshift__.Scalar: _shift(aten.bitwise_left_shift.Tensor),
    aten.__rshift__.Tensor: _shift(aten.bitwise_right_shift.Tensor),
    aten.__rshift__.Scalar: _shift(aten.bitwise_right_shift.Tensor),
    aten.empty_strided.default: _empty_strided,
    aten.new_empty_strided.default: _new_empty_strided,
    aten.replication_pad1d_backward.default: _replication_pad_backward,
    aten.replication_pad2d_backward.default: _replication_pad_backward,
    aten.replication_pad3d_backward.default: _replication_pad_backward,
}


def decompositions(python_only: bool) -> dict[torch._ops.OperatorBase, Callable[..., Any]]:
    """Core ATen decompositions, minus every op the opset keeps whole (silu, gelu_backward,
    the losses, ...): their decompositions round differently from the eager kernels, and a
    captured program must match eager PyTorch bit for bit on `cpu`. Plus `_EXTRA`. A plain dict
    for the joint-graph path, torch.export's table type otherwise."""
    table = core_aten_decompositions() if python_only else torch.export.default_decompositions()
    keep = set(opset_table())
    for op in list(table.keys()):
        if isinstance(op, torch._ops.OpOverload) and op_name(op) in keep:
            del table[op]
    table.update(_EXTRA)
    return table


@contextlib.contextmanager
def without_error_checks() -> Iterator[None]:
    """Decompose with `aten._linalg_check_errors` (what `linalg.inv`, `cholesky`, `solve` & co.
    call on their LAPACK info code) as an op without effects, so it is traced away rather than
    threaded through an effect token the Program cannot hold.

    The contract: eager PyTorch raises on a singular or non-positive-definite input; a captured
    program does not check and returns what the factorization gives (inf/NaN or garbage, as the
    `*_ex` ops do with their `info` output). Validating inputs is the caller's job."""
    from torch._higher_order_ops.effects import _get_effect, _register_effectful_op

    op = "aten::_linalg_check_errors"
    effect = _get_effect(op)
    _register_effectful_op(op, None)
    try:
        yield
    finally:
        _register_effectful_op(op, effect)
