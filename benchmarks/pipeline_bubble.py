"""Pipeline bubble, measured against the schedule's formula; zero-bubble against 1F1B.

    python benchmarks/pipeline_bubble.py [--small] [--steps 5] [--rounds 7] [--json R]
                                         [--write docs/performance.md]

The GPT example (examples/gpt.py) scaled so that a stage's programs are compute-bound (8 layers
x 384 wide, 6 heads, vocabulary 256, micro-batches of 4 x 64 tokens), captured as an AdamW
training step with `accumulate=m` (once per m, here), cut into stages by `split_stages` (split
points balanced by counted FLOPs, the pass's default) in each of p processes, which run them on
gloo, one torch thread each, under `PipelineRank` (torch.distributed.pipelining's own
schedules). The ranks start every step together (a barrier) after one warm-up step.

1. Bubble: 1F1B at p = 2, 4 and m = 4, 8, 16. Per step and rank, `busy_s` is the time the rank
   spent inside its stage programs; its idle share is `1 - busy_s / step`, where step is the
   pipeline's step: the slowest rank's `step_s` (the wall time of its schedule's step), the
   denominator of the formula (p-1)/(m+p-1), which every rank's idle share equals when stage
   costs are equal. Also reported: the runner's own number, `1 - busy_s / step_s` with the
   rank's own `step_s` (portable/distributed/pipeline_worker.py): the last stage's schedule
   ends with its last backward, before the first stage's, so its own share is smaller than its
   idle share of the pipeline's step. Medians over `--steps` steps, per rank and their mean;
   goal: the mean idle share within 5 points of the formula. A configuration with more ranks
   than the host has cores is flagged as not representative: the processes time-slice the
   cores, and time a rank spends waiting for a core inside its programs counts as busy. "On
   CPU while busy" measures that per rank: the thread's CPU time inside its stage programs
   over their wall time (1.0: it never waited for a core while busy). "Idle, actions" counts
   as busy the whole of the schedule's forward and backward actions instead of the programs
   alone: the difference is the work around the programs (autograd accumulating each
   micro-batch's parameter gradients into `.grad` above all), which `busy_s` leaves out.
2. Zero-bubble (torch's interleaved zero-bubble schedule with one stage per rank, ZB1P: the
   weight-gradient half of each backward deferred through the stage's `dw_builder`) against
   1F1B at p = 2, m = 8, on the same step in the same two processes, interleaved round by
   round (a 1F1B step, then a zero-bubble step, each schedule with its own copy of the state):
   median step time of each (the slowest rank's), their ratio, each schedule's idle shares.
   "Same memory": per rank, the most micro-batches whose activations were held at once,
   counted as the schedule ran: a `forward` program call takes one, the `backward` (1F1B) or
   `backward_weight` (zero-bubble: the weight-gradient stash keeps the residuals until then)
   call releases one (1F1B's known bound is p - rank). The losses of both schedules over all
   steps are compared with each other and with the single-device step's
   (`portable.compile(step, backend="cpu")`, the same accumulation). The 1F1B configuration
   (2, 8) of part 1 is taken from this run's 1F1B steps.

The host's core count and load average (before, after, and after each configuration) are
recorded: other jobs sharing the cores inflate `busy_s` as time-slicing does.
`--small` (seconds): p = 2, m = 4, a 2-layer 32-wide model, 2 steps; it checks the machinery
(finite values, the formula fields, equal losses), not the timings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- pipeline_bubble -->"
HEADING = "## Pipeline bubble (`pipeline_split`, torch.distributed.pipelining)"
GOAL_POINTS = 5.0
ON_CPU_MIN = 0.9  # below: a rank waited for a core for over a tenth of its busy time
TOL = 1e-5  # pipelined vs single-device losses (tests/test_pipeline_torch.py's tolerance)
FULL = {
    "layers": 8,
    "width": 384,
    "heads": 6,
    "vocab": 256,
    "seq": 64,
    "rows": 4,
    "pps": [2, 4],
    "ms": [4, 8, 16],
    "zb_m": 8,
}
SMALL = {
    "layers": 2,
    "width": 32,
    "heads": 2,
    "vocab": 64,
    "seq": 8,
    "rows": 1,
    "pps": [2],
    "ms": [4],
    "zb_m": 4,
}
PARAGRAPH = """\
`python benchmarks/pipeline_bubble.py --write docs/performance.md` (about 5 minutes; details in
the script's docstring) measures the idle share of a pipelined training step against the
schedule's formula: the GPT example scaled to 8 layers x 384 wide (micro-batches of 4 x 64
tokens), captured as an AdamW step with `accumulate=m`, cut by `split_stages` (split points
balanced by counted FLOPs) and run by p gloo processes, one torch thread each, under
`PipelineRank` (torch.distributed.pipelining's own schedules), the ranks started together each
step. (1) 1F1B at p = 2, 4 and m = 4, 8, 16: after a warm-up step, each rank's idle share is
1 - (time inside its stage programs) / (the pipeline's step, the slowest rank's), the median
over 5 steps, against (p-1)/(m+p-1); goal: the mean within 5 points. Beside it: the runner's
own number (`1 - busy / the rank's own step`), and the idle share with the whole forward and
backward actions counted as busy (the programs plus the work around them, autograd accumulating
parameter gradients into `.grad` above all). With more ranks than the host has cores
the processes time-slice, and a rank waiting for a core counts as busy: those rows are marked
not representative, as are rows where other jobs on this shared host took the cores (a rank on
CPU less than 90% of the time it spent in its programs); the load average is recorded.
(2) Zero-bubble (ZB1P, weight gradients deferred) against 1F1B at p = 2, m = 8 in the same
processes, steps interleaved: median step times and their ratio, the most micro-batches whose
activations each rank held at once (counted as the schedules ran), and both schedules' losses
against each other and the single-device step."""


# ---------------------------------------------------------------------------- the step


def capture(cfg: dict[str, Any], m: int):
    """The GPT training step with `accumulate=m` (no plan yet) and its global batch."""
    import importlib.util

    import torch.nn.functional as F

    import portable

    spec = importlib.util.spec_from_file_location("_bench_gpt", REPO / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    sys.modules["_bench_gpt"] = gpt
    spec.loader.exec_module(gpt)
    config = gpt.GPTConfig(
        vocab_size=cfg["vocab"],
        block_size=cfg["seq"],
        n_layer=cfg["layers"],
        n_head=cfg["heads"],
        n_embd=cfg["width"],
    )
    torch.manual_seed(0)
    model = gpt.GPT(config)
    gen = torch.Generator().manual_seed(1)
    shape = (cfg["rows"] * m, cfg["seq"])
    batch = tuple(torch.randint(0, cfg["vocab"], shape, generator=gen) for _ in range(2))

    def loss_fn(model, idx, targets):
        return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())

    step = portable.capture(
        model, batch, loss_fn=loss_fn, optimizer=portable.optim.AdamW(lr=1e-3), accumulate=m
    )
    return step, batch


def with_plan(step, p: int, m: int, schedule: str):
    from portable import Mesh, Pipeline, Plan

    return step.replace(
        plan=Plan(Mesh({"pp": p}), pipeline=Pipeline(schedule=schedule, microbatches=m))
    )


def reference_losses(step, batch, steps: int) -> list[float]:
    """The single-device step's losses (cpu backend, the same accumulation), `steps` steps."""
    import portable
    from portable import Plan

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exe = portable.compile(step.replace(plan=Plan()), backend="cpu")
        return [float(exe(*batch).loss) for _ in range(steps)]
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- one rank


class ProgramCalls:
    """Wraps one rank's stage program calls. Counts the micro-batches whose activations are
    held: a `forward` call takes one; `backward` (1F1B) or `backward_weight` (zero-bubble: the
    weight-gradient stash keeps the residuals until then) releases one; `peak` is the most at
    once, in the order the schedule ran them. `cpu_s` is this thread's CPU time inside the
    schedule's calls (not the update's, as `busy_s`; with one torch thread the work runs on
    this thread), `wall_s` their wall time: the ratio is below 1 when the rank waited for a
    core while busy (other processes on its core). `action_s` is the wall time of the
    schedule's compute actions on this rank's torch stages (forward, backward, weight-gradient
    chunks): the programs plus what runs around them inside an action, autograd's
    accumulation of each micro-batch's parameter gradients into `.grad` above all."""

    ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, runner: Any) -> None:
        self.now = self.peak = 0
        self.cpu_s = self.wall_s = self.action_s = 0.0
        for rt in runner.runtimes:
            rt.call = self.wrap(rt.call)
        schedule = runner.schedule
        for stage in getattr(schedule, "_stages", None) or [schedule._stage]:
            for name in self.ACTIONS:
                setattr(stage, name, self.timed(getattr(stage, name)))

    def timed(self, action: Any) -> Any:
        def timed_action(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return action(*args, **kwargs)
            finally:
                self.action_s += time.perf_counter() - start

        return timed_action

    def wrap(self, call: Any) -> Any:
        def counted(part: str, env: Any) -> Any:
            cpu, wall = time.thread_time(), time.perf_counter()
            out = call(part, env)
            if part != "update":  # as `busy_s`, which ends with the schedule's step
                self.cpu_s += time.thread_time() - cpu
                self.wall_s += time.perf_counter() - wall
            if part == "forward":
                self.now += 1
                self.peak = max(self.peak, self.now)
            elif part in ("backward", "backward_weight"):
                self.now -= 1
            return out

        return counted


def rank_main(args) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    import portable
    from portable.distributed.pipeline import PipelineRank
    from portable.passes.pipeline_split import split_stages

    programs = [portable.load(path) for path in args.program]
    loaded = safetensors.torch.load_file(args.batch)  # tensors only: nothing runs on load
    batch = tuple(loaded[str(i)] for i in range(len(loaded)))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.world
    )
    runners = []
    record: dict[str, Any] = {}
    for program in programs:
        stages = split_stages(program)
        names = [i.name for i in program.signature.user_inputs]
        inputs = dict(zip(names, batch, strict=True))
        runner = PipelineRank(stages, program.weights, inputs)
        schedule = program.plan.pipeline.schedule
        runners.append((schedule, runner, inputs, ProgramCalls(runner)))
        record[schedule] = {
            "step_s": [],
            "busy_s": [],
            "wall_s": [],
            "cpu_s": [],
            "calls_s": [],
            "action_s": [],
            "losses": [],
            "split_points": list(stages.split_points),
        }
    for round_ in range(args.warmup + args.steps):
        for schedule, runner, inputs, calls in runners:
            dist.barrier()
            cpu, calls_wall, actions = calls.cpu_s, calls.wall_s, calls.action_s
            start = time.perf_counter()
            loss, _ = runner.step(inputs)
            wall = time.perf_counter() - start
            cpu, calls_wall = calls.cpu_s - cpu, calls.wall_s - calls_wall
            actions = calls.action_s - actions
            rec = record[schedule]
            if loss is not None:
                rec["losses"].append(float(loss.detach()))
            if round_ >= args.warmup:
                rec["step_s"].append(runner.step_s)
                rec["busy_s"].append(runner.busy_s)
                rec["wall_s"].append(wall)
                rec["cpu_s"].append(cpu)
                rec["calls_s"].append(calls_wall)
                rec["action_s"].append(actions)
    for schedule, _, _, calls in runners:
        record[schedule]["held"] = calls.peak
    Path(args.out).write_text(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- driver


def run_ranks(programs: list[Path], batch: Path, p: int, steps: int, tmp: Path) -> list[dict]:
    """Start p rank processes on `programs` (run round by round); each rank's record."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    common = [sys.executable, __file__, "--port", str(port), "--world", str(p)]
    common += ["--batch", str(batch), "--steps", str(steps), "--warmup", "1"]
    for program in programs:
        common += ["--program", str(program)]
    outs = [tmp / f"rank{r}.json" for r in range(p)]
    procs = [
        subprocess.Popen(
            [*common, "--rank", str(r), "--out", str(outs[r])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(p)
    ]
    logs = [proc.communicate(timeout=1800)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError("a rank failed:\n" + "\n".join(log[-3000:] for log in logs))
    return [json.loads(out.read_text()) for out in outs]


def bubbles(recs: list[dict]) -> dict[str, Any]:
    """Per rank, medians over the steps: `idle` = 1 - busy / the job's step (the slowest
    rank's `step_s` in that step: the pipeline's step, the formula's denominator) and `own` =
    1 - busy / the rank's own `step_s` (what the runner reports; the last stage's step ends
    with its last backward, before the first stage's, so its own share is smaller);
    `idle_actions` = 1 - (time in the schedule's compute actions) / the job's step."""
    steps = len(recs[0]["step_s"])
    job = [max(r["step_s"][k] for r in recs) for k in range(steps)]

    def share(busy: list[float], step: list[float]) -> float:
        return statistics.median([1.0 - b / s for b, s in zip(busy, step, strict=True)])

    return {
        "step_s": statistics.median(job),
        "idle": [share(r["busy_s"], job) for r in recs],
        "own": [share(r["busy_s"], r["step_s"]) for r in recs],
        "idle_actions": [share(r["action_s"], job) for r in recs],
    }


def on_cpu(recs: list[dict]) -> list[float]:
    """Per rank, CPU time / wall time inside its stage programs over the measured steps (1.0:
    never waited for a core while busy)."""
    return [sum(r["cpu_s"]) / sum(r["calls_s"]) for r in recs]


def bubble_row(p: int, m: int, recs: list[dict], cores: int, run: str) -> dict[str, Any]:
    """One 1F1B configuration from its ranks' records."""
    from portable.distributed.pipeline import bubble_formula

    b = bubbles(recs)
    mean = statistics.fmean(b["idle"])
    formula = bubble_formula("1f1b", p, m)
    diff = 100.0 * (mean - formula)
    return {
        "p": p,
        "m": m,
        "run": run,
        "split_points": recs[0]["split_points"],
        "step_s": b["step_s"],
        "busy_s_per_rank": [statistics.median(r["busy_s"]) for r in recs],
        "bubble_per_rank": b["idle"],
        "bubble_mean": mean,
        "own_bubble_per_rank": b["own"],
        "own_bubble_mean": statistics.fmean(b["own"]),
        "action_idle_per_rank": b["idle_actions"],
        "action_idle_mean": statistics.fmean(b["idle_actions"]),
        "formula": formula,
        "diff_points": diff,
        "within_goal": abs(diff) <= GOAL_POINTS,
        "oversubscribed": p > cores,
        "contended": min(on_cpu(recs)) < ON_CPU_MIN,
        "representative": p <= cores and min(on_cpu(recs)) >= ON_CPU_MIN,
        "held_per_rank": [r["held"] for r in recs],
        "on_cpu_per_rank": on_cpu(recs),
        "loadavg_1min_after": round(os.getloadavg()[0], 2),
    }


def measure(cfg: dict[str, Any], steps: int, rounds: int) -> dict[str, Any]:
    """Both parts. The 1F1B configuration (2, zb_m) is measured in the comparison's run (its
    1F1B steps) rather than in a run of its own."""
    from portable.distributed.pipeline import bubble_formula

    cores = len(os.sched_getaffinity(0))
    result: dict[str, Any] = {
        "benchmark": "pipeline_bubble",
        "config": {**cfg, "steps": steps, "rounds": rounds},
        "host": {
            "cores": cores,
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "threads_per_process": 1,
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        },
    }
    zb_m = cfg["zb_m"]
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="pipeline-bubble-") as tmp_:
        tmp = Path(tmp_)
        captured: dict[int, tuple[Any, Any, Path]] = {}

        def step_of(m: int) -> tuple[Any, Any, Path]:
            if m not in captured:
                step, batch = capture(cfg, m)
                path = tmp / f"batch{m}.safetensors"
                safetensors.torch.save_file({str(i): t for i, t in enumerate(batch)}, path)
                captured[m] = (step, batch, path)
            return captured[m]

        # 2. zero-bubble against 1F1B, the same step, interleaved round by round
        step, batch, batch_path = step_of(zb_m)
        paths = [
            with_plan(step, 2, zb_m, s).save(tmp / f"zb-{s}.portable")
            for s in ("1f1b", "zero-bubble")
        ]
        records = run_ranks(paths, batch_path, 2, rounds, tmp)
        reference = reference_losses(step, batch, 1 + rounds)
        rows[2, zb_m] = bubble_row(
            2, zb_m, [r["1f1b"] for r in records], cores, "the comparison's 1F1B steps"
        )
        # 1. the bubble of 1F1B against the formula
        for p in cfg["pps"]:
            for m in cfg["ms"]:
                if (p, m) in rows:
                    continue
                step, _, batch_path = step_of(m)
                program = with_plan(step, p, m, "1f1b").save(tmp / f"p{p}m{m}.portable")
                recs = [r["1f1b"] for r in run_ranks([program], batch_path, p, steps, tmp)]
                rows[p, m] = bubble_row(p, m, recs, cores, "own")
    result["bubble"] = [rows[p, m] for p in cfg["pps"] for m in cfg["ms"]]
    zb: dict[str, Any] = {"p": 2, "m": zb_m, "reference_losses": reference}
    for schedule in ("1f1b", "zero-bubble"):
        recs = [r[schedule] for r in records]
        losses = next(r["losses"] for r in recs if r["losses"])
        b = bubbles(recs)
        steps = len(recs[0]["wall_s"])
        zb[schedule] = {
            "step_s": b["step_s"],
            "wall_s": statistics.median(max(r["wall_s"][k] for r in recs) for k in range(steps)),
            "bubble_per_rank": b["idle"],
            "bubble_mean": statistics.fmean(b["idle"]),
            "own_bubble_per_rank": b["own"],
            "action_idle_per_rank": b["idle_actions"],
            "on_cpu_per_rank": on_cpu(recs),
            "formula": bubble_formula(schedule, 2, zb_m),
            "held_per_rank": [r["held"] for r in recs],
            "losses": losses,
            "max_diff_vs_single": max(abs(a - b) for a, b in zip(losses, reference, strict=True)),
        }
    zb["ratio"] = zb["zero-bubble"]["step_s"] / zb["1f1b"]["step_s"]
    zb["wall_ratio"] = zb["zero-bubble"]["wall_s"] / zb["1f1b"]["wall_s"]
    zb["losses_identical"] = zb["1f1b"]["losses"] == zb["zero-bubble"]["losses"]
    zb["single_bit_identical"] = zb["1f1b"]["losses"] == reference
    zb["single_within_tol"] = all(
        zb[s]["max_diff_vs_single"] <= TOL for s in ("1f1b", "zero-bubble")
    )
    result["zero_bubble"] = zb
    result["host"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return result


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}"


def _ranks(values: list[float]) -> str:
    return " / ".join(_pct(v) for v in values)


def table(r: dict[str, Any]) -> str:
    c, h = r["config"], r["host"]
    z = r["zero_bubble"]
    lines = [
        f"torch {h['torch']}, gloo, {h['threads_per_process']} torch thread per process, "
        f"host with {h['cores']} cores, load average (1/5/15 min) "
        f"{'/'.join(map(str, h['loadavg_before']))} before, "
        f"{'/'.join(map(str, h['loadavg_after']))} after; GPT {c['layers']} layers x "
        f"{c['width']} wide, {c['heads']} heads, vocabulary {c['vocab']}, micro-batches of "
        f"{c['rows']} x {c['seq']} tokens, AdamW; medians over {c['steps']} steps after a "
        f"warm-up (p = 2, m = {z['m']}: the comparison's {c['rounds']} 1F1B steps)",
        "",
        "1F1B, percent of the step; idle = 1 - busy / the pipeline's step (the slowest rank's); "
        "own = 1 - busy / the rank's own step (the runner's number); actions = 1 - (time in "
        "the schedule's forward/backward actions, the programs plus autograd's gradient "
        "accumulation around them) / the pipeline's step; on CPU while busy = CPU time / wall "
        "time inside the stage programs (below 100: the rank waited for a core); "
        "ranks 0 / 1 / ...:",
        "",
        "| p | m | split points | step (ms) | busy (ms) | idle | mean idle | formula "
        "| diff (points) | goal: within 5 | own | mean own | mean idle, actions "
        "| on CPU while busy | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["bubble"]:
        verdict = "met" if row["within_goal"] else "not met"
        if row["oversubscribed"]:
            verdict += f"; NOT REPRESENTATIVE ({row['p']} processes on {h['cores']} cores)"
        elif row["contended"]:
            verdict += "; NOT REPRESENTATIVE (other load: ranks waited for a core while busy)"
        lines.append(
            f"| {row['p']} | {row['m']} | {', '.join(row['split_points'])} "
            f"| {row['step_s'] * 1e3:.0f} "
            f"| {' / '.join(f'{b * 1e3:.0f}' for b in row['busy_s_per_rank'])} "
            f"| {_ranks(row['bubble_per_rank'])} | {_pct(row['bubble_mean'])} "
            f"| {_pct(row['formula'])} | {row['diff_points']:+.1f} | {verdict} "
            f"| {_ranks(row['own_bubble_per_rank'])} | {_pct(row['own_bubble_mean'])} "
            f"| {_pct(row['action_idle_mean'])} "
            f"| {_ranks(row['on_cpu_per_rank'])} | {row['loadavg_1min_after']} |"
        )
    lines += [
        "",
        f"Zero-bubble (ZB1P) against 1F1B, p = {z['p']}, m = {z['m']}, the same processes, "
        f"steps interleaved, medians over {c['rounds']} rounds after a warm-up:",
        "",
        "| schedule | step (ms) | step + update (ms) | idle | idle, actions | formula "
        "| micro-batches held per rank (most at once) | on CPU while busy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for schedule in ("1f1b", "zero-bubble"):
        s = z[schedule]
        lines.append(
            f"| {schedule} | {s['step_s'] * 1e3:.0f} | {s['wall_s'] * 1e3:.0f} "
            f"| {_ranks(s['bubble_per_rank'])} | {_ranks(s['action_idle_per_rank'])} "
            f"| {_pct(s['formula'])} "
            f"| {' / '.join(str(x) for x in s['held_per_rank'])} "
            f"| {_ranks(s['on_cpu_per_rank'])} |"
        )
    one, zero = z["1f1b"], z["zero-bubble"]
    same = sum(a == b for a, b in zip(one["losses"], z["reference_losses"], strict=True))
    lines += [
        "",
        f"step time, zero-bubble / 1F1B: {z['ratio']:.3f} (with the update: "
        f"{z['wall_ratio']:.3f}); most micro-batches held on any rank: "
        f"{max(one['held_per_rank'])} (1F1B), {max(zero['held_per_rank'])} (zero-bubble)",
        f"losses, zero-bubble == 1F1B (bit for bit) over {len(one['losses'])} steps: "
        f"{z['losses_identical']}; against the single-device step: bit-identical in "
        f"{same} of {len(one['losses'])} steps, largest difference "
        f"{one['max_diff_vs_single']:.2e} (1F1B), {zero['max_diff_vs_single']:.2e} "
        f"(zero-bubble), within {TOL:g}: {z['single_within_tol']}",
    ]
    if min(min(z[k]["on_cpu_per_rank"]) for k in ("1f1b", "zero-bubble")) < ON_CPU_MIN:
        lines.append(
            "the zero-bubble comparison is NOT REPRESENTATIVE: other processes took the cores "
            "(a rank was on CPU < 90% of its busy time)"
        )
    for row in r["bubble"]:
        if not row["representative"]:
            continue
        busy = row["busy_s_per_rank"]
        lines.append(
            f"p={row['p']} m={row['m']}: {row['diff_points']:+.1f} points over the formula, of "
            f"which {100 * (row['bubble_mean'] - row['action_idle_mean']):.1f} is work inside "
            "the schedule's actions around the programs (the actions column), the rest time "
            "outside them (waits on the neighbour, point-to-point transfers, the schedule's code); "
            f"busy ranks differ by {100 * (max(busy) / min(busy) - 1):.1f}%"
        )
    groups = [
        ("representative (a core per rank, on CPU >= 90% while busy)", "representative"),
        (
            f"p > {h['cores']} cores: NOT REPRESENTATIVE (the ranks time-slice the cores, and a "
            "rank waiting for a core inside its programs counts as busy)",
            "oversubscribed",
        ),
        (
            f"p <= {h['cores']} but NOT REPRESENTATIVE: other processes took the cores (a rank "
            "was on CPU < 90% of its busy time)",
            "contended",
        ),
    ]
    for title, key in groups:
        rows = [row for row in r["bubble"] if row[key]]
        if key == "contended":
            rows = [row for row in rows if not row["oversubscribed"]]
        if not rows:
            continue
        met = [f"p={row['p']} m={row['m']}" for row in rows if row["within_goal"]]
        worst = max(abs(row["diff_points"]) for row in rows)
        lines.append(
            f"{title}: {len(met)} of {len(rows)} within 5 points"
            + (f" ({', '.join(met)})" if met else "")
            + f"; largest |diff| {worst:.1f} points"
        )
    return "\n".join(lines)


def write(path: Path, text: str) -> None:
    """Replace this benchmark's block of `path` (its section and block appended if absent)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from cpu_overhead import write as write_block

    doc = path.read_text() if path.exists() else "# Performance\n"
    if MARK not in doc and HEADING not in doc:
        path.write_text(doc.rstrip("\n") + f"\n\n{HEADING}\n\n{PARAGRAPH}\n")
    write_block(path, text, MARK)


def check(result: dict[str, Any]) -> list[str]:
    """What must hold whatever the timings: finite values, formula fields, equal losses."""
    problems = []
    for row in result["bubble"]:
        values = [row["bubble_mean"], row["formula"], row["diff_points"], *row["bubble_per_rank"]]
        if not all(math.isfinite(v) for v in values):
            problems.append(f"p={row['p']} m={row['m']}: a value is not finite")
    z = result["zero_bubble"]
    if not z["losses_identical"]:
        problems.append("zero-bubble and 1F1B losses differ")
    if not z["single_within_tol"]:
        problems.append(f"pipelined losses differ from the single-device step by more than {TOL}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--small", action="store_true", help="seconds: p=2, m=4, a tiny model")
    parser.add_argument("--steps", type=int, help="measured steps per configuration (5; small 2)")
    parser.add_argument("--rounds", type=int, help="zero-bubble/1F1B rounds (7; small 2)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write", type=Path, help="update this markdown file's block")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--program", action="append", help=argparse.SUPPRESS)
    parser.add_argument("--batch", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    cfg = SMALL if args.small else FULL
    steps = args.steps or (2 if args.small else 5)
    rounds = args.rounds or (2 if args.small else 7)
    result = measure(cfg, steps, rounds)
    text = table(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.write:
        write(args.write, text)
    problems = check(result)
    for problem in problems:
        print("FAILED:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
