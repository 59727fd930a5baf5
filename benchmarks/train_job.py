"""Training jobs (`portable train`): engine overhead, async checkpoint stall, data wait.

    python benchmarks/train_job.py [--steps 40] [--rounds 2] [--ckpt-every 8] [--no-xla]
                                   [--threads 1] [--no-pin] [--small] [--json r.json]
                                   [--write docs/performance.md]

The GPT example scaled to 4 layers x 256 wide (benchmarks/train_job_model.py: 3.3 M parameters,
37 MiB of float32 state with AdamW's moments), batch 4 x 32 byte tokens of docs/parallelism.md
(`portable data tokenize --tokenizer bytes`), captured once as an AdamW training step and saved
as an archive, which every job below trains (`portable.jobs.train(archive, ...)`, the path of
`portable train ARCHIVE`: launcher, torchrun, the worker, the loop, metrics, checkpoints; only
the capture is done once instead of per job). One process per job, `--threads` torch threads.

- (a) engine overhead: `portable train` (engine cpu) against its own per-rank program (what
  RUN/.job/train.portable holds) compiled with `portable.compile(..., backend="cpu")` and called
  in a tight loop on the same batches, loaded beforehand, in a fresh process of its own (a
  rank's conditions: this process, which captured, runs the same loop 5-15% slower). The two
  run side by side, on one CPU (`--no-pin`: anywhere): the baseline loops while the job is in
  its steady steps (after `--skip`), and only what falls in their common window is compared, so
  both get the same share of the same core whatever else the machine runs (on a shared machine
  the load drifts by 2x within a minute; rounds one after the other gave 0.65-0.93 for the same
  code). The job's helpers (prefetch and heartbeat threads, torchrun's agent) share that core,
  so the ratio is if anything low. `--rounds` pairs. Job tokens/s from metrics.jsonl: per step
  of the whole loop (`time_s` of consecutive records: data, step, health, records, everything)
  and of the engine's step alone (`step_time_s`, what `tokens_per_s` reports); baseline
  tokens/s per call; medians. Goal: whole loop >= 0.95x. Also the loop's time beyond the
  engine's step within each step. The same for the xla engine (one controller) against the
  compiled `shard_map` function of the per-rank program, state on the device, batches put
  there beforehand.
- (b) async checkpointing: the same job with a checkpoint every `--ckpt-every` steps, sync and
  `--ckpt-async` in turn, `--rounds` times: the time the step loop is blocked by each save (the
  `stall_s` of its `checkpoint` event, plus for async saves the wait for the previous write at
  the next save, `checkpoint_committed`'s `waited_s`). Goal: median async / median sync <= 0.10.
- (c) data wait: sum of `data_wait_s` over sum of `step_time_s` on the steady steps of the (a)
  jobs. Goal: <= 0.01.

`train_job.py baseline ...` is the baseline's process (`baseline_process`), started by (a).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
MARK = "<!-- train_job -->"
HEADING = "## Training jobs (`portable train`)"
MODEL = REPO / "benchmarks" / "train_job_model.py"
TEXT = REPO / "docs" / "parallelism.md"
BASELINE_TIMEOUT_S = 600.0
GOALS = {"overhead": 0.95, "stall": 0.10, "data_wait": 0.01}
FULL = {"name": "GPTBench", "batch": 4, "seq": 32}
SMALL = {"name": "GPTBenchSmall", "batch": 2, "seq": 16}


# --------------------------------------------------------------------------- setup


def prepare(folder: Path, size: dict[str, Any]) -> dict[str, Any]:
    """Tokens, and the training step captured once on the job's batch shape, as an archive."""
    from portable.jobs.config import JobConfig
    from portable.jobs.prepare import prepare_job
    from portable.jobs.tokenize import tokenize

    tokens = folder / "tokens.bin"
    tokenize(TEXT, "bytes", tokens)
    config = JobConfig(
        spec=f"{MODEL}:{size['name']}",
        data=str(tokens),
        steps=1,
        out=str(folder / "unused"),
        batch=size["batch"],
        seq=size["seq"],
    )
    start = time.perf_counter()
    prepared = prepare_job(config)
    capture_s = time.perf_counter() - start
    archive = folder / "step.portable"
    prepared.program.save(archive)  # every job trains this: no capture per job
    per_rank = folder / "per_rank.portable"  # what each job's rank runs (RUN/.job/train.portable)
    prepared.per_rank.save(per_rank)
    state = prepared.program.signature.state_inputs
    return {
        "tokens": str(tokens),
        "archive": str(archive),
        "capture_s": capture_s,
        "per_rank_path": str(per_rank),
        "batch": prepared.batch,
        "seq": prepared.seq,
        "parameters": sum(
            prepared.program.weights[s.key].numel() for s in state if s.kind.value == "parameter"
        ),
        "state_bytes": sum(
            prepared.program.weights[s.key].numel() * prepared.program.weights[s.key].element_size()
            for s in state
        ),
    }


