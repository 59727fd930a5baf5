"""The cost model of `comm-overlap`'s report (it does not steer the schedule).

One rank: compute ops run one after another, each taking `FLOPs / (tflops * 1e12)` seconds, where
FLOPs are 2*M*N*K for matrix products (mm, addmm, bmm, baddbmm), 4*|q|*Lk for attention, 0 for
views and one per output element for everything else. Collectives share one link and run one at
a time in issue order, each taking `latency_us + wire_bytes / link_gb_s`, with ring wire bytes:
all-reduce 2(n-1)/n x its bytes, all-gather (n-1)/n x the gathered bytes, reduce-scatter and
all-to-all (n-1)/n x their input bytes (n the group size; shared/reference/hardware.md). A
collective starts at its issue point (or when the link frees) and is exposed for however long a
`wait` has to stall the compute stream for it. This ignores memory bandwidth, kernel launch
overheads and contention of compute with communication.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx

from portable.ir.signature import TensorSpec
from portable.opset import bind
from portable.opset.table import PERMUTE, RESHAPE, UNIT_DIM, ops_with

__all__ = ["COLLECTIVES", "WAIT", "estimate_exposed", "flops", "nbytes", "wire_bytes"]

aten = torch.ops.aten
_p = torch.ops.portable
ALL_REDUCE = _p.all_reduce.default
ALL_GATHER = _p.all_gather.default
REDUCE_SCATTER = _p.reduce_scatter.default
ALL_TO_ALL = _p.all_to_all.default
WAIT = _p.wait.default
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)


def estimate_exposed(
    graph: torch.fx.Graph, tflops: float, link_gb_s: float, latency_us: float
) -> dict[str, int]:
    """The model over `graph` in its order: exposed and total communication time, and compute
    time, in nanoseconds."""
    t = 0.0
    link_free = 0.0
    done: dict[torch.fx.Node, float] = {}
    exposed = comm = compute = 0.0
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in COLLECTIVES:
            cost = latency_us * 1e-6 + wire_bytes(n) / (link_gb_s * 1e9)
            start = max(t, link_free)
            link_free = done[n] = start + cost
            comm += cost
        elif n.target is WAIT and bind(n).x in done:
            end = done[bind(n).x]
            if end > t:
                exposed += end - t
                t = end
        else:
            step = flops(n) / (tflops * 1e12)
            t += step
            compute += step
    return {
        "exposed_ns": round(exposed * 1e9),
        "comm_ns": round(comm * 1e9),
        "compute_ns": round(compute * 1e9),
    }


_FREE = ops_with(RESHAPE, PERMUTE, UNIT_DIM) | {
    aten.expand.default,
    aten.slice.Tensor,
    aten.split_with_sizes.default,
    operator.getitem,
}
# the operand whose last dim is the contraction, per matrix product
_MATMULS = {
    aten.mm.default: "self",
    aten.bmm.default: "self",
    aten.addmm.default: "mat1",
    aten.baddbmm.default: "batch1",
}
# (the operand counted, the one whose dim -2 is the other length): 4*|q|*Lk for the forward;
# the backward is estimated as 4*|grad|*Lq
_ATTENTION = {
    torch.ops.portable.attention.default: ("q", "k"),
    torch.ops.portable.attention_backward.default: ("grad", "q"),
    torch.ops.portable.attention_backward.mask_grad: ("grad", "q"),
}


def flops(node: torch.fx.Node) -> int:
    """FLOPs of one op in the cost model: 2*M*N*K for matrix products, 4*|q|*Lk for attention,
    0 for views, one per output element otherwise."""
    if node.target in _FREE:
        return 0
    out = numel(node.meta.get("tensor"))
    if node.target in _MATMULS:
        a = bind(node)[_MATMULS[node.target]]
        k = a.meta["tensor"].shape[-1] if isinstance(a, torch.fx.Node) else 1
        return 2 * out * int(k)
    if node.target in _ATTENTION:
        q, k = (bind(node)[name] for name in _ATTENTION[node.target])
        if isinstance(q, torch.fx.Node) and isinstance(k, torch.fx.Node):
            return 4 * numel(q.meta.get("tensor")) * int(k.meta["tensor"].shape[-2])
    return out


def wire_bytes(node: torch.fx.Node) -> float:
    """Bytes one rank moves in a ring implementation of `node` (module doc)."""
    group = int(bind(node).group_size)
    if group <= 1:
        return 0.0
    frac = (group - 1) / group
    if node.target is ALL_REDUCE:
        return 2 * frac * nbytes(bind(node).x)
    if node.target is ALL_GATHER:
        return frac * nbytes(node)
    return frac * nbytes(bind(node).x)


def numel(spec: Any) -> int:
    if isinstance(spec, TensorSpec):
        return math.prod(int(s) if isinstance(s, int) else 1 for s in spec.shape)
    if isinstance(spec, tuple):
        return sum(numel(s) for s in spec)
    return 0


def nbytes(node: torch.fx.Node) -> int:
    spec = node.meta.get("tensor")
    return numel(spec) * spec.dtype.itemsize if isinstance(spec, TensorSpec) else 0
