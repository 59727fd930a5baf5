"""`estimate`: step time, memory per device and MFU of one configuration on one system.

Per micro-batch and rank, each layer's forward and backward are priced from its counted costs
(costs.py) at micro-batch `b` and tensor-parallel degree `t`:

    kernel time   = per matmul: max(FLOPs / (peak[precision] * eff.matmul * waves),
                                    its operand + result bytes / (HBM bandwidth * eff.memory))
                    waves = output elements / (ceil(tiles / units) * units * tile elements):
                    the output cut in the chip's `gemm_tile`s, computed `gemm_units` at a
                    time (wave and tile quantization; 1 when the last wave is full)
                  + memory-bound bytes / (HBM bandwidth * eff.memory)
                  + kernels * eff.kernel_overhead_s
    collective    = steps * latency + wire bytes / (link bandwidth * eff.link[level])
                    ring wire bytes (hardware.md): all-reduce 2(n-1)/n x bytes,
                    all-gather / reduce-scatter / all-to-all (n-1)/n x bytes

Sequence parallelism divides the work the TP ranks repeat by `t` and turns each all-reduce into
a reduce-scatter + all-gather (the same wire bytes). Context parallelism divides a layer's work
by `cp` and adds the ring exchange of keys and values (hidden behind the core attention where
that takes longer). Tensor-parallel collectives sit on the critical path (they are exposed).
Recomputation adds the repeated forward work of the policy to each backward.

A stage runs `layers / pp` layers (the first also the embedding, the last the head and loss);
a micro-batch's stage time is the slowest stage's. With `m = global_batch / (dp * b)`
micro-batches, the pipeline takes `m * T + bubble`, bubble `(pp - 1) * T / virtual`
(Narayanan et al. 2021: (p-1)/m of the ideal time for 1F1B, (p-1)/(v m) interleaved), plus the
point-to-point sends of activations between stages. The data-parallel gradient reduction
(all-reduce; reduce-scatter + all-gather under ZeRO; FSDP also gathers parameters per
micro-batch) is exposed except the part that overlaps the last micro-batch's backward when
`overlap_grad_reduce`. The optimizer is memory-bound: the program's optimizer bytes per
parameter element over HBM.

Memory per device: parameters, gradients and optimizer state at the precision's bytes per
parameter (bf16 weight 2 + gradient 2 + fp32 master and two moments 12: hardware.md's 16 bytes),
split by ZeRO; activations: the layers' saved bytes under the recomputation policy times the
micro-batches the first stage holds in flight (`pp`; interleaved `1 + (pp-1)/(pp*virtual)`
more, Korthikanti et al. 2022), plus the embedding's and head's saved values; a transient of one
layer's full activations while it is recomputed.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import PlannerError
from .counted import Coeffs, Collective, Costs, Gemm, Segment, Work
from .parallelism import Parallelism
from .systems import System

__all__ = ["Breakdown", "Estimate", "Memory", "price"]

_WEIGHT_BYTES, _GRAD_BYTES, _OPTIMIZER_BYTES = 2, 2, 12
# the column-parallel linears' weight-gradient matmuls in a block's backward matmul time:
# QKV (3h^2) and FC1 (4h^2) of 12h^2 parameters, half of each one's backward (7/24 ~ 1/4)
_COLUMN_WGRAD_SHARE = 0.25
_OPTIMIZER_TRAFFIC = 30  # bytes of HBM traffic per parameter element in the update


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Seconds per step by component; they sum to the step time."""

    compute: float  # forward + backward kernels, recomputation included
    recompute: float  # the part of `compute` that recomputation adds
    tp_comm: float
    cp_comm: float
    ep_comm: float
    pp_comm: float
    dp_comm: float  # exposed data-parallel gradient (and FSDP parameter) communication
    bubble: float
    optimizer: float

    @property
    def comm(self) -> float:
        return self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm + self.dp_comm

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "comm": self.comm
        }


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float  # the layers' saved activations
    activations_other: float  # embedding and head (logits) values saved for the backward
    transient: float  # one layer recomputed / the largest working set

    @property
    def total(self) -> float:
        return (
            self.parameters
            + self.gradients
            + self.optimizer
            + self.activations
            + self.activations_other
            + self.transient
        )

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "total": self.total
        }


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The planner's prediction for one configuration (module docstring)."""

    plan: Parallelism  # with dp and micro_batch filled in
    system: str
    devices: int
    step_time_s: float
    breakdown: Breakdown
    memory: Memory
    memory_limit_bytes: float
    model_flops: float  # per step, all devices, recomputation excluded
    hardware_flops: float  # per step, all devices, recomputation included
    mfu: float
    tokens_per_s: float
    cost_per_step: float | None  # with a price per device-hour

    @property
    def memory_per_device_bytes(self) -> float:
        return self.memory.total

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit_bytes

    @property
    def hardware_tflops_per_device(self) -> float:
        return self.hardware_flops / self.step_time_s / self.devices / 1e12

    def as_dict(self) -> dict[str, object]:
        return {
            "plan": dataclasses.asdict(self.plan),
            "describe": self.plan.describe(),
            "system": self.system,
            "devices": self.devices,
            "step_time_s": self.step_time_s,
            "mfu": self.mfu,
            "tokens_per_s": self.tokens_per_s,
            "memory_per_device_bytes": self.memory.total,
            "memory_limit_bytes": self.memory_limit_bytes,
            "fits": self.fits,
            "breakdown": self.breakdown.as_dict(),
            "memory": self.memory.as_dict(),
            "model_flops": self.model_flops,
            "hardware_flops": self.hardware_flops,
            "cost_per_step": self.cost_per_step,
        }