def job(setup: dict[str, Any], out: Path, steps: int, **fields: Any) -> Any:
    """One `portable train` of the archive (JobConfig's fields); its TrainResult."""
    import portable.jobs

    return portable.jobs.train(
        setup["archive"], data=setup["tokens"], steps=steps, out=str(out), **fields
    )


def batches(setup: dict[str, Any], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches of steps 1..steps, as the job's sampler gives them (seed 0)."""
    from portable.jobs.data import Sampler, TokenFile

    sampler = Sampler(
        TokenFile.open(setup["tokens"]), batch=setup["batch"], seq=setup["seq"], seed=0
    )
    return [sampler.batch(k) for k in range(steps)]


# --------------------------------------------------------------------------- baselines

Call = Callable[[], None]  # one step of a baseline, on its next pre-loaded batch


def cpu_baseline(program: Any, data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Call:
    """The compiled step (`portable.compile(program, backend="cpu")`), each call on the next of
    the pre-loaded `data`, round and round."""
    import portable

    exe = portable.compile(program, backend="cpu")
    batches = itertools.cycle(data)

    def call() -> None:
        exe(*next(batches))

    return call


def xla_baseline(program: Any, data: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Call:
    """The per-rank program's compiled `shard_map` function (what the xla engine compiles):
    state on the device, every batch put there beforehand; each call waits for its loss."""
    import jax

    from portable.backends.xla.spmd import spmd_function
    from portable.ir.signature import OutputKind

    fn = spmd_function(program, "xla", jax.devices("cpu"))
    sig = program.signature
    index = {s.name: k for k, s in enumerate(sig.inputs)}
    arrays: list[Any] = [None] * len(sig.inputs)
    for s in sig.state_inputs:
        arrays[index[s.name]] = fn.put_one(index[s.name], program.weights[s.key])
    users = [index[u.name] for u in sig.user_inputs]
    put = [[fn.put_one(k, v) for k, v in zip(users, b, strict=True)] for b in data]
    batches = itertools.cycle(put)
    (loss,) = [i for i, o in enumerate(sig.outputs) if o.kind is OutputKind.LOSS]

    def call() -> None:
        nonlocal arrays
        for k, value in zip(users, next(batches), strict=True):
            arrays[k] = value
        outputs = fn(arrays)
        outputs[loss].block_until_ready()
        arrays = fn.thread(arrays, outputs)

    return call


# --------------------------------------------------------------------------- reading a run


def steady(result: Any, skip: int) -> list[dict[str, Any]]:
    return [m for m in result.metrics if m["step"] > skip]


def loop_times(
    result: Any, skip: int, exclude: Collection[int] = (), window: tuple[float, float] | None = None
) -> list[float]:
    """Seconds between consecutive metrics records (the whole loop of a step: data, step,
    health, records), steps after `skip`; steps in `exclude` left out, and with `window` (job
    seconds) those not wholly inside it."""
    at = {m["step"]: m["time_s"] for m in result.metrics}
    lo, hi = window or (-math.inf, math.inf)
    return [
        at[k] - at[k - 1]
        for k in sorted(at)
        if k > skip + 1 and k - 1 in at and k not in exclude and lo <= at[k - 1] and at[k] <= hi
    ]


def step_times(result: Any, skip: int, window: tuple[float, float] | None = None) -> list[float]:
    """`step_time_s` (the engine's step alone) of the steps after `skip` (ending in `window`)."""
    lo, hi = window or (-math.inf, math.inf)
    return [m["step_time_s"] for m in steady(result, skip) if lo <= m["time_s"] <= hi]


def loop_extra(result: Any, skip: int) -> list[float]:
    """Per steady step, the loop's time beyond the engine's step (same step, same clock)."""
    at = {m["step"]: m for m in result.metrics}
    return [
        at[k]["time_s"] - at[k - 1]["time_s"] - at[k]["step_time_s"]
        for k in sorted(at)
        if k > skip + 1 and k - 1 in at
    ]


def stalls(result: Any) -> list[float]:
    """Seconds the step loop was blocked by each save: `stall_s`, plus the wait for an async
    write at the next save (the wait at the job's end is reported apart: `final_wait`)."""
    out: list[float] = []
    waited = 0.0
    for event in result.events:
        if event["event"] == "checkpoint_committed":
            waited = float(event["waited_s"])
        elif event["event"] == "checkpoint":
            if out:
                out[-1] += waited
            out.append(float(event["stall_s"]))
            waited = 0.0
    return out


def final_wait(result: Any) -> float:
    events = result.events
    last = max(i for i, e in enumerate(events) if e["event"] == "checkpoint")
    return sum(float(e["waited_s"]) for e in events[last:] if e["event"] == "checkpoint_committed")


def checkpoint_bytes(result: Any) -> int:
    """Bytes of the last checkpoint's files (its portable.json lists them)."""
    from portable.errors import CheckpointError
    from portable.safe_json import read_json

    steps = sorted(result.run.glob("checkpoints/step-*"), key=lambda p: int(p.name[5:]))
    doc = read_json(steps[-1] / "portable.json", CheckpointError, fix="")
    return sum(int(f["bytes"]) for f in doc["files"].values())


def _epoch(run: Path) -> float:
    """The job's clock origin (RUN/.job/job.json): record time_s + epoch = time.time()."""
    from portable.errors import JobError
    from portable.safe_json import read_json

    return float(read_json(run / ".job" / "job.json", JobError, fix="")["epoch"])


def _records(run: Path) -> int:
    try:
        return (run / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


# --------------------------------------------------------------------------- measurements


def side_by_side(
    setup: dict[str, Any], out: Path, engine: str, args: argparse.Namespace, **fields: Any
) -> dict[str, Any]:
    """One job, and the baseline in a process of its own (`baseline_process`) started beside it,
    looping while the job is in its steady steps: both see the same load of the machine, and
    only what falls in the common window is compared."""
    record = out.parent / f"{out.name}.baseline.json"
    command = [sys.executable, str(Path(__file__).resolve()), "baseline", "--engine", engine]
    command += ["--program", setup["per_rank_path"], "--tokens", setup["tokens"]]
    command += [f"--batch={setup['batch']}", f"--seq={setup['seq']}", f"--steps={args.steps}"]
    command += [f"--skip={args.skip}", f"--threads={args.threads}"]
    command += ["--run", str(out), "--record", str(record)]
    with _one_core(args.pin):  # inherited by the baseline and by every process of the job
        proc = subprocess.Popen(
            command,
            env=_environment(engine, args.threads),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            result = job(setup, out, args.steps, engine=engine, **fields)
        finally:
            record.with_name(record.name + ".stop").touch()
            _, err = proc.communicate(timeout=BASELINE_TIMEOUT_S)
    if proc.returncode != 0:
        raise SystemExit(f"the baseline process failed (exit {proc.returncode}):\n{err[-3000:]}")
    calls = [tuple(c) for c in json.loads(record.read_text())]
    epoch = _epoch(result.run)
    first = {m["step"]: m["time_s"] for m in result.metrics}[args.skip + 1]
    window = (first, first)  # nothing in common when no call overlapped the job
    if calls:
        window = (max(calls[0][0] - epoch, first), calls[-1][0] + calls[-1][1] - epoch)
    base = [s for t, s in calls if window[0] <= t - epoch and t - epoch + s <= window[1]]
    return {
        "result": result,
        "baseline": base,
        "loop": loop_times(result, args.skip, window=window),
        "step": step_times(result, args.skip, window=window),
        "extra": loop_extra(result, args.skip),
    }


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """`n` torch threads here and in the jobs' ranks (launch passes OMP_NUM_THREADS on), put
    back afterwards."""
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        if env is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env


@contextlib.contextmanager
def _one_core(pin: bool) -> Iterator[None]:
    """With `pin`, this process and what it starts run on one CPU (the last it may use): the
    job and the baseline then share that core's time evenly, whatever else the machine runs."""
    if not pin or not hasattr(os, "sched_setaffinity"):
        yield
        return
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {max(allowed)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


def _environment(engine: str, threads: int) -> dict[str, str]:
    """What a job's rank runs with (portable/jobs/launch.py): torch threads on cpu; on xla
    every host thread and one XLA device."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if engine == "xla":
        env.pop("OMP_NUM_THREADS")
        flags = env.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=1".strip()
    return env


def baseline_process(argv: list[str]) -> int:
    """`train_job.py baseline ...` (side_by_side starts it): load the per-rank program, compile
    it, warm up, then call it in a tight loop while RUN's job is past `--skip` steps and short
    of `--steps`; write [(time.time() at the start, seconds)] per call to `--record`."""
    p = argparse.ArgumentParser(prog="train_job.py baseline")
    p.add_argument("--engine", choices=("cpu", "xla"), required=True)
    p.add_argument("--program", required=True)
    p.add_argument("--tokens", required=True)
    for name in ("batch", "seq", "steps", "skip", "threads"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--record", type=Path, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import portable

    setup = {"tokens": a.tokens, "batch": a.batch, "seq": a.seq}
    make = cpu_baseline if a.engine == "cpu" else xla_baseline
    call = make(portable.load(a.program), batches(setup, a.steps))
    for _ in range(3):
        call()  # warm-up
    stop, deadline = a.record.with_name(a.record.name + ".stop"), time.time() + BASELINE_TIMEOUT_S

    def over() -> bool:
        return stop.exists() or _records(a.run) >= a.steps or time.time() > deadline

    while not over() and _records(a.run) <= a.skip:
        time.sleep(0.01)
    calls: list[tuple[float, float]] = []
    while not over():
        began, start = time.time(), time.perf_counter()
        call()
        calls.append((began, time.perf_counter() - start))
    tmp = a.record.with_name(a.record.name + ".tmp")
    tmp.write_text(json.dumps(calls))
    tmp.replace(a.record)
    return 0


def _tps(tokens: int, seconds: Sequence[float]) -> float:
    return tokens / statistics.median(seconds) if seconds else math.nan


def _summary(tokens: int, pairs: list[dict[str, Any]]) -> dict[str, Any]:
    pooled = {key: [t for p in pairs for t in p[key]] for key in ("baseline", "loop", "step")}
    extra = [t for p in pairs for t in p["extra"]]
    return {
        "baseline_tps": _tps(tokens, pooled["baseline"]),
        "loop_tps": _tps(tokens, pooled["loop"]),
        "step_tps": _tps(tokens, pooled["step"]),
        "rounds": [_tps(1, p["loop"]) / _tps(1, p["baseline"]) for p in pairs],
        "samples": {key: len(v) for key, v in pooled.items()},
        "medians_s": [
            {key: statistics.median(p[key]) if p[key] else math.nan for key in pooled}
            for p in pairs
        ],
        "loop_extra_s": statistics.median(extra) if extra else math.nan,
        "step_s": statistics.median(pooled["step"]),
        "job_wall_s": [p["result"].wall_s for p in pairs],
    }


def overhead(setup: dict[str, Any], folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """(a) and (c) on the cpu engine: `--rounds` jobs, each beside the tight-loop baseline."""
    pairs = [side_by_side(setup, folder / f"cpu-{r}", "cpu", args) for r in range(args.rounds)]
    out = _summary(setup["batch"] * setup["seq"], pairs)
    waits = [
        (m["data_wait_s"], m["step_time_s"]) for p in pairs for m in steady(p["result"], args.skip)
    ]
    out["data_wait"] = sum(w for w, _ in waits) / sum(s for _, s in waits)
    out["data_wait_max_s"] = max(w for w, _ in waits)
    return out


def xla_overhead(setup: dict[str, Any], folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """(a) on the xla engine: one job beside the compiled function's tight loop."""
    pair = side_by_side(setup, folder / "xla", "xla", args)
    return _summary(setup["batch"] * setup["seq"], [pair])


def checkpointing(setup: dict[str, Any], folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """(b): the job with a save every --ckpt-every steps, sync and async in turn, `--rounds`
    times; each kind's saves pooled."""
    out: dict[str, Any] = {
        kind: {"stalls_s": [], "final_wait_s": [], "loop_s": [], "wall_s": []}
        for kind in ("sync", "async")
    }
    for r in range(args.rounds):
        for kind in ("sync", "async"):
            result = job(
                setup,
                folder / f"{kind}-{r}",
                args.steps,
                ckpt_every=args.ckpt_every,
                ckpt_async=kind == "async",
            )
            saved = {e["step"] + 1 for e in result.events if e["event"] == "checkpoint"}
            row = out[kind]
            row["stalls_s"] += stalls(result)
            row["final_wait_s"].append(final_wait(result))
            row["loop_s"] += loop_times(result, args.skip, exclude=saved)
            row["wall_s"].append(result.metrics[-1]["time_s"] - result.metrics[0]["time_s"])
            out["bytes"] = checkpoint_bytes(result)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    size = SMALL if args.small else FULL
    with tempfile.TemporaryDirectory(prefix="portable-train-bench-") as name:
        folder = Path(name)
        setup = prepare(folder, size)
        result: dict[str, Any] = {
            "config": {
                **size,
                "steps": args.steps,
                "skip": args.skip,
                "rounds": args.rounds,
                "ckpt_every": args.ckpt_every,
                "threads": torch.get_num_threads(),
                "parameters": setup["parameters"],
                "state_bytes": setup["state_bytes"],
                "capture_s": setup["capture_s"],
            }
        }
        result["cpu"] = overhead(setup, folder, args)
        result["checkpoint"] = checkpointing(setup, folder, args)
        if args.xla:
            result["xla"] = xla_overhead(setup, folder, args)
    return result


# --------------------------------------------------------------------------- report


def _verdict(value: float, goal: float, *, at_least: bool = False) -> str:
    met = value >= goal if at_least else value <= goal
    return f"{'>=' if at_least else '<='} {goal}: {'met' if met else 'not met'}"


def _overhead_rows(engine: str, r: dict[str, Any]) -> list[str]:
    loop, step = r["loop_tps"] / r["baseline_tps"], r["step_tps"] / r["baseline_tps"]
    goal = _verdict(loop, GOALS["overhead"], at_least=True)
    return [
        f"| (a) tokens/s, {engine} engine, whole loop per step | {r['loop_tps']:,.0f} | "
        f"{r['baseline_tps']:,.0f} | {loop:.3f} | {goal} |",
        f"| (a) tokens/s, {engine} engine, engine step (`tokens_per_s`) | {r['step_tps']:,.0f} | "
        f"{r['baseline_tps']:,.0f} | {step:.3f} | - |",
    ]


def _overhead_notes(engine: str, r: dict[str, Any]) -> str:
    n = r["samples"]
    return (
        f"(a) {engine}: whole loop / baseline per round "
        + ", ".join(f"{x:.3f}" for x in r["rounds"])
        + f" ({n['loop']} job steps, {n['baseline']} baseline calls in the common windows); "
        f"the loop beyond the engine's step: {r['loop_extra_s'] * 1e3:.2f} ms per step "
        f"({r['loop_extra_s'] / r['step_s']:.1%} of the median step, {r['step_s'] * 1e3:.1f} ms);"
    )


def table(result: dict[str, Any]) -> str:
    c, cpu, ck = result["config"], result["cpu"], result["checkpoint"]
    sync = statistics.median(ck["sync"]["stalls_s"])
    asy = statistics.median(ck["async"]["stalls_s"])
    lines = [
        f"torch {torch.__version__}, {c['threads']} torch thread(s) per process; "
        f"{c['name']} (benchmarks/train_job_model.py, {c['parameters'] / 1e6:.2f} M parameters, "
        f"{c['state_bytes'] / 2**20:.1f} MiB state with AdamW), batch {c['batch']} x "
        f"{c['seq']} tokens, 1 process; {c['steps']} steps per job, the first {c['skip']} left "
        f"out; (a) {c['rounds']} job(s), each beside the baseline",
        "",
        "| quantity | `portable train` | baseline | ratio | goal |",
        "|---|---|---|---|---|",
        *_overhead_rows("cpu", cpu),
    ]
    if "xla" in result:
        lines += _overhead_rows("xla", result["xla"])
    lines += [
        f"| (b) loop blocked per checkpoint ({ck['bytes'] / 2**20:.1f} MiB), median of "
        f"{len(ck['async']['stalls_s'])} saves | async {asy * 1e3:.1f} ms | sync "
        f"{sync * 1e3:.1f} ms | {asy / sync:.3f} | {_verdict(asy / sync, GOALS['stall'])} |",
        f"| (c) data wait / step time, steady steps | {cpu['data_wait']:.4f} | - | - | "
        f"{_verdict(cpu['data_wait'], GOALS['data_wait'])} |",
        "",
        'baseline: the job\'s per-rank program, `portable.compile(..., backend="cpu")` (xla: '
        "its compiled `shard_map` function), called in a tight loop on the same batches beside "
        "the job;",
        _overhead_notes("cpu", cpu),
    ]
    if "xla" in result:
        lines.append(_overhead_notes("xla", result["xla"]))
    lines += [
        f"(b) per save, sync: {_ms(ck['sync']['stalls_s'])} ms; async: "
        f"{_ms(ck['async']['stalls_s'])} ms (+ {statistics.median(ck['async']['final_wait_s']) * 1e3:.0f} ms "
        f"waiting for the last write at the end, median); steps 2-{c['steps']} took "
        f"{_s(ck['sync']['wall_s'])} s sync, {_s(ck['async']['wall_s'])} s async (median step "
        f"between saves {statistics.median(ck['sync']['loop_s']) * 1e3:.1f} ms sync, "
        f"{statistics.median(ck['async']['loop_s']) * 1e3:.1f} ms async);",
        f"(c) longest data wait {cpu['data_wait_max_s'] * 1e3:.2f} ms",
    ]
    return "\n".join(lines)


def _ms(seconds: Sequence[float]) -> str:
    return ", ".join(f"{s * 1e3:.0f}" for s in seconds)


def _s(seconds: Sequence[float]) -> str:
    return ", ".join(f"{s:.2f}" for s in seconds)


def write(path: Path, text: str) -> None:
    """Replace this benchmark's block of `path` (the section and block appended if absent)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from cpu_overhead import write as write_block

    doc = path.read_text() if path.exists() else "# Performance\n"
    if MARK not in doc and HEADING not in doc:
        command = "python benchmarks/train_job.py --write docs/performance.md"
        path.write_text(
            doc.rstrip("\n") + f"\n\n{HEADING}\n\n`{command}` (what it measures: "
            "the script's docstring):\n"
        )
    write_block(path, text, MARK)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["baseline"]:
        return baseline_process(argv[1:])
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, help="steps per job (default 40; --small 30)")
    parser.add_argument("--skip", type=int, help="first steps left out (default 5; --small 1)")
    parser.add_argument("--rounds", type=int, default=2, help="cpu-engine jobs for (a)")
    parser.add_argument("--ckpt-every", type=int, help="(b)'s save interval (default 8; small 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="(a): do not share one CPU"
    )
    parser.add_argument("--no-xla", dest="xla", action="store_false", help="skip the xla engine")
    parser.add_argument("--small", action="store_true", help="the smoke test's size")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write", type=Path, help="update this markdown file's block")
    args = parser.parse_args(argv)
    small = args.small
    args.steps = args.steps or (30 if small else 40)
    args.skip = args.skip if args.skip is not None else (1 if small else 5)
    args.ckpt_every = args.ckpt_every or (2 if small else 8)
    with _threads(args.threads):
        result = measure(args)
    text = table(result)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.write:
        write(args.write, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
