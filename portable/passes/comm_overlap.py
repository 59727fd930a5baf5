"""`comm-overlap`: bucket gradient collectives and schedule every collective to overlap compute.

Runs on per-rank programs (the output of `spmd-partition`), where every collective's result
passes through its own `portable.wait`. Collectives are asynchronous between the two, so their
placement decides how much communication hides behind compute. The pass

1. **buckets** gradient reductions: all-reduces (and FSDP reduce-scatters) with reduce op sum or
   avg, of the same axis, group size, op and dtype, in the order their inputs are produced, into
   buckets of at most `bucket_mb` MiB; one collective per bucket::

       all_reduce(a), all_reduce(b)  ->  flat = cat([reshape(a, [-1]), reshape(b, [-1])])
                                         r = wait(all_reduce(flat))
                                         a' = view(slice(r, 0, 0, |a|), a.shape), b' = ...

       reduce_scatter(a, dim d)      ->  each member as [group, -1] chunks along d
                                         (permute d first, reshape), cat along dim 1,
                                         reduce_scatter along dim 0, slice dim 1, view and
                                         permute back: rank i keeps chunk i of every member

   Bucketing is exact: a sum or mean is elementwise, concatenation only changes which call
   carries an element. A tensor joins a bucket only when the bucket's results are not needed
   before the tensor is produced (so the bucket can be issued before its first use);
2. **issues** every collective as soon as its inputs exist (right after the last producer, in
   graph order), and moves every `portable.wait` to just before the first use of its value;
3. **prefetches** FSDP parameter all-gathers (an all-gather of a parameter placeholder) one
   layer ahead: a gather first used in layer L is issued where layer L-1 starts (layers are
   the numbered module prefixes of `meta["source"]`, `blocks.3`, else the top-level module), or
   later when issuing it there would make the bytes gathered but not yet used exceed
   `memory_cap_mb` MiB at any point; a gather that alone exceeds the cap is issued just before
   its use (noted). Every other collective is issued as soon as its input exists.

Compute ops keep their relative order; only collectives, waits and the bucket's packing nodes
move. A program without collectives is returned unchanged.

Cost model (for the report; it does not steer the schedule): `comm_cost.py`, a single rank whose
compute ops run serially at `tflops` and whose collectives share one link (`latency_us` +
ring bytes / `link_gb_s`); a wait stalls compute until its collective is done. Counts
`exposed-ns-before` / `exposed-ns-after` are the summed stalls of the program before and after
the pass; `comm-ns` the link's busy time.

Counts: `buckets` (multi-tensor buckets created), `bucketed` (collectives merged into them),
`prefetched` (parameter all-gathers issued before the compute that precedes their use),
`moved` (collectives or waits whose position changed), the three cost-model numbers, and
`cap-exceeded` (gathers larger than the memory cap). Notes: one per bucket (its tensors, bytes,
where issued and waited) and one per prefetched gather. The schedule is also recorded as
`metadata["comm_overlap"]`; `Program.spmd.collectives` lists the collectives left.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.fx

from portable.errors import PassError
from portable.ir.program import Program
from portable.ir.rewriter import Rewriter
from portable.ir.signature import InputKind, TensorSpec
from portable.ir.source import SourceLoc
from portable.ir.spmd import Collective
from portable.opset import bind

from .base import Pass, PassResult
from .comm_cost import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    COLLECTIVES,
    REDUCE_SCATTER,
    WAIT,
    estimate_exposed,
)
from .comm_cost import (
    nbytes as node_bytes,
)

__all__ = ["CommOverlap"]

NAME = "comm-overlap"
MIB = 1 << 20
aten = torch.ops.aten
_p = torch.ops.portable
_OP_NAMES = {
    ALL_REDUCE: "all_reduce",
    ALL_GATHER: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
    ALL_TO_ALL: "all_to_all",
}
_LAYER = re.compile(r"^(.*?\.\d+)(?:\.|$)")


@dataclasses.dataclass(frozen=True)
class CommOverlap(Pass):
    """Options: `bucket_mb` (bucket size, MiB), `memory_cap_mb` (most bytes of prefetched,
    not yet used parameter gathers, MiB); the cost model's `link_gb_s` (GB/s per link),
    `latency_us` (per collective) and `tflops` (compute rate). See the module docstring."""

    name = NAME
    bucket_mb: float = 25.0
    memory_cap_mb: float = 1024.0
    link_gb_s: float = 25.0
    latency_us: float = 10.0
    tflops: float = 50.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("bucket_mb", "memory_cap_mb", "link_gb_s", "tflops"):
            if getattr(self, field) <= 0:
                raise PassError(
                    f"option {field} of {NAME} must be positive, got {getattr(self, field)}",
                    pass_name=NAME,
                    fix=f"pass {field}=<a positive number>",
                )

    def apply(self, program: Program) -> PassResult:
        if not any(n.target in COLLECTIVES for n in program.graph.nodes):
            return PassResult(program, self.report(False, notes=["no collectives: nothing to do"]))
        before = estimate_exposed(program.graph, self.tflops, self.link_gb_s, self.latency_us)
        out = program.replace()
        params = {i.name for i in out.signature.inputs if i.kind is InputKind.PARAMETER}
        sched = _Scheduler(out.graph, self, params)
        sched.run()
        after = estimate_exposed(out.graph, self.tflops, self.link_gb_s, self.latency_us)
        counts = {
            "buckets": len([b for b in sched.buckets if len(b.members) > 1]),
            "bucketed": sum(len(b.members) for b in sched.buckets if len(b.members) > 1),
            "prefetched": sched.prefetched,
            "moved": sched.moved,
            "cap-exceeded": sched.cap_exceeded,
            "exposed-ns-before": before["exposed_ns"],
            "exposed-ns-after": after["exposed_ns"],
            "comm-ns": after["comm_ns"],
        }
        if not sched.changed:
            return PassResult(program, self.report(False, counts, ["schedule already optimal"]))
        out.graph.lint()
        out.graph_module.recompile()
        out.metadata["comm_overlap"] = {
            "options": self.options(),
            "buckets": [b.to_json() for b in sched.buckets if len(b.members) > 1],
            "prefetch": sched.prefetch_notes,
            "estimate": {"before": before, "after": after},
        }
        _update_spmd_collectives(out, sched)
        return PassResult(out, self.report(True, counts, sched.notes))


# ---------------------------------------------------------------------------- scheduling


class _BucketKey(NamedTuple):
    """What collectives must share to be merged into one bucket."""

    op: torch._ops.OpOverload  # ALL_REDUCE or REDUCE_SCATTER
    reduce_op: str
    axis: str
    group_size: int
    dtype: torch.dtype


@dataclasses.dataclass
class _Bucket:
    key: _BucketKey
    members: list[torch.fx.Node]  # the original collective nodes, in producer order
    nbytes: int = 0
    first_use: int = 0  # earliest original position where a member's result is needed
    collective: torch.fx.Node | None = None
    wait: torch.fx.Node | None = None
    names: list[str] = dataclasses.field(default_factory=list)
    issued_after: str = ""
    waited_before: str = ""

    def issued(self) -> tuple[torch.fx.Node, torch.fx.Node]:
        """The bucket's collective and its wait (every bucket has them once
        `_Scheduler._bucket` has run)."""
        assert self.collective is not None and self.wait is not None, "bucket not issued yet"
        return self.collective, self.wait

    def to_json(self) -> dict[str, Any]:
        return {
            "collective": self.collective.name if self.collective is not None else None,
            "op": _OP_NAMES[self.key.op],
            "reduce_op": self.key.reduce_op,
            "axis": self.key.axis,
            "group_size": self.key.group_size,
            "tensors": list(self.names),
            "bytes": self.nbytes,
            "issued_after": self.issued_after,
            "waited_before": self.waited_before,
        }


class _Scheduler:
    def __init__(self, graph: torch.fx.Graph, opts: CommOverlap, params: set[str]) -> None:
        self.graph = graph
        self.params = params
        self.opts = opts
        self.order = list(graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.order)}
        self.buckets: list[_Bucket] = []
        self.notes: list[str] = []
        self.prefetch_notes: list[dict[str, Any]] = []
        self.prefetched = 0
        self.cap_exceeded = 0
        self.moved = 0
        self.changed = False
        self.removed: list[str] = []  # collectives merged into buckets
        # collective -> its wait (collectives used other than through one wait are left alone)
        self.wait_of: dict[torch.fx.Node, torch.fx.Node] = {}
        for n in self.order:
            if n.target in COLLECTIVES and len(n.users) == 1:
                (user,) = n.users
                if user.target is WAIT:
                    self.wait_of[n] = user

    def run(self) -> None:
        self._bucket()
        anchors = self._prefetch()
        self._reorder(anchors)

    # ------------------------------------------------------------------ 1. buckets

    def _first_use(self, value: torch.fx.Node) -> int:
        """Original position of the first op that needs `value` (through new packing nodes)."""
        found = [self.pos[u] if u in self.pos else self._first_use(u) for u in value.users]
        return min(found, default=len(self.order) - 1)

    def _bucket(self) -> None:
        limit = self.opts.bucket_mb * MIB
        open_: dict[_BucketKey, _Bucket] = {}
        candidates = [(c, k) for c in self.wait_of if (k := _bucket_key(c)) is not None]
        candidates.sort(key=lambda ck: self.pos[_operand(ck[0])])
        for c, key in candidates:
            x = _operand(c)
            nbytes = node_bytes(x)
            produced = self.pos[x]
            first_use = self._first_use(self.wait_of[c])
            b = open_.get(key)
            if b is None or b.nbytes + nbytes > limit or b.first_use <= produced:
                b = _Bucket(key, [], first_use=first_use)
                open_[key] = b
                self.buckets.append(b)
            b.members.append(c)
            b.nbytes += nbytes
            b.first_use = min(b.first_use, first_use)
        for b in self.buckets:
            b.names = [_operand(c).name for c in b.members]
            if len(b.members) > 1:
                self._merge(b)
            else:
                b.collective, b.wait = b.members[0], self.wait_of[b.members[0]]

    def _merge(self, b: _Bucket) -> None:
        """Replace the bucket's collectives by one over their concatenation (module doc)."""
        op, reduce_op, axis, group, _dtype = b.key
        src = _source(b.members[-1])
        g = self.graph
        last = b.members[-1]
        with g.inserting_before(last):
            parts = []
            for c in b.members:
                x = _operand(c)
                if op is ALL_REDUCE:
                    parts.append(_new(g, aten.reshape.default, (x, [-1]), src))
                else:
                    moved = _movedim_first(g, x, _scatter_dim(c), src)
                    parts.append(_new(g, aten.reshape.default, (moved, [group, -1]), src))
            cat = _new(g, aten.cat.default, (parts, 0 if op is ALL_REDUCE else 1), src)
            if op is ALL_REDUCE:
                coll = _new(g, ALL_REDUCE, (cat, reduce_op, axis, group), src)
            else:
                coll = _new(g, REDUCE_SCATTER, (cat, reduce_op, 0, axis, group), src)
            wait = _new(g, WAIT, (coll,), src)
            offset = 0
            for c in b.members:
                old_wait = self.wait_of[c]
                shape = list(old_wait.meta["tensor"].shape)
                if op is ALL_REDUCE:
                    n = math.prod(shape)
                    piece = _new(g, aten.slice.Tensor, (wait, 0, offset, offset + n), src)
                    value = _new(g, aten.view.default, (piece, shape), src)
                else:
                    d = _scatter_dim(c) % len(shape)
                    n = math.prod(shape)
                    piece = _new(g, aten.slice.Tensor, (wait, 1, offset, offset + n), src)
                    chunk_shape = [shape[d], *shape[:d], *shape[d + 1 :]]
                    value = _new(g, aten.view.default, (piece, chunk_shape), src)
                    if d != 0:
                        inverse = [*range(1, d + 1), 0, *range(d + 1, len(shape))]
                        value = _new(g, aten.permute.default, (value, inverse), src)
                        # contiguous like the collective's own result, so later reductions
                        # sum in the same order
                        value = _new(
                            g,
                            aten.clone.default,
                            (value,),
                            src,
                            {"memory_format": torch.contiguous_format},
                        )
                offset += n
                old_wait.replace_all_uses_with(value)
        for c in b.members:
            g.erase_node(self.wait_of.pop(c))
            g.erase_node(c)
            self.removed.append(c.name)
        b.collective, b.wait = coll, wait
        self.wait_of[coll] = wait
        self.changed = True

    # ------------------------------------------------------------------ 3. prefetch

    def _prefetch(self) -> dict[torch.fx.Node, int]:
        """Parameter all-gather -> the original position it is issued before (module doc)."""
        gathers = [c for c in self.wait_of if c.target is ALL_GATHER and self._is_param(c)]
        if not gathers:
            return {}
        starts = self._layer_starts()
        cap = self.opts.memory_cap_mb * MIB
        first_compute = next(i for i, n in enumerate(self.order) if n.op != "placeholder")
        plan = []
        for c in gathers:
            use = self._first_use(self.wait_of[c])
            earlier = [s for s in starts if s <= use]
            target = earlier[-2] if len(earlier) >= 2 else first_compute
            plan.append((min(target, use), use, node_bytes(self.wait_of[c]), c))
        plan.sort(key=lambda t: (t[0], t[1]))
        placed: list[tuple[int, int, int]] = []  # (issue, use, bytes)

        def peak(lo: int, hi: int) -> int:
            points = {lo} | {p for i, _, _ in placed for p in (i,) if lo <= p <= hi}
            return max(sum(b for i, u, b in placed if i <= t <= u) for t in points)

        anchors: dict[torch.fx.Node, int] = {}
        for target, use, nbytes, c in plan:
            options = [target, *sorted({u + 1 for _, u, _ in placed if target < u + 1 < use}), use]
            issue = next((p for p in options if peak(p, use) + nbytes <= cap), use)
            if nbytes > cap:
                self.cap_exceeded += 1
            placed.append((issue, use, nbytes))
            anchors[c] = issue
            if issue < use:
                self.prefetched += 1
                before, tensor = self.order[issue].name, _operand(c).name
                self.prefetch_notes.append(
                    {
                        "collective": c.name,
                        "tensor": tensor,
                        "bytes": nbytes,
                        "issued_before": before,
                        "first_use": self.order[use].name,
                    }
                )
                self.notes.append(
                    f"prefetch {tensor} ({nbytes} bytes): issued before %{before}, "
                    f"first used by %{self.order[use].name}"
                )
        return anchors

    def _is_param(self, gather: torch.fx.Node) -> bool:
        """Whether `gather` gathers a parameter placeholder."""
        x = _operand(gather)
        return x.op == "placeholder" and x.name in self.params

    def _layer_starts(self) -> list[int]:
        """Original positions where a new layer's compute starts."""
        starts, current = [], None
        for i, n in enumerate(self.order):
            if n.op != "call_function" or n.target in COLLECTIVES or n.target is WAIT:
                continue
            layer = _layer_of(n)
            if layer is None or layer == current:
                continue
            current = layer
            starts.append(i)
        return starts

    # ------------------------------------------------------------------ 2. issue early, wait late

    def _reorder(self, anchors: dict[torch.fx.Node, int]) -> None:
        """New order: compute nodes in their order; a collective as soon as its inputs exist
        (prefetched gathers: at their anchor); a wait (and a bucket's unpacking) when first
        needed."""
        graph = self.graph
        nodes = list(graph.nodes)
        movable = set(self.wait_of) | set(self.wait_of.values())
        new_nodes = {n for n in nodes if n not in self.pos}  # bucket packing and unpacking
        deferred = movable | new_nodes
        by_anchor: dict[int, list[torch.fx.Node]] = {}
        for c, p in anchors.items():
            by_anchor.setdefault(p, []).append(c)
        emitted: set[torch.fx.Node] = set()
        order: list[torch.fx.Node] = []
        placeholders_done = False

        def inputs(n: torch.fx.Node) -> Iterable[torch.fx.Node]:
            return n.all_input_nodes

        def ready(c: torch.fx.Node) -> bool:
            stack = list(inputs(c))
            while stack:
                x = stack.pop()
                if x in emitted:
                    continue
                if x in new_nodes and x.target is not WAIT:
                    stack.extend(inputs(x))
                    continue
                return False
            return True

        def emit(n: torch.fx.Node) -> None:
            if n in emitted:
                return
            for x in inputs(n):
                emit(x)
            emitted.add(n)
            order.append(n)
            if placeholders_done:
                flush(n)

        def flush(n: torch.fx.Node) -> None:
            for c in self._collectives_fed_by(n):
                if c not in emitted and c not in anchors and ready(c):
                    emit(c)

        due = sorted(by_anchor.items())
        for n in nodes:
            if n in deferred:
                continue
            if n.op != "placeholder" and not placeholders_done:
                placeholders_done = True
                for x in list(order):
                    flush(x)
            while due and due[0][0] <= self.pos[n]:  # prefetched gathers issued before n
                for c in due.pop(0)[1]:
                    emit(c)
            emit(n)
        for n in nodes:  # nothing should remain; keeps every node if something does
            emit(n)
        output = graph.output_node()
        for n in order:
            if n is not output:
                output.prepend(n)
        if order != nodes:
            self.changed = True
        self.moved = _count_moved(nodes, order, movable)
        self._describe(order)

    def _collectives_fed_by(self, n: torch.fx.Node) -> list[torch.fx.Node]:
        """Collectives (with a wait) whose input is `n`, directly or through packing nodes."""
        out, stack, seen = [], list(n.users), set()
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            if u in self.wait_of:
                out.append(u)
            elif u not in self.pos and u.target is not WAIT and u.op == "call_function":
                stack.extend(u.users)  # a bucket's packing node
        return out

    def _describe(self, order: list[torch.fx.Node]) -> None:
        index = {n: i for i, n in enumerate(order)}
        compute = [
            n
            for n in order
            if n.op == "call_function"
            and n.target not in COLLECTIVES
            and n.target is not WAIT
            and n in self.pos
        ]
        for k, b in enumerate(self.buckets):
            if len(b.members) < 2:
                continue
            collective, wait = b.issued()
            i, w = index[collective], index[wait]
            after = [n for n in compute if index[n] < i]
            nxt = [n for n in compute if index[n] > w] or [order[-1]]
            b.issued_after = after[-1].name if after else "<start>"
            b.waited_before = nxt[0].name
            op = _OP_NAMES[b.key.op]
            self.notes.append(
                f"bucket {k}: {op}({b.key.reduce_op}) over {b.key.axis}, {len(b.members)} tensors "
                f"[{', '.join(b.names)}], {b.nbytes} bytes: issued after %{b.issued_after}, "
                f"waited before %{b.waited_before}"
            )


