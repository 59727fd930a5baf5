"""Merged dims whose split is not a contiguous chunk: what context parallelism's flattened tokens
look like on a rank.

A linear layer flattens its activation, `view([B, T, C] -> [B*T, C])`, before the matmul and
unflattens the product after it. Under context parallelism T is split: rank j holds tokens
j*T/cp ... (j+1)*T/cp - 1 of every sequence, so its rows of the merged dim are
{b*T + j*T/cp + t}, which are not a contiguous chunk of B*T (unless B has one row per rank). A
`Sharding` describes contiguous chunks only, so the pass records such a dim beside it as a
`Merge`: the global sizes of the dims the merged dim is made of (major first) and the axes
splitting each. The dim's `Sharding` entry is the concatenation of those axes (so local sizes
and byte counts are right), and the rows are in the order of the permuted global value
[splits..., B/dp, T/cp]: each rank's rows are whole, only their global positions differ.

Row-wise ops (matmuls over the other dim, pointwise ops, a softmax over the other dim, the
loss) do not see the order, so they run on the local rows unchanged and their results carry
the same merge. Whatever depends on global positions (a collective along the merged dim, a
replicated value sliced to match, an output) goes through the unmerged form: a local view
back to [..., B/dp, T/cp, ...], the collective or slice on the dims it really splits, and a
local view to the merged shape again (`Redistributor`). A value has at most one merged dim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from portable.ir.plan import Mesh

__all__ = ["Merge", "merge_of", "unmerged_splits"]


@dataclasses.dataclass(frozen=True)
class Merge:
    """One merged dim: the global sizes of the dims it merges (major first, size-1 dims left
    out) and the mesh axes splitting each of them."""

    sizes: tuple[int, ...]
    splits: tuple[tuple[str, ...], ...]

    @property
    def axes(self) -> tuple[str, ...]:
        """The merged dim's `Sharding` entry: every splitting axis, major sub-dim first."""
        return tuple(a for s in self.splits for a in s)

    def local_sizes(self, mesh: Mesh) -> tuple[int, ...]:
        return tuple(
            size // math.prod(mesh.axis_size(a) for a in axes)
            for size, axes in zip(self.sizes, self.splits, strict=True)
        )


def merge_of(
    sizes: Sequence[int], splits: Sequence[Sequence[str]], mesh: Mesh
) -> tuple[tuple[str, ...], Merge | None]:
    """The split of the dim that merges dims of `sizes` split by `splits`: its axes, and the
    `Merge` to record when the rows a rank holds are not a contiguous chunk (None when they
    are: every sub-dim before the last split one has one row per rank)."""
    kept = [(int(n), tuple(s)) for n, s in zip(sizes, splits, strict=True) if n != 1]
    merge = Merge(tuple(n for n, _ in kept), tuple(s for _, s in kept))
    split_at = [k for k, (_, s) in enumerate(kept) if s]
    if not split_at:
        return (), None
    local = merge.local_sizes(mesh)
    contiguous = all(local[k] == 1 for k in range(split_at[-1]))
    return merge.axes, None if contiguous else merge


def unmerged_splits(
    axes: Sequence[str], sizes: Sequence[int], mesh: Mesh
) -> tuple[tuple[str, ...], ...] | None:
    """How a dim split contiguously over `axes` (major first) splits the dims of `sizes` it is
    reshaped into: axes fill the first sub-dim until one row per rank is left there, then the
    next. None when an axis does not divide what is left of its sub-dim (not contiguous)."""
    out: list[list[str]] = [[] for _ in sizes]
    left = [int(n) for n in sizes]
    k = 0
    for axis in axes:
        while k < len(left) and left[k] == 1:
            k += 1
        n = mesh.axis_size(axis)
        if k >= len(left) or left[k] % n:
            return None
        out[k].append(axis)
        left[k] //= n
    return tuple(tuple(s) for s in out)