# --------------------------------------------------------------------------- pricing


@dataclasses.dataclass(frozen=True)
class _Rates:
    flop: float  # seconds per matmul FLOP
    byte: float  # seconds per HBM byte
    kernel: float
    units: int  # matmul output tiles per wave
    tile: tuple[int, int]


def _rates(system: System, precision: str) -> _Rates:
    eff = system.efficiency
    return _Rates(
        1.0 / (system.peak(precision) * eff.matmul),
        1.0 / (system.hbm_bandwidth * eff.memory),
        eff.kernel_overhead_s,
        system.gemm_units,
        system.gemm_tile,
    )


def _work_time(work: Work, b: float, t: int, sp: bool, cp: int, r: _Rates) -> float:
    flops = _at(work.flops, b, t, sp) / cp
    moved = _at(work.bytes, b, t, sp) / cp
    matmul = _gemm_time(work, b, t, sp, cp, r)
    flops -= sum(_at(g.flops, b, t, sp) for g in work.gemms) / cp
    return matmul + max(flops, 0.0) * r.flop + moved * r.byte + work.kernels * r.kernel


def _gemm_time(work: Work, b: float, t: int, sp: bool, cp: int, r: _Rates) -> float:
    """Seconds of the matmuls of `work`, each on its own roofline at its wave efficiency."""
    total = 0.0
    for g in work.gemms:
        compute = _at(g.flops, b, t, sp) / cp * r.flop / _waves(g, b / cp, t, r)
        total += max(compute, _at(g.bytes, b, t, sp) / cp * r.byte)
    return total


def _waves(g: Gemm, b: float, t: int, r: _Rates) -> float:
    """The fraction of the chip's matmul units a product keeps busy (module docstring): its
    output's tiles over the tiles its waves could have computed, in the better of the tile's
    two orientations. 1 for products without a tile grid (fused attention)."""
    rows, cols = g.rows.at(b, t), g.cols.at(b, t)
    if rows <= 0 or cols <= 0:
        return 1.0
    batch = max(g.batch.at(b, t), 1.0)
    best = 0.0
    for tr, tc in (r.tile, r.tile[::-1]):
        tiles = batch * math.ceil(rows / tr - 1e-9) * math.ceil(cols / tc - 1e-9)
        waves = math.ceil(tiles / r.units - 1e-9)
        best = max(best, batch * rows * cols / (waves * r.units * tr * tc))
    return min(best, 1.0)


def _at(q: Coeffs, b: float, t: int, sp: bool) -> float:
    rep, split = q.parts(b)
    if sp:  # sequence parallel: the repeated activation work is split too
        return (rep + split) / t if rep > 0 else rep + split / t
    return rep + split / t


_WIRE = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


