"""`estimate` one configuration, `search` the configurations of a model on a system.

`search` enumerates tensor, pipeline (1F1B and interleaved, with `virtual` chunks), context and
expert parallel degrees, ZeRO stage, sequence parallelism, micro-batch and recomputation policy
whose degrees divide the devices, the layers, the heads and the global batch; prices each with
the counted costs (estimate.py: arithmetic on a few dozen numbers, no graph work), drops those
over the memory limit and ranks the rest by step time, or by cost per step when a price per
device-hour is given.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import PlannerError
from .counted import POLICIES, Costs
from .estimate import Estimate, price
from .models import costs_of
from .parallelism import Parallelism
from .systems import System

__all__ = ["estimate", "search"]

_POW2 = (1, 2, 4, 8, 16, 32, 64, 128)


def estimate(
    model: Any,
    system: System,
    plan: Parallelism,
    *,
    seq: int | None = None,
    memory_limit_bytes: float | None = None,
    price_per_device_hour: float | None = None,
) -> Estimate:
    """Step time, memory per device and MFU of `model` (a `Transformer`, a Hugging Face config,
    a captured training step or counted `Costs`) trained under `plan` on `system`. With
    `plan.micro_batch=None` the planner picks the fastest micro-batch that fits in memory (the
    smallest one's estimate when none fits)."""
    costs = costs_of(model, seq=seq)
    if plan.micro_batch is not None:
        return _price(costs, system, plan, memory_limit_bytes, price_per_device_hour)
    dp = plan.data_parallel(system.devices)
    per_replica = plan.global_batch // dp if plan.global_batch % dp == 0 else 0
    if not per_replica:
        raise PlannerError(
            f"global batch {plan.global_batch} does not split over dp={dp}",
            fix="pick a global batch that is a multiple of the data-parallel degree",
        )
    options = [b for b in range(1, per_replica + 1) if per_replica % b == 0][:16]
    best: Estimate | None = None
    error: PlannerError | None = None
    for b in options:
        try:
            est = _price(
                costs,
                system,
                dataclasses.replace(plan, micro_batch=b),
                memory_limit_bytes,
                price_per_device_hour,
            )
        except PlannerError as exc:
            error = exc
            continue
        if best is None or _better(est, best):
            best = est
    if best is None:
        assert error is not None
        raise error
    return best


def _better(a: Estimate, b: Estimate) -> bool:
    if a.fits != b.fits:
        return a.fits
    if not a.fits:
        return a.memory.total < b.memory.total
    return a.step_time_s < b.step_time_s


def _price(
    costs: Costs,
    system: System,
    plan: Parallelism,
    memory_limit_bytes: float | None,
    price_per_device_hour: float | None,
) -> Estimate:
    if price_per_device_hour is None:
        price_per_device_hour = system.price_per_device_hour
    return price(
        costs,
        system,
        plan,
        memory_limit_bytes=memory_limit_bytes,
        price_per_device_hour=price_per_device_hour,
        experts=costs.experts,
        routed=costs.routed,
    )


def candidates(
    costs: Costs,
    devices: int,
    global_batch: int,
    *,
    heads: int | None = None,
    tp: Sequence[int] | None = None,
    pp: Sequence[int] | None = None,
    cp: Sequence[int] | None = None,
    ep: Sequence[int] | None = None,
    recompute: Sequence[str] = POLICIES,
    zero: Sequence[int] = (0, 1, 3),
    micro_batches: Sequence[int] | None = None,
    virtual: Sequence[int] = (1, 2, 3, 4),
    sequence_parallel: Sequence[bool] = (False, True),
    schedules: Sequence[str] = ("1f1b", "interleaved"),
    overlap_grad_reduce: bool = True,
    overlap_tp_comm: bool = True,
    grad_bytes: int = 2,
) -> Iterable[Parallelism]:
    """Every configuration whose degrees fit `devices`, the layer count and the batch: TP a
    power of two dividing the heads, PP any divisor of the layers (up to 128), CP 1-8."""
    layers = len(costs.layers)
    heads = heads or costs.heads or None
    stages = pp or [d for d in range(1, min(layers, 128) + 1) if layers % d == 0]
    for t, p, c in itertools.product(tp or _POW2, stages, cp or (1, 2, 4, 8)):
        model = t * p * c
        if devices % model or p > layers:
            continue
        if heads is not None and heads % t:
            continue
        dp = devices // model
        if global_batch % dp:
            continue
        per_replica = global_batch // dp
        mbs = micro_batches or [b for b in (1, 2, 4, 8, 16, 32) if per_replica % b == 0]
        experts = costs.experts
        eps = ep or (
            [e for e in (1, 2, 4, 8, 16, 32, 64) if experts % e == 0 and dp % e == 0]
            if experts
            else [1]
        )
        for e, b, rc, z, sp in itertools.product(eps, mbs, recompute, zero, sequence_parallel):
            if sp and t == 1:
                continue
            if z and dp == 1:
                continue
            chunks: list[tuple[int, str]] = []
            if "1f1b" in schedules or p == 1:
                chunks.append((1, "1f1b"))
            if p > 1 and "interleaved" in schedules:
                chunks += [(v, "interleaved") for v in virtual if v > 1 and layers % (p * v) == 0]
            for v, sched in chunks:
                if layers % (p * v):
                    continue
                yield Parallelism(
                    tp=t,
                    pp=p,
                    dp=dp,
                    cp=c,
                    ep=e,
                    global_batch=global_batch,
                    micro_batch=b,
                    schedule=sched,
                    virtual=v,
                    zero=z,
                    sequence_parallel=sp,
                    recompute=rc,
                    overlap_grad_reduce=overlap_grad_reduce,
                    overlap_tp_comm=overlap_tp_comm,
                    grad_bytes=grad_bytes,
                )


def search(
    model: Any,
    system: System,
    global_batch: int,
    *,
    seq: int | None = None,
    top: int = 10,
    memory_limit_bytes: float | None = None,
    price_per_device_hour: float | None = None,
    precision: str = "bfloat16",
    heads: int | None = None,
    **space: Any,
) -> list[Estimate]:
    """The `top` configurations of `model` on `system` that fit in memory, fastest first (or
    cheapest per step with a price). `space` narrows the enumeration (`tp=[8]`, `pp=[1, 2]`,
    `recompute=["selective"]`, ...: the arguments of `candidates`)."""
    costs = costs_of(model, seq=seq)
    heads = (
        heads
        if heads is not None
        else getattr(model, "heads", None) or getattr(model, "num_attention_heads", None)
    )
    found: list[Estimate] = []
    for plan in candidates(costs, system.devices, global_batch, heads=heads, **space):
        if precision != plan.precision:
            plan = dataclasses.replace(plan, precision=precision)
        try:
            est = _price(costs, system, plan, memory_limit_bytes, price_per_device_hour)
        except PlannerError:
            continue
        if est.fits:
            found.append(est)
    key = (
        (lambda e: e.cost_per_step or e.step_time_s)
        if price_per_device_hour
        else (lambda e: e.step_time_s)
    )
    found.sort(key=key)
    return found[:top]
