"""Insert the collectives that change a value's sharding (`Sharding`) into another.

    partial -> replicated       all_reduce            (then wait)
    partial -> split on dim d   reduce_scatter(d)     (when d's minor-most axis is the partial one)
    split   -> replicated       all_gather(d)         (minor-most axis first)
    replicated -> split         local_shard(d)        (no communication), or the value
                                                      recomputed at the local size when its
                                                      producers allow (`localize.py`)

Every collective is followed by its own `portable.wait`. Results are cached per (value, target),
so a value gathered for the forward is reused by every later consumer.

A merged dim whose rows are not a contiguous chunk (`merges.py`: context-parallel tokens
flattened with the batch) is never the dim of a collective: it is viewed locally as the dims it
merges, the collective or slice runs on those, and the result is viewed as the merged dim again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx

from portable.errors import PassError
from portable.ir.plan import Mesh
from portable.ir.rewriter import Rewriter
from portable.ir.sharding import Sharding
from portable.ir.spmd import Collective

from .localize import localize
from .merges import Merge
from .rules.base import ResultSharding, single

__all__ = ["Collective", "Redistributor"]

_ops = torch.ops.portable
aten = torch.ops.aten


class Redistributor:
    """Rewrites values of `graph` (whose global shapes are known) into requested shardings."""

    def __init__(self, graph: torch.fx.Graph, mesh: Mesh, pass_name: str) -> None:
        self.graph = graph
        self.rewriter = Rewriter(graph)
        self.mesh = mesh
        self.pass_name = pass_name
        self.sharding: dict[torch.fx.Node, ResultSharding] = {}
        self.global_shape: dict[torch.fx.Node, tuple[int, ...]] = {}
        self.dtype: dict[torch.fx.Node, torch.dtype] = {}
        self.collectives: list[Collective] = []
        self.localized: list[str] = []  # values recomputed at the local size (localize.py)
        # dims whose rows are a merge's, not a contiguous chunk (merges.py), per value; and per
        # element of a tuple-valued node
        self.merged: dict[torch.fx.Node, Mapping[int, Merge]] = {}
        self.merged_items: dict[torch.fx.Node, tuple[Mapping[int, Merge], ...]] = {}
        self._cache: dict[tuple[Any, ...], torch.fx.Node] = {}

    # ------------------------------------------------------------------------------ public

    def to(
        self,
        value: torch.fx.Node,
        want: Sharding,
        before: torch.fx.Node,
        merges: Mapping[int, Merge] | None = None,
    ) -> torch.fx.Node:
        """`value` in sharding `want`, computed by collectives inserted before `before`;
        `merges` are the dims of `want` whose rows are a merge's, not a contiguous chunk
        (`merges.py`; none: every split is contiguous)."""
        have = single(value, self.sharding[value])
        wanted = dict(merges or {})
        if have == want and dict(self.merged.get(value, {})) == wanted:
            return value
        key = (value, want, tuple(sorted(wanted.items(), key=lambda kv: kv[0])))
        if key in self._cache:
            return self._cache[key]
        node = value
        with self.graph.inserting_before(before):
            for d, m in list(self.merged.get(value, {}).items()):
                if wanted.get(d) != m or want.dims[d] != m.axes:
                    node = self._unmerge(node, d, m, before)
            pending = {d: m for d, m in wanted.items() if self.merged.get(node, {}).get(d) != m}
            if len(pending) > 1:
                raise PassError(
                    f"{value.name} is asked for with {len(pending)} merged dims "
                    f"({sorted(pending)}); the pass makes one per value",
                    pass_name=self.pass_name,
                    fix="this is a bug in the context-parallel merge tracking; report the "
                    "program and plan, and meanwhile drop context_axis",
                )
            if pending:
                ((d, m),) = pending.items()
                node = self._merge(node, want, d, m, before)
            else:
                node = self._plain(node, want, before)
        self._cache[key] = node
        return node

    def _plain(self, value: torch.fx.Node, want: Sharding, before: torch.fx.Node) -> torch.fx.Node:
        """`value` in `want` when their merged dims agree (the collectives work on the others)."""
        have = single(value, self.sharding[value])
        if have == want:
            return value
        key = (value, want, tuple(sorted(self.merged.get(value, {}).items())))
        if key in self._cache:
            return self._cache[key]
        if _refines(have, want) and not self.merged.get(value):
            local = localize(self, value, want, before)
            if local is not None:
                self.localized.append(value.name)
                self._cache[key] = local
                return local
        shape = self.global_shape[value]
        dims = [list(d) for d in have.dims]
        partial = dict(have.partial)
        node = value
        with self.graph.inserting_before(before):
            # 1. pending reductions: into a split when the target splits a dim on that axis last,
            #    else a full all-reduce; reduce-scatters first, so the all-reduces of a value
            #    partial over several axes (a weight gradient under FSDP and context
            #    parallelism) move the shard only
            for axis, op in sorted(partial.items(), key=lambda p: want.dim_of(p[0]) is None):
                if want.partial_op(axis) == op:
                    continue
                target_dim = want.dim_of(axis)
                if (
                    target_dim is not None
                    and want.dims[target_dim][-1] == axis
                    and dims[target_dim] == list(want.dims[target_dim][:-1])
                    and op in ("sum", "avg")
                ):
                    node = self._emit(
                        "reduce_scatter",
                        node,
                        shape,
                        dims,
                        partial,
                        axis,
                        reduce_op=op,
                        dim=target_dim,
                    )
                    dims[target_dim].append(axis)
                else:
                    node = self._emit("all_reduce", node, shape, dims, partial, axis, reduce_op=op)
                del partial[axis]
            # 2. gathers: per dim, everything after the common prefix, minor-most first
            for d in range(len(dims)):
                keep = _common_prefix(dims[d], want.dims[d])
                while len(dims[d]) > keep:
                    axis = dims[d][-1]
                    node = self._emit("all_gather", node, shape, dims, partial, axis, dim=d)
                    dims[d].pop()
            # 3. local shards: per dim, the target's axes after the prefix, major first
            for d in range(len(dims)):
                for axis in want.dims[d][len(dims[d]) :]:
                    node = self._emit("local_shard", node, shape, dims, partial, axis, dim=d)
                    dims[d].append(axis)
        if partial != dict(want.partial):
            raise PassError(
                f"cannot make a partial value from {have} (wanted {want})",
                pass_name=self.pass_name,
                fix="this is a bug in a sharding rule; report the program and plan",
            )
        self._cache[key] = node
        return node

    # ------------------------------------------------------------------------- merged dims

    def _unmerge(
        self, value: torch.fx.Node, d: int, m: Merge, before: torch.fx.Node
    ) -> torch.fx.Node:
        """`value` with its merged dim `d` whole: viewed locally as the dims it merges, those
        gathered, viewed as the merged dim again (all local views; collectives on real dims)."""
        have = single(value, self.sharding[value])
        split = self._view(value, _expand(have, d, m.splits), _expand_shape(self, value, d, m))
        whole = self._plain(split, _expand(have, d, ((),) * len(m.sizes)), before)
        return self._view(whole, _replace(have, d, ()), self.global_shape[value])

    def _merge(
        self, value: torch.fx.Node, want: Sharding, d: int, m: Merge, before: torch.fx.Node
    ) -> torch.fx.Node:
        """`value` in `want` with dim `d` merged as `m`: the dim made whole (a partial sum over
        a merge axis stays pending), viewed as the dims it merges, split there (reduce-scatter
        or local slice), viewed as the merged dim."""
        have = single(value, self.sharding[value])
        pending = {a: op for a, op in have.partial if a in m.axes and op in ("sum", "avg")}
        middle = Sharding(
            _replace(want, d, ()).dims, tuple(sorted({**dict(want.partial), **pending}.items()))
        )
        whole = self._plain(value, middle, before)
        global_split = _expand_shape(self, whole, d, m)
        split = self._view(whole, _expand(middle, d, ((),) * len(m.sizes)), global_split)
        target = Sharding(_expand(want, d, m.splits).dims, want.partial)
        local = self._plain(split, target, before)
        node = self._view(local, want, self.global_shape[value])
        self.merged[node] = {d: m}
        return node

    def _view(
        self, value: torch.fx.Node, sharding: Sharding, shape: tuple[int, ...]
    ) -> torch.fx.Node:
        """A local view of `value` as a value of global `shape` split as `sharding`."""
        local = list(sharding.local_shape(shape, self.mesh))
        node = self.rewriter.call(
            aten.view.default, (value, local), like=value, fake="none", name=None
        )
        self.record(node, sharding, shape, self.dtype[value])
        return node

    def record(
        self, node: torch.fx.Node, sharding: Sharding, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        """Register a node this pass created: its sharding, global shape and dtype."""
        self.sharding[node] = sharding
        self.global_shape[node] = shape
        self.dtype[node] = dtype

    # ------------------------------------------------------------------------------ helpers

    def _emit(
        self,
        op: str,
        value: torch.fx.Node,
        shape: tuple[int, ...],
        dims: list[list[str]],
        partial: dict[str, str],
        axis: str,
        *,
        reduce_op: str | None = None,
        dim: int | None = None,
    ) -> torch.fx.Node:
        """`op` over `axis` of `value` (sharded as `dims` and `partial`, global `shape`), then
        its wait; `dim` is the dim it splits or gathers (None for all_reduce), `reduce_op` the
        reduction of all_reduce and reduce_scatter. Returns the value after the wait."""
        size = self.mesh.axis_size(axis)
        before = Sharding(tuple(tuple(d) for d in dims), tuple(sorted(partial.items())))
        local = before.local_shape(shape, self.mesh)
        dtype = self.dtype[value]
        nbytes = math.prod(local) * dtype.itemsize
        args: tuple[object, ...]
        if op == "all_reduce":
            target, args = _ops.all_reduce.default, (value, reduce_op, axis, size)
        elif op == "reduce_scatter":
            target, args = _ops.reduce_scatter.default, (value, reduce_op, dim, axis, size)
        elif op == "all_gather":
            target, args = _ops.all_gather.default, (value, dim, axis, size)
        else:
            target, args = _ops.local_shard.default, (value, dim, axis, size)
        # per-rank shapes in a graph of global ones: values are inferred after the pass
        call = self.rewriter.call(target, args, like=value, fake="none", name=None)
        if op == "local_shard":
            result = call
        else:
            self.collectives.append(Collective(call.name, op, axis, size, nbytes))
            result = self.rewriter.call(
                _ops.wait.default, (call,), like=value, fake="none", name=None
            )
        after_dims = [list(d) for d in dims]
        after_partial = dict(partial)
        if op in ("all_reduce", "reduce_scatter"):
            after_partial.pop(axis)
        if dim is not None and op == "all_gather":
            after_dims[dim].pop()
        elif dim is not None:  # reduce_scatter, local_shard: split dim over axis
            after_dims[dim].append(axis)
        after = Sharding(tuple(tuple(d) for d in after_dims), tuple(sorted(after_partial.items())))
        kept = {d: m for d, m in self.merged.get(value, {}).items() if after.dims[d] == m.axes}
        for n in {call, result}:
            self.record(n, after, shape, dtype)
            if kept:
                self.merged[n] = kept
        return result


def _refines(have: Sharding, want: Sharding) -> bool:
    """Whether `want` only adds splits to `have` (neither partial)."""
    if have.partial or want.partial or have == want:
        return False
    return all(w[: len(h)] == h for h, w in zip(have.dims, want.dims, strict=True))


def _common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def _expand(s: Sharding, d: int, splits: Sequence[Sequence[str]]) -> Sharding:
    """`s` with dim `d` replaced by dims split as `splits` (a merged dim, unmerged)."""
    dims = s.dims[:d] + tuple(tuple(x) for x in splits) + s.dims[d + 1 :]
    return Sharding(dims, s.partial)


def _replace(s: Sharding, d: int, axes: tuple[str, ...]) -> Sharding:
    return Sharding(s.dims[:d] + (axes,) + s.dims[d + 1 :], s.partial)


def _expand_shape(red: Redistributor, value: torch.fx.Node, d: int, m: Merge) -> tuple[int, ...]:
    shape = red.global_shape[value]
    return shape[:d] + m.sizes + shape[d + 1 :]