def collective_time(system: System, kind: str, nbytes: float, n: int, stride: int) -> float:
    """Seconds for one ring collective of `kind` over `n` ranks `stride` devices apart,
    `nbytes` the full tensor (module docstring)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    span = n * stride
    link = system.level_for(min(span, system.devices))
    bandwidth = link.bandwidth * system.efficiency.link.get(link.level, 1.0)
    inner = system.links[0]
    if link is not inner and stride < inner.devices:
        # a hierarchical collective: each rank moves 1/k of the bytes over the slower level,
        # k = the group's ranks inside one inner domain
        k = max(1, inner.devices // stride)
        bandwidth = min(
            bandwidth * k, inner.bandwidth * system.efficiency.link.get(inner.level, 1.0)
        )
    factor = _WIRE.get(kind, 1.0)
    steps = factor * (n - 1)
    return steps * link.latency_s + factor * (n - 1) / n * nbytes / bandwidth


def _collectives_time(
    system: System, collectives: tuple[Collective, ...], phase: str, b: float, t: int
) -> float:
    total = 0.0
    for c in collectives:
        if c.phase == phase:
            total += collective_time(system, c.kind, c.bytes.at(b, 1), t, 1)
    return total


# --------------------------------------------------------------------------- the estimate


def price(
    costs: Costs,
    system: System,
    plan: Parallelism,
    *,
    memory_limit_bytes: float | None = None,
    price_per_device_hour: float | None = None,
    experts: int = 0,
    routed: int = 1,
) -> Estimate:
    """The estimate of `plan` (micro_batch set) on `system` from `costs` (module docstring)."""
    if plan.micro_batch is None:
        raise PlannerError("price() needs plan.micro_batch", fix="use estimate() to pick one")
    devices = system.devices
    dp = plan.data_parallel(devices)
    b, t, p, cp, v = plan.micro_batch, plan.tp, plan.pp, plan.cp, plan.virtual
    sp = plan.sequence_parallel
    if plan.global_batch % (dp * b):
        raise PlannerError(
            f"global batch {plan.global_batch} is not a multiple of dp*micro_batch = {dp}*{b}",
            fix="pick a micro-batch (and dp) that divide the global batch",
        )
    m = plan.global_batch // (dp * b)
    layers = costs.layers
    if len(layers) % (p * v):
        raise PlannerError(
            f"{len(layers)} layers do not split into pp*virtual = {p}*{v} equal chunks",
            fix="pick pp and virtual that divide the layer count",
        )
    if experts and experts % plan.ep:
        raise PlannerError(
            f"ep={plan.ep} does not divide {experts} experts", fix="pick ep | experts"
        )
    r = _rates(system, plan.precision)
    policy = plan.recompute

    def layer_time(seg: Segment) -> tuple[float, float, float, float, float]:
        """(compute, recompute, tp comm, cp comm, ep comm) of one layer, one micro-batch."""
        scale = _moe_scale(seg, routed)
        fwd = _work_time(seg.forward + scale, b, t, sp, cp, r)
        bwd = _work_time(seg.backward + _scaled(scale, 2.0), b, t, sp, cp, r)
        rec = _work_time(seg.recompute[policy], b, t, sp, cp, r) if policy != "none" else 0.0
        comm = _collectives_time(system, seg.collectives, "forward", b / cp, t)
        backward = _collectives_time(system, seg.collectives, "backward", b / cp, t)
        if plan.overlap_tp_comm:
            # the column-parallel input gradients' collectives run beside the backward
            # matmuls; under sequence parallelism the row-parallel output gradients'
            # all-gathers (half the wire bytes) still wait
            waits = backward / 2 if sp else 0.0
            beside = _gemm_time(seg.backward, b, t, sp, cp, r) * _COLUMN_WGRAD_SHARE
            backward = waits + max(0.0, backward - waits - beside)
        comm += backward
        if policy == "full":
            comm += _collectives_time(system, seg.collectives, "forward", b / cp, t)
        cp_comm = 0.0
        if cp > 1:
            kv = 2 * b * costs.seq * costs.kv_width * 2 / t  # keys and values, bf16
            exchange = collective_time(system, "all_gather", kv, cp, t)
            exchange += collective_time(system, "reduce_scatter", kv, cp, t)
            core = _work_time(seg.recompute["selective"], b, t, sp, cp, r) * 3
            cp_comm = max(0.0, exchange - core)
        ep_comm = 0.0
        if experts and plan.ep > 1:
            tokens = b * costs.seq / cp * costs.hidden * 2 * routed / (t if sp else 1)
            ep_comm = 4 * collective_time(system, "all_to_all", tokens * plan.ep, plan.ep, t * cp)
        return fwd + bwd + rec, rec, comm, cp_comm, ep_comm

    chunk = len(layers) // p
    embed = [s for s in costs.segments if s.name == "embed"]
    head = [s for s in costs.segments if s.name == "head"]
    outer = {
        "embed": sum(_embed_time(s, b, t, sp, cp, r, system) for s in embed),
        "head": sum(_head_time(s, b, costs.seq, t, cp, r, system) for s in head),
    }
    embed_params = sum(s.params.at(1, t) for s in embed)
    head_params = sum(s.params.at(1, t) for s in head)
    distinct = costs.distinct_layers
    priced = {id(seg.forward): (layer_time(seg), seg.params.at(1, t)) for seg, _ in distinct}
    uniform = len(distinct) == 1
    stages = []
    stage_param_counts = []
    for i in range(p):
        if uniform:  # every layer the same: a stage is `chunk` copies of it
            one, params = next(iter(priced.values()))
            totals = [x * chunk for x in one]
            stage_param_count = params * chunk
        else:
            rows = [priced[id(seg.forward)] for seg in layers[i * chunk : (i + 1) * chunk]]
            totals = [sum(x[0][k] for x in rows) for k in range(5)]
            stage_param_count = sum(x[1] for x in rows)
        totals[0] += (outer["embed"] if i == 0 else 0.0) + (outer["head"] if i == p - 1 else 0.0)
        stages.append(totals)
        stage_param_counts.append(
            stage_param_count
            + (embed_params if i == 0 else 0.0)
            + (head_params if i == p - 1 else 0.0)
        )
    slowest = max(stages, key=lambda s: s[0] + s[2] + s[3] + s[4])
    t_mb = sum(slowest[k] for k in (0, 2, 3, 4))
    compute = m * slowest[0]
    recompute = m * slowest[1]
    tp_comm, cp_comm, ep_comm = m * slowest[2], m * slowest[3], m * slowest[4]
    bubble = (p - 1) * t_mb / v
    pp_comm = 0.0
    if p > 1:
        # Megatron's scatter-gather: each TP rank sends 1/t of the activation (Narayanan 2021)
        act = b * costs.seq / cp * costs.hidden * 2 / t
        send = collective_time(system, "all_to_all", act * 2, 2, t * cp * dp)  # one send
        pp_comm = 2 * (m * v + p - 1) * send
    # parameters per rank
    stage_params = max(stage_param_counts)
    if experts:
        stage_params = _expert_params(layers, chunk, t, experts, plan.ep, stage_params)
    grad_bytes = stage_params * plan.grad_bytes
    dp_group = dp
    stride = t * cp
    if plan.zero >= 1:
        sync = collective_time(system, "reduce_scatter", grad_bytes, dp_group, stride)
        sync += collective_time(
            system, "all_gather", stage_params * _WEIGHT_BYTES, dp_group, stride
        )
    else:
        sync = collective_time(system, "all_reduce", grad_bytes, dp_group, stride)
    fsdp_gather = 0.0
    if plan.zero == 3:
        gather = collective_time(
            system, "all_gather", stage_params * _WEIGHT_BYTES, dp_group, stride
        )
        per_mb = 2 * gather  # forward and backward
        fsdp_gather = max(0.0, m * per_mb - compute)
    if plan.overlap_grad_reduce:
        last_backward = slowest[0] * 2 / 3
        dp_comm = max(sync / max(chunk, 1), sync - last_backward) + fsdp_gather
    else:
        dp_comm = sync + fsdp_gather
    opt_params = stage_params / (dp if plan.zero >= 1 else 1)
    # mixed-precision Adam: read and write the fp32 master and moments (12 + 12 bytes), read the
    # gradient twice (clipping's norm, the update) and write the bf16 weight: 30 bytes
    optimizer = opt_params * _OPTIMIZER_TRAFFIC * r.byte + costs.optimizer_kernels * r.kernel
    step = compute + tp_comm + cp_comm + ep_comm + pp_comm + dp_comm + bubble + optimizer
    breakdown = Breakdown(
        compute, recompute, tp_comm, cp_comm, ep_comm, pp_comm, dp_comm, bubble, optimizer
    )
    memory = _memory(costs, plan, layers, chunk, embed, head, stage_params, dp, b, t, sp, cp, m)
    model_flops = costs.model_flops_per_sample * plan.global_batch
    rec_flops = (
        sum(s.recompute[policy].flops.at(1, 1) * n for s, n in distinct)
        if policy != "none"
        else 0.0
    )
    hardware = model_flops + rec_flops * plan.global_batch
    peak = system.peak(plan.precision)
    limit = memory_limit_bytes if memory_limit_bytes is not None else system.hbm_bytes
    cost = None
    if price_per_device_hour is not None:
        cost = price_per_device_hour * devices * step / 3600.0
    return Estimate(
        plan=dataclasses.replace(plan, dp=dp),
        system=system.name,
        devices=devices,
        step_time_s=step,
        breakdown=breakdown,
        memory=memory,
        memory_limit_bytes=limit,
        model_flops=model_flops,
        hardware_flops=hardware,
        mfu=model_flops / (step * peak * devices),
        tokens_per_s=plan.global_batch * costs.seq / step,
        cost_per_step=cost,
    )


def _embed_time(
    seg: Segment, b: float, t: int, sp: bool, cp: int, r: _Rates, system: System
) -> float:
    """The embedding as Megatron's vocabulary-parallel one: each rank looks up and writes the
    gradient of its 1/t of the table (the partitioner's program gathers a full-table gradient
    instead; that is not priced)."""
    total = _work_time(seg.forward, b, t, sp, cp, r) + _work_time(seg.backward, b, t, True, cp, r)
    for phase in ("forward", "backward"):
        total += _collectives_time(system, seg.collectives, phase, b / cp, t)
    return total


def _head_time(
    seg: Segment, b: float, seq: int, t: int, cp: int, r: _Rates, system: System
) -> float:
    """The head (final norm, LM head, loss) with Megatron's vocabulary-parallel cross entropy:
    every rank works on its 1/t of the logits and the ranks exchange per-token maxima and sums
    (bytes of b s floats). The partitioner gathers the logits instead and runs the loss on full
    copies; that gather and the repeated loss work are not priced."""
    total = _work_time(seg.forward, b, t, True, cp, r) + _work_time(seg.backward, b, t, True, cp, r)
    for c in seg.collectives:
        if c.kind == "all_gather":
            continue  # the logits gather a vocabulary-parallel loss does not make
        total += collective_time(system, c.kind, c.bytes.at(b / cp, 1), t, 1)
    if t > 1:
        total += 2 * collective_time(system, "all_reduce", b * seq / cp * 4, t, 1)
    return total


def _scaled(work: Work, factor: float) -> Work:
    return Work(work.flops.scaled(factor), work.bytes.scaled(factor), work.kernels * factor)


def _moe_scale(seg: Segment, routed: int) -> Work:
    """The extra MLP work of routing each token to `routed` experts (none for dense)."""
    extra = routed - 1
    fwd_share = 1.0 / 3.0  # the MLP's forward is a third of its forward + backward work
    return Work(
        seg.mlp.flops.scaled(extra * fwd_share),
        seg.mlp.bytes.scaled(extra * fwd_share),
        seg.mlp.kernels * extra * fwd_share,
    )


def _expert_params(
    layers: tuple[Segment, ...], chunk: int, t: int, experts: int, ep: int, dense: float
) -> float:
    """Parameters per rank with `experts` copies of each layer's MLP split over `ep`."""
    mlp_share = 2.0 / 3.0  # of a standard block's parameters (8h^2 of 12h^2)
    per_layer = sum(s.params.at(1, t) for s in layers[:chunk])
    return dense + per_layer * mlp_share * (experts / ep - 1)