# ---------------------------------------------------------------------------- helpers


def _operand(c: torch.fx.Node) -> torch.fx.Node:
    """The tensor a collective (or a wait) reads."""
    return bind(c).node("x")


def _scatter_dim(c: torch.fx.Node) -> int:
    """The dim a reduce-scatter scatters along."""
    return bind(c).literal("dim")


def _bucket_key(c: torch.fx.Node) -> _BucketKey | None:
    """The key of a bucketable collective (an all-reduce or reduce-scatter that sums or averages
    a tensor with a TensorSpec), else None."""
    op = c.target
    if not isinstance(op, torch._ops.OpOverload) or op not in (ALL_REDUCE, REDUCE_SCATTER):
        return None
    b = bind(c)
    x = b.get("x")
    if not isinstance(x, torch.fx.Node) or not isinstance(spec := x.meta.get("tensor"), TensorSpec):
        return None
    reduce_op = b.literal("reduce_op")
    if reduce_op not in ("sum", "avg"):
        return None
    return _BucketKey(op, reduce_op, b.literal("axis"), b.literal("group_size"), spec.dtype)


def _layer_of(node: torch.fx.Node) -> str | None:
    src = node.meta.get("source")
    module = getattr(src, "module", None)
    if not module or module in ("<root>", "model"):
        return None
    m = _LAYER.match(module)
    if m:
        return m.group(1)
    top = module.split(".")[0]
    return None if top.startswith("optimizer") else top


