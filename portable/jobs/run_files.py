"""What a job writes into RUN as it goes (the files `portable report` reads):

    RUN/metrics.jsonl        one object per step (rank 0): step, loss, lr, grad_norm,
                             loss_scale, step_time_s, tokens_per_s, mfu, data_wait_s, comm_s,
                             exposed_comm_s, memory_bytes, time_s
    RUN/eval.jsonl           {"step", "eval_loss", "tokens", "time_s", "eval_s"}
    RUN/events.jsonl         {"time_s", "event", ...}: start, resume, checkpoint, health, ...
    RUN/ranks/rank<r>.json   per rank: its step times, data waits and collective statistics
    RUN/job.json             {"config", "summary"} when the job ends

Times are seconds since the job's epoch (the launcher's start, in RUN/.job/job.json), so the
records of a restarted job continue one clock.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .config import JobConfig
from .engine import Engine, StepOut
from .metrics import MetricsLog, ProgressBar
from .peaks import detect_device, device_peak, measure_cpu_peak, mfu
from .records import read_records

__all__ = ["RunFiles"]


class RunFiles:
    def __init__(
        self,
        run: Path,
        *,
        rank: int,
        lead: bool,
        epoch: float,
        compute: torch.dtype,
        cpu_peak: float | None = None,
    ) -> None:
        self.run, self.rank, self.lead, self.epoch = run, rank, lead, epoch
        self.compute = compute  # the number format MFU is measured against
        self.metrics: MetricsLog | None = None
        self.bar: ProgressBar | None = None
        self.steps: list[int] = []
        self.step_times: list[float] = []
        self.waits: list[float] = []
        self.losses: list[float] = []
        self._peak: float | None = None
        self._cpu_peak = cpu_peak  # the launcher's measurement, for the whole job

    def now(self) -> float:
        return time.time() - self.epoch

    # ------------------------------------------------------------------ events

    def event(self, name: str, **fields: Any) -> None:
        if not self.lead:
            return
        _append(
            self.run / "events.jsonl", {"time_s": round(self.now(), 6), "event": name, **fields}
        )

    # ------------------------------------------------------------------ steps

    def open_metrics(self, *, resume_after: int) -> None:
        """Open metrics.jsonl keeping the lines of steps up to `resume_after` (a resumed or
        rolled-back job redoes the later ones, so each step keeps one line)."""
        if self.lead:
            if self.metrics is not None:
                self.metrics.close()
            path = self.run / "metrics.jsonl"
            self.metrics = MetricsLog(path, resume_after=resume_after if path.exists() else None)

    def progress(self, steps: int, start: int) -> None:
        if self.lead:
            self.bar = ProgressBar(steps, start=start)

    def step(
        self,
        k: int,
        out: StepOut,
        step_s: float,
        wait_s: float,
        comm_s: float,
        exposed_s: float,
        tokens: int,
        flops: float | None,
        engine: Engine,
    ) -> None:
        self.steps.append(k)
        self.step_times.append(step_s)
        self.waits.append(wait_s)
        self.losses.append(out.loss)
        if not self.lead:
            return
        peak = self.peak(engine)
        utilization = mfu(flops, step_s, peak, 1) if flops and peak else None
        record = {
            "step": k,
            "loss": out.loss,
            "lr": out.metrics.get("lr"),
            "grad_norm": out.metrics.get("grad_norm"),
            "loss_scale": out.metrics.get("loss_scale"),
            "step_time_s": step_s,
            "tokens_per_s": tokens / step_s if step_s > 0 else None,
            "mfu": utilization,
            "data_wait_s": wait_s,
            "comm_s": comm_s,
            "exposed_comm_s": exposed_s,
            "memory_bytes": _memory(engine),
            "time_s": self.now(),
        }
        assert self.metrics is not None
        self.metrics.write(record)
        if self.bar is not None:
            self.bar.update(k, loss=out.loss, tokens_per_s=record["tokens_per_s"], mfu=utilization)

    def peak(self, engine: Engine) -> float | None:
        """The peak FLOP/s of every device of the job together (CPU: measured here)."""
        if self._peak is None:
            kind = detect_device(engine.device_kind)
            if kind == "cpu":
                self._peak = self._cpu_peak or measure_cpu_peak(self.compute) * engine.world
            else:
                self._peak = device_peak(kind).rate(self.compute) * engine.devices
        return self._peak or None

    def eval(self, k: int, loss: float, tokens: int, eval_s: float) -> None:
        if not self.lead:
            return
        record = {"step": k, "eval_loss": loss, "tokens": tokens, "time_s": self.now()}
        record["eval_s"] = eval_s
        _append(self.run / "eval.jsonl", record)

    # ------------------------------------------------------------------ the end

    def finish(self, steps: int, config: JobConfig, engine: Engine, tokens: int) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        ranks = self.run / "ranks"
        ranks.mkdir(exist_ok=True)
        doc = {
            "rank": self.rank,
            "steps": self.steps,
            "step_time_s": self.step_times,
            "data_wait_s": self.waits,
            "comm": engine.comm.to_json(),
        }
        _dump(ranks / f"rank{self.rank}.json", doc)
        if self.lead:
            _dump(
                self.run / "job.json",
                {
                    "config": config.to_json(),
                    "summary": self._summary(steps, config, engine, tokens),
                },
            )
            self.event("done", step=steps)

    def _summary(
        self, steps: int, config: JobConfig, engine: Engine, tokens: int
    ) -> dict[str, Any]:
        records = read_records(self.run / "metrics.jsonl")
        evals = read_records(self.run / "eval.jsonl")
        wall = self.now()
        summary: dict[str, Any] = {
            "steps": steps,
            "tokens": steps * tokens,
            "wall_s": wall,
            "final_loss": records[-1]["loss"] if records else None,
            "device": {
                "kind": detect_device(engine.device_kind),
                "count": engine.devices,
                "peak_flops": self.peak(engine),
            },
            "engine": config.engine,
            "price_per_hour": config.price_per_hour,
            "target_loss": config.target_loss,
        }
        hit = next(
            (e for e in evals if config.target_loss and e["eval_loss"] <= config.target_loss),
            None,
        )
        summary["time_to_target_s"] = hit["time_s"] if hit else None
        summary["tokens_to_target"] = hit["tokens"] if hit else None
        if config.price_per_hour is not None:
            # the price is per hour of the whole allocation the job holds
            per_s = config.price_per_hour / 3600.0
            times = [r["step_time_s"] for r in records[2:]] or [r["step_time_s"] for r in records]
            summary["cost_per_step"] = per_s * sum(times) / len(times) if times else None
            summary["cost_to_target"] = per_s * hit["time_s"] if hit else None
            summary["cost_total"] = per_s * wall
        return summary


def _append(path: Path, record: Mapping[str, Any]) -> None:
    """One JSON line appended in one write; a torn last line (a process killed mid-write) is
    cut first, so it never ends up in the middle of the file."""
    line = (json.dumps(record) + "\n").encode()
    with path.open("ab+") as f:
        size = f.seek(0, 2)
        if size:
            f.seek(max(0, size - 1))
            if f.read(1) != b"\n":
                f.seek(0)
                data = f.read()
                f.truncate(data.rfind(b"\n") + 1)
        f.seek(0, 2)
        f.write(line)


def _memory(engine: Engine) -> int | None:
    """Peak memory of this process's device so far (CUDA: allocated; CPU: resident set)."""
    if engine.device_kind == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(usage if sys.platform == "darwin" else usage * 1024)


def _dump(path: Path, doc: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