def _memory(
    costs: Costs,
    plan: Parallelism,
    layers: tuple[Segment, ...],
    chunk: int,
    embed: list[Segment],
    head: list[Segment],
    stage_params: float,
    dp: int,
    b: int,
    t: int,
    sp: bool,
    cp: int,
    m: int,
) -> Memory:
    zero = plan.zero
    weights = stage_params * _WEIGHT_BYTES / (dp if zero >= 3 else 1)
    grads = stage_params * _GRAD_BYTES / (dp if zero >= 2 else 1)
    states = stage_params * _OPTIMIZER_BYTES / (dp if zero >= 1 else 1)
    p, v = plan.pp, plan.virtual
    distinct = [s for s, _ in costs.distinct_layers]
    per_layer = max(_at(s.saved[plan.recompute], b, t, sp) for s in distinct) / cp
    in_flight = min(p, m) if p > 1 else 1
    factor = 1.0 + (p - 1) / (p * v) if v > 1 else 1.0
    activations = per_layer * chunk * in_flight * factor
    other = (
        max(
            sum(_at(s.saved["none"], b, t, sp) for s in embed) * in_flight,
            sum(_at(s.saved["none"], b, t, sp) for s in head),
        )
        / cp
    )
    transient = 0.0
    if plan.recompute != "none":
        transient = max(_at(s.saved["none"], b, t, sp) for s in distinct) / cp
    return Memory(weights, grads, states, activations, other, transient)
