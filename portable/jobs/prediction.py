"""The planner's prediction of a job's step, beside what the job measured.

When a job starts (and each time it resumes), rank 0 prices the job's own per-rank training
step (`RUN/.job/train.portable`) with the planner: `planner.costs_of(per_rank, seq=S)` counts
it and `planner.estimate.price` prices it on the job's system under the `Parallelism` its plan
maps to. It writes `RUN/prediction.json` before the first step. `portable report` puts each
predicted component beside the median of what the job measured over its steady steps
(`comparison`): summary.json's `predicted_vs_measured`, summary.md's section of that name.

**The job as the planner sees it.** The per-rank program's shapes are already per rank, and
the costs of one program have no part that the tensor-parallel degree divides (costs.py), so:

- `tp` is the product of the mesh axes the plan's rules and specs shard on. It divides no work;
  it is the group size of the collectives inside the program's layers, each priced as exposed.
  With `tp=1` those are not priced one by one: the planner's data-parallel reduction, from the
  parameter count, stands for the program's per-parameter all-reduces.
- `dp` = devices / tp; `zero=3` when the plan has an `fsdp_axis`.
- One step is one micro-batch per data-parallel rank (`micro_batch=1`, `global_batch=dp`:
  `count` reads one program as micro-batch 1). `recompute="none"`: the copies the remat pass
  made are in the program already. `precision` is the recipe's compute format; `grad_bytes`
  the parameters' element size.
- `overlap_grad_reduce`: whether some collective of the program is waited for later than the
  op right after it (spmd-partition waits at once; the job runs no comm-overlap pass).

Two plans are priced only approximately: under dp x tp the program's data-parallel
all-reduces sit in its layers and are priced as tensor-parallel collectives as well as in the
data-parallel reduction (over-predicted); under FSDP the program's parameters are shards, so
the reduce-scatter and gathers are priced for 1/dp of the parameters (under-predicted). Both
need the planner's `Collective` to carry its mesh axis and group.

**Systems.** The cuda and neuron engines use `planner.system` for the detected device (`SYSTEMS`;
trn3 is `trn3-gen1`, the neuron target's default topology), with its devices the mesh's. The CPU
(the cpu engine, and XLA:CPU under the xla and neuron engines) has no catalogue entry; its
System is built from measurements (`cpu_system`): the launcher's CPU peak (`cpu_peak_flops`,
split over the devices), this process's best copy rate of a buffer larger than the caches (read
and write bytes) and the time of one tiny eager op as the kernel overhead, all at efficiency 1
(they are achieved rates). Its one link level is ASSUMED (`CPU_LINK`): gloo over loopback, 50 us
per ring step and 1 GB/s per direction, not measured.

**Components** (seconds per step; `COMPONENTS`):

    component              predicted                        measured (median per step)
    step time              the estimate's step_time_s       step_time_s
    compute                compute + bubble + optimizer     step_time_s - exposed_comm_s
    exposed communication  the breakdown's comm             exposed_comm_s
    data wait              0 (the batch is assumed there)   data_wait_s
    MFU                    flops_per_step / (step x peak)   mfu
    tokens/s               batch x seq / step               tokens_per_s

(the peak is that of all the job's devices together, as the job's own MFU takes it).

The optimizer is not timed apart from the step, so it is inside compute on both sides. On the
xla and neuron engines XLA schedules the collectives inside the step: communication, and so
compute, are not measured there.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import JobError
from ..ir.plan import Plan
from ..ir.program import Program
from ..ir.signature import InputKind
from ..planner.estimate import Estimate, price
from ..planner.models import costs_of
from ..planner.parallelism import Parallelism
from ..planner.systems import Efficiency, Link, System, canonical_format, system
from ..recipe import recipe_of
from .engine import Engine
from .peaks import detect_device, measure_cpu_peak
from .prepare import JobFiles

__all__ = [
    "COMPONENTS",
    "CPU_LINK",
    "PREDICTION_FILE",
    "SYSTEMS",
    "compare",
    "comparison",
    "cpu_system",
    "job_parallelism",
    "measure_memory_bandwidth",
    "measure_op_overhead",
    "measured",
    "predict",
    "write_prediction",
]

PREDICTION_FILE = "prediction.json"
FORMAT, FORMAT_VERSION = "portable-prediction", 1

# (key, label): the predicted and measured figures compared, seconds per step unless named
COMPONENTS = (
    ("step_time_s", "step time"),
    ("compute_s", "compute (with the optimizer)"),
    ("exposed_comm_s", "exposed communication"),
    ("data_wait_s", "data wait"),
    ("mfu", "MFU"),
    ("tokens_per_s", "tokens/s"),
)

# detected device kind (peaks.detect_device) -> planner system
SYSTEMS = {
    "trn1": "trn1",
    "trn2": "trn2",
    "trn3": "trn3-gen1",
    "h100": "h100",
    "h200": "h200",
    "b200": "b200",
    "gb200": "gb200-nvl72",
}
# the CPU's link between ranks: ASSUMED, not measured (module docstring)
CPU_LINK = Link(
    level="node",
    devices=1,  # replaced by the job's device count
    bandwidth=1e9,
    latency_s=50e-6,
    source="assumed: gloo over loopback TCP, 50 us per ring step, 1 GB/s per direction",
)
_TIMED_ENGINES = ("cpu", "cuda")  # engines that time their collectives (comm_stats)
_MAX_ASSUMPTIONS, _MAX_TEXT = 16, 300


# --------------------------------------------------------------------------- the prediction


def predict(
    files: JobFiles, engine: Engine, *, first_step: int, cpu_peak_flops: float | None = None
) -> dict[str, Any]:
    """The prediction document (PREDICTION_FILE) of the job in `files`, run by `engine` from
    `first_step` on; `cpu_peak_flops`: the CPU peak of all the job's devices (the launcher's)."""
    started = time.perf_counter()
    doc = files.doc
    per_rank = files.per_rank
    seq, batch = int(doc["seq"]), int(doc["batch"])
    precision = canonical_format(recipe_of(per_rank.metadata).precision.compute_dtype)
    kind = detect_device(engine.device_kind)
    devices = engine.devices
    if kind == "cpu":
        peak = cpu_peak_flops if cpu_peak_flops else _this_process_peak(per_rank, engine)
        host, assumptions = cpu_system(
            peak / devices, devices, precision, devices_per_process=devices // engine.world
        )
    else:
        host = system(SYSTEMS[kind], devices=devices)
        assumptions = [f"{host.name}: {host.efficiency.source}"]
    plan = job_parallelism(per_rank.plan, devices, per_rank)
    estimate = price(costs_of(per_rank, seq=seq), host, plan)
    flops = doc.get("flops_per_step")
    peak_all = host.peak(precision) * devices
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "first_step": first_step,
        "engine": files.config.engine,
        "system": _system_doc(host, precision),
        "plan": {"describe": estimate.plan.describe(), **dataclasses.asdict(estimate.plan)},
        "predicted": _components(estimate, flops, peak_all, batch * seq),
        "breakdown": estimate.breakdown.as_dict(),
        "flops_per_step": flops,
        "peak_flops": peak_all,
        "assumptions": assumptions,
        "seconds": time.perf_counter() - started,
    }


def write_prediction(
    run: Path,
    files: JobFiles,
    engine: Engine,
    *,
    first_step: int,
    cpu_peak_flops: float | None = None,
) -> dict[str, Any]:
    """`predict`, written to RUN/PREDICTION_FILE (replaced atomically) and returned. A
    prediction that cannot be made is written as its `error`: it never stops the job."""
    try:
        doc = predict(files, engine, first_step=first_step, cpu_peak_flops=cpu_peak_flops)
    except Exception as exc:  # a measurement aid: the job runs without it
        reason = f"{type(exc).__name__}: {exc}"[:_MAX_TEXT]
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "first_step": first_step}
        doc["error"] = reason
    tmp = run / f".{PREDICTION_FILE}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        tmp.replace(run / PREDICTION_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    return doc


def _components(
    estimate: Estimate, flops: Any, peak_all: float, tokens: int
) -> dict[str, float | None]:
    b = estimate.breakdown
    step = estimate.step_time_s
    counted = isinstance(flops, int | float) and not isinstance(flops, bool) and flops > 0
    return {
        "step_time_s": step,
        "compute_s": b.compute + b.bubble + b.optimizer,
        "exposed_comm_s": b.comm,
        "data_wait_s": 0.0,
        "mfu": float(flops) / (step * peak_all) if counted else None,
        "tokens_per_s": tokens / step,
    }


def _system_doc(host: System, precision: str) -> dict[str, Any]:
    link = host.links[0]
    return {
        "name": host.name,
        "chip": host.chip,
        "devices": host.devices,
        "precision": precision,
        "peak_flops_per_device": host.peak(precision),
        "memory_bandwidth": host.hbm_bandwidth,
        "kernel_overhead_s": host.efficiency.kernel_overhead_s,
        "link": {"level": link.level, "bandwidth": link.bandwidth, "latency_s": link.latency_s},
        "calibrated": host.efficiency.calibrated,
    }


def _this_process_peak(program: Program, engine: Engine) -> float:
    """The CPU peak of all devices when the launcher recorded none (a job started elsewhere)."""
    return measure_cpu_peak(recipe_of(program.metadata).precision.compute_dtype) * engine.world


# --------------------------------------------------------------------------- the plan


def job_parallelism(plan: Plan, devices: int, program: Program) -> Parallelism:
    """The planner's `Parallelism` for a per-rank `program` partitioned by `plan` over
    `devices` devices (module docstring)."""
    mesh = plan.mesh
    sharded = {a for _, spec in plan.specs for a in spec.axes()}
    sharded |= {a for rule in plan.rules for a in rule.spec.axes()}
    sharded.discard(plan.fsdp_axis or "")
    tp = math.prod(mesh.axis_size(a) for a in sharded) if mesh is not None else 1
    dp = devices // tp
    return Parallelism(
        tp=tp,
        dp=dp,
        global_batch=dp,
        micro_batch=1,
        zero=3 if plan.fsdp_axis else 0,
        recompute="none",
        precision=canonical_format(recipe_of(program.metadata).precision.compute_dtype),
        overlap_grad_reduce=_overlaps(program),
        grad_bytes=_grad_bytes(program),
    )


def _overlaps(program: Program) -> bool:
    """Whether some collective is waited for later than the op right after it."""
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    wait = torch.ops.portable.wait.default
    for i, node in enumerate(calls):
        if any(u.target is wait for u in node.users):
            after = calls[i + 1] if i + 1 < len(calls) else None
            if after is None or after.target is not wait or node not in after.all_input_nodes:
                return True
    return False


def _grad_bytes(program: Program) -> int:
    sizes = [
        s.spec.dtype.itemsize for s in program.signature.inputs if s.kind is InputKind.PARAMETER
    ]
    return max(sizes, default=4)


# --------------------------------------------------------------------------- the CPU


def cpu_system(
    peak_per_device: float,
    devices: int,
    precision: str,
    *,
    devices_per_process: int = 1,
    memory_bandwidth: float | None = None,
    op_overhead_s: float | None = None,
) -> tuple[System, list[str]]:
    """A planner System of `devices` CPU devices at `peak_per_device` FLOP/s in `precision`,
    and the assumptions it makes (module docstring). The memory bandwidth and the op overhead
    are measured on this process unless given; this process runs `devices_per_process` of the
    devices (its bandwidth is split over them)."""
    if not (math.isfinite(peak_per_device) and peak_per_device > 0):
        raise JobError(
            f"a CPU peak of {peak_per_device!r} FLOP/s per device",
            fix="pass the measured peak (portable.jobs.peaks.measure_cpu_peak)",
        )
    bandwidth = memory_bandwidth or measure_memory_bandwidth() / max(devices_per_process, 1)
    overhead = op_overhead_s if op_overhead_s is not None else measure_op_overhead()
    links = (
        dataclasses.replace(CPU_LINK, devices=devices),
        dataclasses.replace(CPU_LINK, level="network", devices=0),
    )
    measured_on = f"{torch.get_num_threads()} thread(s)"
    host = System(
        name="cpu",
        chip="cpu",
        devices=devices,
        peak_flops={precision: peak_per_device},
        hbm_bytes=_physical_memory() // max(devices, 1),
        hbm_bandwidth=bandwidth,
        links=links,
        efficiency=Efficiency(
            matmul=1.0,
            memory=1.0,
            kernel_overhead_s=overhead,
            link={"node": 1.0, "network": 1.0},
            calibrated=False,
            source="measured on this host; the link assumed",
        ),
        price_per_device_hour=None,
        notes=(),
    )
    assumptions = [
        f"peak: the launcher's measured matmul rate, {peak_per_device / 1e9:.4g} GFLOP/s per "
        f"device in {precision} (efficiency 1)",
        f"memory bandwidth: measured copy rate (read + write) on {measured_on}, "
        f"{bandwidth / 1e9:.4g} GB/s per device (efficiency 1)",
        f"kernel overhead: one tiny eager op, {overhead * 1e6:.3g} us, per kernel the planner "
        "counts (fused groups; the cpu backend runs every op unfused)",
        f"link: {CPU_LINK.source}",
    ]
    return host, assumptions


_BANDWIDTH: dict[int, float] = {}  # torch threads -> bytes/s, this process
_OVERHEAD: list[float] = []


def measure_memory_bandwidth(*, nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """This process's best copy rate in bytes/s (bytes read plus bytes written) on its torch
    threads: `repeats` copies of an `nbytes` buffer, larger than the caches, the fastest taken.
    Measured once per thread count per process."""
    threads = torch.get_num_threads()
    if threads not in _BANDWIDTH:
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)  # the pages touched
        best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
        _BANDWIDTH[threads] = 2.0 * src.numel() * src.element_size() / best
    return _BANDWIDTH[threads]


def measure_op_overhead(*, ops: int = 2000) -> float:
    """Seconds per tiny eager op (a one-element add) on this process: the dispatch cost every
    kernel pays on the CPU. Measured once per process."""
    if not _OVERHEAD:
        a, b = torch.ones(1), torch.ones(1)
        torch.add(a, b)

        def run() -> None:
            for _ in range(ops):
                torch.add(a, b)

        _OVERHEAD.append(min(_timed(run) for _ in range(3)) / ops)
    return _OVERHEAD[0]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-9)


def _physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # not a POSIX sysconf name here
        return 0


# --------------------------------------------------------------------------- the comparison


def measured(
    records: Sequence[Mapping[str, Any]], *, first_step: int, warmup: int, comm_timed: bool
) -> tuple[dict[str, float | None], list[int]]:
    """Medians of the steady steps of `records` (metrics.jsonl): steps from `first_step`, less
    the first `warmup` of them when more are left; and those steps' numbers. Communication
    and compute are None where the engine does not time its collectives (`comm_timed`)."""
    mine = sorted(
        (r for r in records if (_num(r.get("step")) or 0) >= first_step),
        key=lambda r: _num(r.get("step")) or 0,
    )
    steady = mine[warmup:] if len(mine) > warmup else mine

    def median(get: Callable[[Mapping[str, Any]], float | None]) -> float | None:
        values = [v for v in map(get, steady) if v is not None]
        return statistics.median(values) if values else None

    def compute(r: Mapping[str, Any]) -> float | None:
        step, comm = _num(r.get("step_time_s")), _num(r.get("exposed_comm_s"))
        return step - comm if step is not None and comm is not None else None

    out = {key: median(_field(key)) for key in _RECORDED}
    out["compute_s"] = median(compute)
    if not comm_timed:
        out["compute_s"] = out["exposed_comm_s"] = None
    return {key: out[key] for key, _ in COMPONENTS}, [int(_num(r["step"]) or 0) for r in steady]


_RECORDED = ("step_time_s", "data_wait_s", "mfu", "tokens_per_s", "exposed_comm_s")


def _field(key: str) -> Callable[[Mapping[str, Any]], float | None]:
    return lambda record: _num(record.get(key))


def compare(
    predicted: Mapping[str, float | None], measured: Mapping[str, float | None]
) -> list[dict[str, Any]]:
    """One row per COMPONENTS entry: its predicted and measured values and
    `measured_over_predicted` (None unless both are finite and the prediction is above 0)."""
    rows = []
    for key, label in COMPONENTS:
        p, m = _num(predicted.get(key)), _num(measured.get(key))
        ratio = m / p if p is not None and m is not None and p > 0 else None
        rows.append(
            {
                "component": key,
                "label": label,
                "predicted": p,
                "measured": m,
                "measured_over_predicted": ratio,
            }
        )
    return rows


def comparison(
    doc: Mapping[str, Any], records: Sequence[Mapping[str, Any]], *, warmup: int
) -> dict[str, Any]:
    """The predicted-vs-measured section of a report: the prediction document `doc` (read from
    RUN/PREDICTION_FILE: untrusted, every value checked) against the run's metrics records."""
    if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise JobError(
            f"{PREDICTION_FILE} is not a {FORMAT} document of version {FORMAT_VERSION}",
            fix=f"re-run the job (it writes {PREDICTION_FILE} when it starts) or remove the file",
        )
    first = int(_num(doc.get("first_step")) or 1)
    out: dict[str, Any] = {"first_step": first, "error": _text(doc.get("error"))}
    if out["error"] is not None:
        return {**out, "rows": [], "steady_steps": 0, "steady_from": None}
    engine = _text(doc.get("engine"))
    values, steady = measured(
        records, first_step=first, warmup=warmup, comm_timed=engine in _TIMED_ENGINES
    )
    host, plan, predicted = (_mapping(doc.get(k)) for k in ("system", "plan", "predicted"))
    assumptions = doc.get("assumptions")
    notes = assumptions[:_MAX_ASSUMPTIONS] if isinstance(assumptions, list) else []
    return {
        **out,
        "engine": engine,
        "system": _text(host.get("name")),
        "devices": _num(host.get("devices")),
        "precision": _text(host.get("precision")),
        "plan": _text(plan.get("describe")),
        "steady_steps": len(steady),
        "steady_from": steady[0] if steady else None,
        "rows": compare(predicted, values),
        "breakdown": {
            _text(k) or "?": _num(v) for k, v in list(_mapping(doc.get("breakdown")).items())[:16]
        },
        "assumptions": [t for t in map(_text, notes) if t is not None],
    }


def _num(value: Any) -> float | None:
    """A finite number from a file, else None (bools are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _text(value: Any) -> str | None:
    return value[:_MAX_TEXT] if isinstance(value, str) else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}
