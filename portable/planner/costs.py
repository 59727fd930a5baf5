"""The costs of a training step, counted from its program, as functions of micro-batch and TP.

`count(program)` walks a captured training step (`portable.capture(..., loss_fn=...)`) and
sums, per **segment** (each repeated layer; `embed`, the ops before the first layer; `head`, the
ops after the last; `optimizer`) and phase (forward / backward):

- `flops`: matrix-product FLOPs (`portable.jobs.flops.node_flops`: 2 per multiply-add);
- `bytes`: HBM traffic of the memory-bound kernels. Elementwise ops, reductions and norms are
  grouped the way a fusing compiler (XLA, neuronx-cc, Inductor) or Megatron's fused kernels
  group them: a non-matmul op joins the kernel of each non-matmul producer in the same phase
  and layer, views join their producer's kernel and cost nothing, and a kernel moves the bytes
  of the values it reads from outside itself plus those it writes for readers outside itself;
- `kernels`: matmuls plus fused kernels (each pays the system's launch overhead);
- `collectives`: the kind and bytes of every collective the partitioner inserted;
- `saved`: bytes of the forward values the backward reads (activation memory), per
  recomputation policy (below);
- the same sums over the ops each policy recomputes.

**Scaling.** Every sum is linear in the micro-batch `b` (tokens) and, under tensor parallelism
of degree `t`, splits into a part every rank repeats and a part divided by `t`:
`q(b, t) = q0 + b q1 + (q2 + b q3) / t`. `counted(...)` measures the four coefficients from four
programs of the same model: micro-batch 1 and 2, each unpartitioned and partitioned by
`spmd-partition` at `t = 2` with the model's tensor-parallel rules. An op the partitioner
splits lands in the `/t` part and one it replicates (norms, residual adds, the loss) in the
repeated part, so the split is the program's own. Collective bytes are full-tensor sizes, the
same at every `t` (the wire time applies the ring factor of the group size).

**Recomputation policies** (Megatron-LM's, which the published runs use; planner-validation.md):
`none` saves every forward value the backward reads; `selective` (Korthikanti et al. 2022,
Megatron's `--recompute-granularity selective`) recomputes the core attention: the ops whose
results are attention-score shaped (last two dims the sequence length) and the ops reading them,
so the score, softmax and dropout tensors are not saved and their FLOPs and bytes run again in
the backward; `full` keeps only each layer's input and re-runs the layer's whole forward (its
collectives too) in the backward. Fused attention (`portable::attention`) has no score tensor:
`selective` then recomputes nothing, as with Megatron and flash attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from ..errors import PlannerError
from ..ir.liveness import liveness
from ..ir.program import Program
from ..ir.signature import InputKind, TensorSpec
from ..ir.source import source_of
from ..jobs.flops import node_flops
from ..opset import ops_with
from ..opset.table import COLLECTIVE, MATMUL, VIEW
from ..passes.remat import DEFAULT_LAYERS, step_parts
from .counted import (
    EMBED,
    HEAD,
    OPTIMIZER,
    POLICIES,
    Coeffs,
    Collective,
    Costs,
    Gemm,
    Segment,
    Work,
)

__all__ = ["count"]

_KERNEL_BYTES = 4096  # a fused group moving less is scalar bookkeeping, not a kernel launch

_portable = torch.ops.portable
_PLAIN_MATMULS = ops_with(MATMUL)
_MATMULS = _PLAIN_MATMULS | {
    _portable.attention.default,
    _portable.attention_backward.default,
    _portable.attention_backward.mask_grad,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten.convolution_backward.default,
}
_COLLECTIVES = ops_with(COLLECTIVE)
_FREE = ops_with(VIEW) | {operator.getitem, _portable.wait.default}
_KINDS = {
    _portable.all_reduce.default: "all_reduce",
    _portable.all_gather.default: "all_gather",
    _portable.reduce_scatter.default: "reduce_scatter",
    _portable.all_to_all.default: "all_to_all",
}


# --------------------------------------------------------------------------- one program


@dataclasses.dataclass
class _Sums:
    """Sums of one program (one (b, t) point)."""

    forward: dict[str, list[float]]  # segment -> [flops, bytes, kernels]
    backward: dict[str, list[float]]
    recompute: dict[tuple[str, str], list[float]]  # (segment, policy) -> [flops, bytes, kernels]
    mlp: dict[str, list[float]]
    saved: dict[tuple[str, str], float]
    collectives: dict[str, list[tuple[str, str, float]]]  # segment -> (kind, phase, bytes)
    params: dict[str, float]
    param_bytes: dict[str, float]
    optimizer: list[float]  # [bytes, kernels]
    order: list[str]
    # (segment, phase or policy) -> per matmul (flops, bytes, batch, rows, cols)
    gemms: dict[Any, list[tuple[float, ...]]] = dataclasses.field(default_factory=dict)


def _nbytes(node: object) -> float:
    if not isinstance(node, Node):
        return 0.0
    spec = node.meta.get("tensor")
    if isinstance(spec, TensorSpec):
        return float(math.prod(int(d) for d in spec.shape) * spec.dtype.itemsize)
    if isinstance(spec, tuple):
        return sum(
            float(math.prod(int(d) for d in s.shape) * s.dtype.itemsize)
            for s in spec
            if isinstance(s, TensorSpec)
        )
    return 0.0


def _score_shaped(node: Node, seq: int) -> bool:
    spec = node.meta.get("tensor")
    if not isinstance(spec, TensorSpec) or len(spec.shape) < 2:
        return False
    return int(spec.shape[-1]) == seq and int(spec.shape[-2]) == seq


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Node, Node] = {}

    def find(self, x: Node) -> Node:
        root = x
        while self.parent.get(root, root) is not root:
            root = self.parent[root]
        while self.parent.get(x, x) is not root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: Node, b: Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[ra] = rb


def _sums(program: Program, seq: int, layers: str) -> _Sums:
    parts = step_parts(program, layers)
    graph = program.graph
    flops = node_flops(program)
    calls = [n for n in graph.nodes if n.op == "call_function"]
    # phase and segment; nodes the partitioner added inherit from the op before them
    phase: dict[Node, str] = {}
    segment: dict[Node, str] = {}
    seen_layer = False
    prev_phase, prev_segment = "forward", EMBED
    first_backward_layer: str | None = None
    for node in calls:
        ph = node.meta.get("phase") or (parts.phase.get(node) if node.meta.get("source") else None)
        ph = ph or prev_phase
        layer = parts.layer.get(node) if node.meta.get("source") else None
        if ph == "optimizer":
            seg = OPTIMIZER
        elif layer is not None:
            seg = layer
            seen_layer = True
        elif node.meta.get("source") is not None or node.target in _MATMULS:
            if ph == "forward":
                seg = HEAD if seen_layer else EMBED
            else:  # backward: head first, embed after the last layer's backward
                seg = EMBED if first_backward_layer is not None else HEAD
        else:
            seg = prev_segment
        if ph == "backward" and layer is not None and first_backward_layer is None:
            first_backward_layer = layer
        phase[node], segment[node] = ph, seg
        prev_phase, prev_segment = ph, seg
    # fusion: non-matmul, non-collective ops of a phase and segment
    uf = _UnionFind()

    def fusible(n: object) -> bool:
        return (
            isinstance(n, Node)
            and n.op == "call_function"
            and n.target not in _MATMULS
            and n.target not in _COLLECTIVES
        )

    for node in calls:
        if not fusible(node):
            continue
        for arg in node.all_input_nodes:
            if fusible(arg) and phase[arg] == phase[node] and segment[arg] == segment[node]:
                uf.union(arg, node)
    groups: dict[Node, list[Node]] = {}
    for node in calls:
        if fusible(node):
            groups.setdefault(uf.find(node), []).append(node)

    forward: dict[str, list[float]] = {}
    backward: dict[str, list[float]] = {}
    mlp: dict[str, list[float]] = {}
    optimizer = [0.0, 0.0]
    order: list[str] = []

    def add(table: dict[str, list[float]], key: str, f: float, b: float, k: float) -> None:
        row = table.setdefault(key, [0.0, 0.0, 0.0])
        row[0] += f
        row[1] += b
        row[2] += k

    def is_mlp(node: Node) -> bool:
        src = source_of(node)
        return src is not None and ".mlp" in f".{src.module}"

    kernel_cost: dict[Node, tuple[float, float, float]] = {}  # anchor -> (flops, bytes, kernels)
    for root, members in groups.items():
        inside = set(members)
        read: set[Node] = set()
        written = 0.0
        for m in members:
            if m.target in _FREE:
                continue
            for arg in m.all_input_nodes:
                base = arg
                while base.op == "call_function" and base.target in _FREE and base not in inside:
                    nxt = base.all_input_nodes
                    if not nxt:
                        break
                    base = nxt[0]
                if base not in inside:
                    read.add(arg)
            if any(u not in inside for u in m.users):
                written += _nbytes(m)
        moved = written + sum(_nbytes(r) for r in read)
        real = sum(1 for m in members if m.target not in _FREE)
        # scalar bookkeeping (seeds, counters, loss scalars) is folded, not a kernel
        kernel_cost[root] = (0.0, moved, 1.0 if real and moved >= _KERNEL_BYTES else 0.0)
    gemms: dict[Any, list[tuple[float, ...]]] = {}
    for node in calls:
        if node.target in _MATMULS:
            # its operand traffic is its own roofline's (Work.gemms), not memory-bound bytes
            f = float(flops.get(node, 0))
            kernel_cost[node] = (f, 0.0, 1.0)
            moved = _nbytes(node) + sum(_nbytes(a) for a in node.all_input_nodes)
            gemms.setdefault((segment[node], phase[node]), []).append((f, moved, *_tiles(node)))

    for anchor, (f, b, k) in kernel_cost.items():
        seg, ph = segment[anchor], phase[anchor]
        if seg not in order and seg != OPTIMIZER:
            order.append(seg)
        if ph == "optimizer" or seg == OPTIMIZER:
            optimizer[0] += b
            optimizer[1] += k
            continue
        add(forward if ph == "forward" else backward, seg, f, b, k)
        if is_mlp(anchor):
            add(mlp, seg, f, b, k)

    # recomputation: per policy, the forward kernels a layer repeats in its backward
    recompute: dict[tuple[str, str], list[float]] = {}
    data = _data_dependent(program)
    core = _core_attention(calls, phase, segment, data)
    for anchor, (f, b, k) in kernel_cost.items():
        seg = segment[anchor]
        if phase[anchor] != "forward" or seg in (EMBED, HEAD):
            continue
        members = groups.get(anchor, [anchor])
        add_to = recompute.setdefault((seg, "full"), [0.0, 0.0, 0.0])
        add_to[0] += f
        add_to[1] += b
        add_to[2] += k
        if anchor.target in _MATMULS:
            moved = _nbytes(anchor) + sum(_nbytes(a) for a in anchor.all_input_nodes)
            gemms.setdefault((seg, "full"), []).append((f, moved, *_tiles(anchor)))
            if anchor in core:
                gemms.setdefault((seg, "selective"), []).append((f, moved, *_tiles(anchor)))
        if any(m in core for m in members):
            row = recompute.setdefault((seg, "selective"), [0.0, 0.0, 0.0])
            row[0] += f
            row[1] += b
            row[2] += k

    # saved activations per policy
    saved: dict[tuple[str, str], float] = {}
    live = liveness(graph)
    for buffer in live.buffers:
        owner = buffer.owner
        if owner.op != "call_function" or phase.get(owner) != "forward":
            continue
        readers = [
            r for r in buffer.readers if r.op == "call_function" and phase.get(r) != "forward"
        ]
        if not readers:
            continue
        seg = segment[owner]
        size = float(buffer.nbytes)
        if owner not in data and isinstance(owner.meta.get("tensor"), TensorSpec):
            # a mask drawn from the counter generator: a fused dropout keeps 1 byte per element
            size = size / owner.meta["tensor"].dtype.itemsize
        saved[(seg, "none")] = saved.get((seg, "none"), 0.0) + size
        if owner not in core:
            saved[(seg, "selective")] = saved.get((seg, "selective"), 0.0) + size
        # full: a layer keeps only its input: the buffers other segments make that it reads
        for reader_seg in {segment[r] for r in buffer.readers if r.op == "call_function"}:
            if reader_seg != seg and reader_seg not in (EMBED, HEAD, OPTIMIZER):
                key = (reader_seg, "full-input")
                saved[key] = saved.get(key, 0.0) + size
    for seg in order:
        if seg in (EMBED, HEAD):
            saved[(seg, "full")] = saved.get((seg, "none"), 0.0)
        else:
            saved[(seg, "full")] = saved.pop((seg, "full-input"), 0.0)

    collectives: dict[str, list[tuple[str, str, float]]] = {}
    for node in calls:
        kind = _KINDS.get(node.target)
        if kind is None:
            continue
        size = _nbytes(node) if kind != "reduce_scatter" else _nbytes(node.all_input_nodes[0])
        collectives.setdefault(segment[node], []).append((kind, phase[node], size))

    params: dict[str, float] = {}
    param_bytes: dict[str, float] = {}
    layer_re = re.compile(layers)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    for spec in program.signature.inputs:
        if spec.kind is not InputKind.PARAMETER:
            continue
        target = spec.target or spec.name
        seg = _param_segment(target, layer_re)
        tensor = spec.spec
        node = placeholders.get(spec.name)
        if node is not None and isinstance(node.meta.get("tensor"), TensorSpec):
            tensor = node.meta["tensor"]
        numel = float(math.prod(int(d) for d in tensor.shape))
        params[seg] = params.get(seg, 0.0) + numel
        param_bytes[seg] = param_bytes.get(seg, 0.0) + numel * tensor.dtype.itemsize

    return _Sums(
        forward,
        backward,
        recompute,
        mlp,
        saved,
        collectives,
        params,
        param_bytes,
        optimizer,
        order,
        gemms,
    )


def _data_dependent(program: Program) -> set[Node]:
    """Nodes computed from the step's data or parameters (not only from seeds, counters and
    constants)."""
    sources = {
        spec.name
        for spec in program.signature.inputs
        if spec.kind in (InputKind.USER_INPUT, InputKind.PARAMETER)
    }
    out: set[Node] = set()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            if node.name in sources:
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _core_attention(
    calls: Sequence[Node], phase: Mapping[Node, str], segment: Mapping[Node, str], data: set[Node]
) -> set[Node]:
    """Megatron's core attention in each layer's forward: the matmuls of two activations
    (QK^T, attention over V) and every op on a path from one to another (scale, mask, softmax,
    dropout)."""
    layer_fwd = [n for n in calls if phase[n] == "forward" and segment[n] not in (EMBED, HEAD)]
    params_only: set[Node] = set()  # values derived from parameters alone (weights, views)
    for n in layer_fwd:
        if all(a.op == "placeholder" or a in params_only for a in n.all_input_nodes):
            params_only.add(n)
    act_act = {
        n
        for n in layer_fwd
        if n.target in _MATMULS
        and len(n.all_input_nodes) >= 2
        and not any(a in params_only or a.op == "placeholder" for a in n.all_input_nodes)
    }
    below: set[Node] = set()  # descendants of an act-act matmul
    for n in layer_fwd:
        if n in act_act or any(a in below or a in act_act for a in n.all_input_nodes):
            below.add(n)
    above: set[Node] = set()  # ancestors of an act-act matmul
    for n in reversed(layer_fwd):
        if n in act_act or any(u in above or u in act_act for u in n.users):
            above.add(n)
    core = act_act | (below & above)
    # the masks they use (causal mask, dropout's draws) are regenerated with them
    for n in reversed(layer_fwd):
        if n not in data and n not in core and any(u in core for u in n.users):
            core.add(n)
    return core


def _param_segment(target: str, layer_re: object) -> str:
    pieces = target.split(".")
    for i in range(1, len(pieces) + 1):
        prefix = ".".join(pieces[:i])
        if layer_re.fullmatch(prefix):  # type: ignore[attr-defined]
            return prefix
    return (
        EMBED if not target.startswith(("norm", "head", "ln_f", "lm_head", "model.norm")) else HEAD
    )


# --------------------------------------------------------------------------- four programs


def count(
    programs: Sequence[Program],
    seq: int,
    *,
    batches: tuple[int, int] = (1, 2),
    layers: str = DEFAULT_LAYERS,
    source: str = "",
) -> Costs:
    """Costs from four programs of one model (module docstring, Scaling): micro-batch 1 and 2,
    unpartitioned, then partitioned at t = 2, in that order. One program (t = 1 only, micro-batch
    1) gives costs that scale nothing by t and everything by b."""
    if len(programs) not in (1, 4):
        raise PlannerError(
            f"count() takes 1 or 4 programs, got {len(programs)}",
            fix="pass (b=1,t=1), (b=2,t=1), (b=1,t=2), (b=2,t=2) per-rank programs",
        )
    sums = [_sums(p, seq, layers) for p in programs]
    if len(sums) == 1:
        sums = [sums[0], _double(sums[0]), sums[0], _double(sums[0])]
    s11, s21, s12, s22 = sums
    segments = tuple(_fit_segment(name, sums, batches) for name in s11.order)
    total_params = sum(s11.params.values())
    per_param = s11.optimizer[0] / total_params if total_params else 0.0
    per_sample = (
        sum(s11.forward.get(n, [0.0])[0] + s11.backward.get(n, [0.0])[0] for n in s11.order)
        / batches[0]
    )
    return Costs(segments, per_param, s11.optimizer[1], seq, per_sample, source)


def _fit_segment(name: str, sums: Sequence[_Sums], batches: tuple[int, int]) -> Segment:
    """Segment `name` from the sums at the four (b, t) points."""

    def fit(get: Callable[[_Sums], float]) -> Coeffs:
        q = [get(s) for s in sums]
        return Coeffs.fit(q[0], q[1], q[2], q[3], batches)

    def row(table: Mapping[Any, list[float]], key: Any, i: int) -> float:
        return table.get(key, [0.0, 0.0, 0.0])[i]

    def work(table: str, key: Any, gemm_key: Any = None) -> Work:
        return Work(
            fit(lambda s: row(getattr(s, table), key, 0)),
            fit(lambda s: row(getattr(s, table), key, 1)),
            row(getattr(sums[0], table), key, 2),
            _fit_gemms([s.gemms.get(gemm_key, []) for s in sums], batches) if gemm_key else (),
        )

    recompute = {
        p: work("recompute", (name, p), (name, p)) if p != "none" else Work() for p in POLICIES
    }
    return Segment(
        name=name,
        forward=work("forward", name, (name, "forward")),
        backward=work("backward", name, (name, "backward")),
        recompute=recompute,
        saved={p: fit(functools.partial(_saved, key=(name, p))) for p in POLICIES},
        collectives=_fit_collectives([s.collectives.get(name, []) for s in sums], batches),
        params=fit(lambda s: s.params.get(name, 0.0)),
        param_bytes=fit(lambda s: s.param_bytes.get(name, 0.0)),
        mlp=work("mlp", name),
    )


def _fit_gemms(
    rows: Sequence[list[tuple[float, ...]]], batches: tuple[int, int]
) -> tuple[Gemm, ...]:
    """Each matmul's coefficients, paired by program order; none when the four programs do
    not have the same matmuls (the estimate then uses the FLOPs alone)."""
    if len({len(r) for r in rows}) != 1:
        return ()
    out = []
    for a, b, c, d in zip(*rows, strict=True):
        fitted = [Coeffs.fit(a[i], b[i], c[i], d[i], batches) for i in range(5)]
        out.append(Gemm(*fitted))
    return tuple(out)


def _tiles(node: Node) -> tuple[float, float, float]:
    """A matmul's output as (batch, rows, cols): `[..., rows, cols]`; zeros for the fused
    attention ops and convolutions (several outputs, no single tile grid)."""
    spec = node.meta.get("tensor")
    if node.target not in _PLAIN_MATMULS or not isinstance(spec, TensorSpec):
        return 0.0, 0.0, 0.0
    shape = [int(d) for d in spec.shape]
    if len(shape) < 2:
        return 0.0, 0.0, 0.0
    return float(math.prod(shape[:-2])), float(shape[-2]), float(shape[-1])


def _saved(s: _Sums, key: tuple[str, str]) -> float:
    return s.saved.get(key, 0.0)


def _double(s: _Sums) -> _Sums:
    """The sums at twice the micro-batch when only one program is given: activations scale."""

    def dbl(table: dict[Any, list[float]]) -> dict[Any, list[float]]:
        return {k: [v * 2 if i < 2 else v for i, v in enumerate(row)] for k, row in table.items()}

    return _Sums(
        dbl(s.forward),
        dbl(s.backward),
        dbl(s.recompute),
        dbl(s.mlp),
        {k: v * 2 for k, v in s.saved.items()},
        {k: [(a, p, b * 2) for a, p, b in v] for k, v in s.collectives.items()},
        s.params,
        s.param_bytes,
        s.optimizer,
        s.order,
        # the product's rows hold the batch (the tokens of a linear's output)
        {k: [(g[0] * 2, g[1] * 2, g[2], g[3] * 2, g[4]) for g in v] for k, v in s.gemms.items()},
    )


def _fit_collectives(
    rows: Sequence[list[tuple[str, str, float]]], batches: tuple[int, int]
) -> tuple[Collective, ...]:
    r11, r21, r12, r22 = rows
    if not r12:  # unpartitioned only: no collectives at t = 1
        return ()
    if len(r12) != len(r22):
        raise PlannerError(
            "the partitioned programs at micro-batch 1 and 2 insert different collectives",
            fix="report this model: its partition depends on the batch size",
        )
    out = []
    for (kind, phase, b1), (_, _, b2) in zip(r12, r22, strict=True):
        slope = (b2 - b1) / (batches[1] - batches[0])
        # full-tensor bytes do not depend on t: the repeated part holds them
        out.append(Collective(kind, phase, Coeffs(b1 - batches[0] * slope, slope, 0.0, 0.0)))
    return tuple(out)