def _source(node: torch.fx.Node) -> SourceLoc:
    """`node`'s source line, else its operand's, else this pass's (`node` is a collective)."""
    src = node.meta.get("source")
    if src is None:
        x = bind(node).get("x")
        src = x.meta.get("source") if isinstance(x, torch.fx.Node) else None
    return src if src is not None else SourceLoc(module=NAME)


def _movedim_first(g: torch.fx.Graph, x: torch.fx.Node, dim: int, src: SourceLoc) -> torch.fx.Node:
    rank = len(x.meta["tensor"].shape)
    d = dim % rank
    if d == 0:
        return x
    perm = [d, *range(d), *range(d + 1, rank)]
    return _new(g, aten.permute.default, (x, perm), src)


def _new(
    g: torch.fx.Graph,
    target: torch._ops.OpOverload,
    args: tuple[Any, ...],
    src: SourceLoc,
    kwargs: dict[str, Any] | None = None,
) -> torch.fx.Node:
    """A call node with meta["tensor"] / meta["val"] from the fake kernel on its inputs'
    per-rank specs, and `src` (torch.fx's default node names)."""
    return Rewriter(g).call(target, args, kwargs, source=src, fake="specs", name=None)


def _count_moved(
    old: list[torch.fx.Node], new: list[torch.fx.Node], movable: set[torch.fx.Node]
) -> int:
    """Movable nodes whose set of preceding non-movable nodes changed."""

    def anchors(order: list[torch.fx.Node]) -> dict[torch.fx.Node, int]:
        seen, out = 0, {}
        for n in order:
            if n in movable:
                out[n] = seen
            else:
                seen += 1
        return out

    a, b = anchors(old), anchors(new)
    return sum(1 for n, k in b.items() if a.get(n) != k)


def _update_spmd_collectives(out: Program, sched: _Scheduler) -> None:
    """The layout's collectives: the bucketed members replaced by their bucket's collective."""
    if out.spmd is None:
        return
    removed = set(sched.removed)
    kept = [c for c in out.spmd.collectives if c.node not in removed]
    for b in sched.buckets:
        if len(b.members) > 1:
            collective, _ = b.issued()
            op, axis, size = _OP_NAMES[b.key.op], b.key.axis, b.key.group_size
            kept.append(Collective(collective.name, op, axis, size, b.nbytes))
    out.spmd = out.spmd.with_collectives(kept)
