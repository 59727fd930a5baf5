"""`drill(config, fault)`: a failure drill, measured.

The job runs under torchrun's elastic restarts (at least one) with the fault armed
(fault.py: rank R kills itself with SIGKILL, or freezes with SIGSTOP, at the start of step S,
first attempt only). torchrun sees a killed rank exit; a frozen one stops beating and the
launcher kills it after `timeout_s` (portable/distributed/job.py), which torchrun then sees.
torchrun stops the other ranks and starts them all again; they resume from the last complete
checkpoint. The same job also runs uninterrupted (RUN/baseline, unless one is given), and
RUN/drill.json says, from the clocks the pieces wrote (fault.json, torchrun's restart record,
the job's events and metrics):

- detect_s: fault -> the failure seen (torchrun's monitor for a dead rank; the heartbeat
  timeout for a frozen one);
- restart_s: seen -> the new processes started (old ranks stopped, new ones spawned);
- init_s: new process start -> engine ready, less compiling (imports, process group);
- recompile_s / compile_cold_s: compiling on the restart (the compile caches warm) / on the
  first start (cold);
- reload_s: reading the checkpoint back;
- steps_lost: steps done after the checkpoint that was resumed from;
- first_step_s: fault -> the first step after the restart done;
- recovery_s: fault -> the job back at the step it failed at (lost steps redone);
- matches_uninterrupted: every step's loss and the final state bit-identical to the baseline.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from ..errors import JobError
from ..safe_json import read_json
from .checkpoint import CheckpointStore, checkpoint_key
from .config import JobConfig
from .fault import FAULT_ENV, Fault
from .launch import _check_out, _epoch, _resume_source, cpu_peak, launch_job, read_result
from .prepare import Prepared, prepare_job, write_job
from .records import read_records

__all__ = ["drill"]


def drill(
    config: JobConfig, fault: Fault, *, baseline: str | Path | None = None, quiet: bool = True
) -> dict[str, Any]:
    """Run the drill (module docstring); returns drill.json's content."""
    run = Path(config.out)
    if fault.rank >= (config.nproc if config.engine in ("cpu", "cuda") else 1):
        raise JobError(
            f"--kill {fault.rank}@{fault.step}: the job has ranks 0..{config.nproc - 1}",
            fix="name a rank of the job (xla/neuron run one controller: rank 0)",
        )
    if fault.step > config.steps:
        raise JobError(f"--kill at step {fault.step}, but the job runs {config.steps} steps")
    drilled = dataclasses.replace(config, max_restarts=max(config.max_restarts, 1), resume=False)
    _check_out(run, drilled)
    prepared = prepare_job(drilled)
    peak = cpu_peak(prepared)
    extra = {"resume_from": _resume_source(drilled), "epoch": _epoch(run, drilled)}
    write_job(prepared, run, {**extra, "cpu_peak_flops": peak})
    launch_job(prepared, run, quiet=quiet, env={FAULT_ENV: str(fault)})
    result = read_result(run)
    if baseline is None:
        baseline = run / "baseline"
        base_config = dataclasses.replace(config, out=str(baseline), resume=False)
        _check_out(baseline, base_config)
        extra = {"epoch": _epoch(baseline, base_config), "cpu_peak_flops": peak}
        write_job(prepared_for(prepared, base_config), baseline, extra)
        launch_job(prepared_for(prepared, base_config), baseline, quiet=quiet)
    base = read_result(Path(baseline))
    report = _report(run, prepared, fault, result.losses, base.losses, Path(baseline))
    (run / "drill.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def prepared_for(prepared: Prepared, config: JobConfig) -> Prepared:
    return dataclasses.replace(prepared, config=config)


def _report(
    run: Path,
    prepared: Prepared,
    fault: Fault,
    losses: list[float],
    base_losses: list[float],
    baseline: Path,
) -> dict[str, Any]:
    fault_doc = read_json(run / "drill" / "fault.json", JobError, fix="the fault did not fire")
    t_fault = float(fault_doc["time"])
    restarts = read_records(run / "restarts.jsonl")
    hung = read_records(run / "hung.jsonl")
    if not restarts:
        raise JobError(
            f"the fault fired at step {fault.step}, but torchrun did not restart the job",
            fix="see RUN/events.jsonl and the job's output",
        )
    detected = float(restarts[0]["detected"])
    if hung:
        detected = min(detected, float(hung[0]["at"]))
    events = read_records(run / "events.jsonl")
    epoch = _epoch_of(run)
    starts = [e for e in events if e["event"] == "start"]
    cold = next(e for e in starts if e["restart"] == 0)
    warm = next((e for e in starts if e["restart"] >= 1), None)
    resume = next((e for e in events if e["event"] == "resume" and e.get("restart", 0) >= 1), None)
    if warm is None or resume is None:
        raise JobError(
            "the restarted job did not resume from a checkpoint", fix="pass --ckpt-every"
        )
    metrics = read_records(run / "metrics.jsonl")
    after = [m for m in metrics if m["time_s"] + epoch > t_fault]
    first = after[0] if after else None
    back = next((m for m in after if m["step"] >= fault.step), None)
    process_start = float(warm["process_start"])
    engine_ready = float(warm["time_s"]) + epoch
    report = {
        "fault": {"rank": fault.rank, "step": fault.step, "signal": fault.signal_name},
        "detect_s": detected - t_fault,
        "restart_s": process_start - detected,
        "init_s": engine_ready - process_start - float(warm["compile_s"]),
        "recompile_s": float(warm["compile_s"]),
        "compile_cold_s": float(cold["compile_s"]),
        "reload_s": float(resume["reload_s"]),
        "resumed_from_step": int(resume["step"]),
        "steps_lost": fault.step - 1 - int(resume["step"]),
        "first_step_s": first["time_s"] + epoch - t_fault if first else None,
        "recovery_s": back["time_s"] + epoch - t_fault if back else None,
        "timeout_s": prepared.config.timeout_s,
        "losses_match": losses == base_losses,
        "baseline": str(baseline),
    }
    report["state_matches"] = _same_final_state(run, baseline, prepared)
    report["matches_uninterrupted"] = report["losses_match"] and report["state_matches"]
    return report


def _epoch_of(run: Path) -> float:
    doc = read_json(run / ".job" / "job.json", JobError, fix="re-run the drill")
    return float(doc["epoch"])


def _same_final_state(run: Path, baseline: Path, prepared: Prepared) -> bool:
    """Whether the last checkpoints of both runs hold bit-identical tensors."""
    ours, theirs = CheckpointStore(run / "checkpoints").latest(), None
    theirs = CheckpointStore(baseline / "checkpoints").latest()
    if ours is None or theirs is None or ours.step != theirs.step:
        return False
    values = []
    for checkpoint in (ours, theirs):
        targets = {
            checkpoint_key(s.key): torch.zeros([int(d) for d in s.spec.shape], dtype=s.spec.dtype)
            for s in prepared.program.signature.state_inputs
        }
        CheckpointStore(checkpoint.path.parent).load(checkpoint, targets)
        values.append(targets)
    return all(torch.equal(values[0][k], values[1][k]) for k in values[0])
