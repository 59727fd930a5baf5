"""The training loop every engine runs: data ahead of the step, the step, health, metrics,
validation and checkpoints. One call of `run_job` is one process's life in a job (a restart by
torchrun calls it again, and it resumes from the last complete checkpoint).

Step numbering: step k (1-based) trains on the global batch `Sampler.rows(k - 1 + offset)` and
a checkpoint `step-<k>` holds the state after k steps. `offset` is 0 unless a health rollback
skipped batches; it is part of the checkpoint, so a resumed job feeds what the original would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import JobError
from ..ir.signature import InputKind
from ..recipe import recipe_of
from .checkpoint import CheckpointStore
from .data import Prefetcher, Sampler, TokenFile
from .engine import Engine
from .fault import maybe_fire
from .health import Health
from .hf_init import HfTensor, read_hf_checkpoint
from .pipeline_engine import PipelineEngine
from .prediction import write_prediction
from .prepare import JobFiles, check_identity, read_job
from .run_files import RunFiles
from .torch_engine import TorchEngine
from .trace import StepTracer
from .xla_engine import XlaEngine

__all__ = ["make_engine", "run_job"]

Beat = Callable[..., None]


def run_job(run: Path, *, restart: int, started: float, at: Beat) -> None:
    """This process's part of the job in RUN (see the module docstring)."""
    files = read_job(run)
    config = files.config
    at("init")
    engine = make_engine(files, timeout_s=config.timeout_s)
    try:
        _Job(run, files, engine, restart=restart, started=started, at=at).run()
    finally:
        engine.close()


def make_engine(files: JobFiles, *, timeout_s: float) -> Engine:
    """The engine `files.config.engine` names, started on this process."""
    engine = files.config.engine
    if files.per_rank.plan.pipeline is not None:
        return PipelineEngine(files, device_type=engine, timeout_s=timeout_s)
    if engine in ("cpu", "cuda"):
        return TorchEngine(files, device_type=engine, timeout_s=timeout_s)

    return XlaEngine(files, platform=engine)


class _Job:
    def __init__(
        self,
        run: Path,
        files: JobFiles,
        engine: Engine,
        *,
        restart: int,
        started: float,
        at: Beat,
    ) -> None:
        self.run_dir, self.files, self.engine, self.at = run, files, engine, at
        self.config = config = files.config
        self.doc = files.doc
        self.restart = restart
        self.lead = engine.rank == 0
        compute = recipe_of(files.per_rank.metadata).precision.compute_dtype
        self.out = RunFiles(
            run,
            rank=engine.rank,
            lead=self.lead,
            epoch=float(self.doc["epoch"]),
            compute=compute,
            cpu_peak=self.doc.get("cpu_peak_flops"),
        )
        lowering = {"lowering": dict(engine.lowering)} if engine.lowering else {}
        self.out.event(
            "start", restart=restart, process_start=started, compile_s=engine.compile_s, **lowering
        )
        self.store = CheckpointStore(run / "checkpoints", keep=config.keep)
        tokens = TokenFile.open(config.data, dtype=config.data_dtype)
        self.batch, self.seq = int(self.doc["batch"]), int(self.doc["seq"])
        self.sampler = Sampler(tokens, batch=self.batch, seq=self.seq, seed=config.seed)
        self.eval_sampler = None
        if config.eval_data is not None:
            eval_tokens = TokenFile.open(config.eval_data, dtype=config.data_dtype)
            self.eval_sampler = Sampler(eval_tokens, batch=self.batch, seq=self.seq, seed=0)
        self.health = Health(config.health)
        self.offset = 0
        self.pending: Any = None
        self.rows = engine.rows(self.batch)

    # ------------------------------------------------------------------ the job

    def run(self) -> None:
        start = self._resume()
        steps = self.config.steps
        if start >= steps:
            self.out.event("done", step=start, note="nothing to do: the checkpoint is final")
            self._finish(start)
            return
        if self.lead:  # the planner's prediction of this start's steps (prediction.py)
            peak = self.doc.get("cpu_peak_flops")
            write_prediction(
                self.run_dir,
                self.files,
                self.engine,
                first_step=start + 1,
                cpu_peak_flops=float(peak) if isinstance(peak, int | float) else None,
            )

        tracer = StepTracer(self.run_dir / "traces", self.engine.rank, self.config.trace_steps)
        self.out.open_metrics(resume_after=start)
        self.out.progress(steps, start)
        step = start
        prefetcher = self._prefetcher(step)
        try:
            while step < steps:
                k = step + 1
                maybe_fire(self.engine.rank, k, self.restart, self.run_dir)
                self.at("step", k, steps)
                _, (_, (idx, targets)), wait_s = prefetcher.next()
                snapshot = self.engine.snapshot() if self.health.needs_snapshot else None
                with tracer.step(k):
                    t0 = time.perf_counter()
                    out = self.engine.step(idx, targets)
                    step_s = time.perf_counter() - t0
                comm_s, exposed_s = self.engine.comm.step_totals()
                verdict = self.health.check(k, out.loss, out.metrics)
                self.out.step(
                    k,
                    out,
                    step_s,
                    wait_s,
                    comm_s,
                    exposed_s,
                    self._tokens_per_step,
                    self._flops,
                    self.engine,
                )
                if verdict is not None:
                    action = self._unhealthy(k, verdict, snapshot)
                    if action == "rollback":
                        prefetcher.close()
                        step = self.checkpointed
                        self.out.open_metrics(resume_after=step)  # the steps are redone
                        prefetcher = self._prefetcher(step)
                        continue
                if self._eval_due(k):
                    self._evaluate(k)
                if self._checkpoint_due(k):
                    self._checkpoint(k)
                step = k
        finally:
            prefetcher.close()
            tracer.close()
        self._finish(steps)

    # ------------------------------------------------------------------ resume

    def _resume(self) -> int:
        """The step to start from: the latest complete checkpoint's, or 0."""
        self.checkpointed = 0
        candidate = None
        if self.config.resume or self.restart > 0:
            candidate = self.store.latest()
            for path, why in self.store.skipped:
                self.out.event("checkpoint_skipped", path=str(path), reason=why)
        source = self.doc.get("resume_from")
        if candidate is None and source:
            candidate = CheckpointStore(Path(source).parent).verify(source)
        if candidate is None:
            if self.config.init_from:
                self._init_from_hf()
            return 0
        check_identity(candidate, self.doc["identity"])
        t0 = time.perf_counter()
        self.engine.load_state(lambda targets: self.store.load(candidate, targets))
        reload_s = time.perf_counter() - t0
        next_data = self.sampler.check_cursor(candidate.meta["cursor"])
        self.offset = next_data - candidate.step
        self.checkpointed = candidate.step
        self.out.event(
            "resume",
            step=candidate.step,
            path=str(candidate.path),
            reload_s=reload_s,
            restart=self.restart,
            engine=self.config.engine,
        )
        return candidate.step

    def _init_from_hf(self) -> None:

        program = self.files.per_rank
        layout = program.spmd  # None for a pipelined step: its signature is global
        wanted = {}
        for s in program.signature.state_inputs:
            if s.kind is InputKind.PARAMETER:  # buffers (rotary tables, masks): the model's own
                dims = layout.input(s.name).global_shape if layout else s.spec.shape
                shape = tuple(int(d) for d in dims)
                index = self.engine.state_slices(s.key, shape)  # each rank reads only its part
                wanted[s.key] = HfTensor(shape, s.spec.dtype, index)
        aliases = {v: k for k, v in program.metadata.get("tied_weights", {}).items()}
        t0 = time.perf_counter()
        values = read_hf_checkpoint(self.config.init_from or "", wanted, aliases=aliases)
        self.engine.set_state(values)
        self.out.event(
            "init_from",
            path=self.config.init_from,
            tensors=len(values),
            seconds=time.perf_counter() - t0,
        )

    # ------------------------------------------------------------------ per step

    def _prefetcher(self, step: int) -> Prefetcher:
        rows = self.rows or (0, self.batch)
        offset = self.offset

        def load(k: int) -> tuple[int, Any]:
            data_step = k + offset
            return data_step, self.sampler.rows(data_step, *rows)

        return Prefetcher(load, step, self.config.steps, depth=self.config.prefetch)

    @property
    def _tokens_per_step(self) -> int:
        return self.batch * self.seq

    @property
    def _flops(self) -> float | None:
        value = self.doc.get("flops_per_step")
        return float(value) if isinstance(value, int | float) else None

    def _unhealthy(self, k: int, verdict: str, snapshot: Any) -> str:
        action = self.health.action(verdict)
        self.out.event("health", step=k, problem=verdict, action=action)
        if action == "stop":
            raise JobError(
                f"step {k}: {verdict}; the job stopped (health action `stop`)",
                fix="lower the lr, clip gradients (clip_grad_norm), or pass --on-nonfinite "
                "skip|rollback to carry on",
            )
        if action == "skip":
            self.engine.restore(snapshot)
            return action
        if self.health.rollbacks > self.config.health.max_rollbacks:
            raise JobError(
                f"step {k}: {verdict} after {self.config.health.max_rollbacks} rollbacks",
                fix="the run diverges from its checkpoints too: lower the lr or fix the data",
            )
        latest = self.store.latest()
        if latest is None:
            raise JobError(
                f"step {k}: {verdict}, and there is no checkpoint to roll back to",
                fix="pass --ckpt-every K so a rollback has somewhere to go",
            )
        self._wait_pending()
        self.engine.load_state(lambda targets: self.store.load(latest, targets))
        # skip the batches from the checkpoint up to the one that failed
        self.offset = k + self.offset - latest.step
        self.checkpointed = latest.step
        self.out.event("rollback", step=k, to=latest.step, offset=self.offset)
        return action

    def _eval_due(self, k: int) -> bool:
        every = self.config.eval_every_steps
        return every is not None and (k % every == 0 or k == self.config.steps)

    def _evaluate(self, k: int) -> None:
        assert self.eval_sampler is not None
        rows = self.rows or (0, self.batch)
        t0 = time.perf_counter()
        losses = []
        for i in range(self.config.eval_batches):
            idx, targets = self.eval_sampler.rows(i, *rows)
            losses.append(self.engine.eval_loss(idx, targets))
        loss = sum(losses) / len(losses)
        self.out.eval(k, loss, k * self._tokens_per_step, time.perf_counter() - t0)

    def _checkpoint_due(self, k: int) -> bool:
        every = self.config.ckpt_every
        return k == self.config.steps or (every is not None and k % every == 0)

    def _checkpoint(self, k: int) -> None:
        self._wait_pending()
        meta = {
            "identity": self.doc["identity"],
            "plan": self.doc["plan"],
            "engine": self.config.engine,
            "world": self.doc["world"],
            "cursor": self.sampler.cursor(k + self.offset),
            "offset": self.offset,
            "recipe": self.files.per_rank.metadata.get("recipe"),
        }
        t0 = time.perf_counter()
        self.at("checkpoint", k, self.config.steps)
        state = self.engine.checkpoint_state()
        # a tied weight under each of its names, as the model's state_dict() lists it, so plain
        # dcp.load(model.state_dict()) finds every key (loading reads the kept name only)
        for dropped, kept in self.files.per_rank.metadata.get("tied_weights", {}).items():
            if kept in state:
                state[dropped] = state[kept]
        self.pending = self.store.save(k, state, meta, async_=self.config.ckpt_async)
        stall_s = time.perf_counter() - t0
        if not self.config.ckpt_async:
            self.pending.wait()
            self.pending = None
        self.checkpointed = k
        self.out.event("checkpoint", step=k, stall_s=stall_s, async_=self.config.ckpt_async)

    def _wait_pending(self) -> None:
        if self.pending is not None:
            t0 = time.perf_counter()
            self.pending.wait()
            self.out.event("checkpoint_committed", waited_s=time.perf_counter() - t0)
            self.pending = None

    def _finish(self, steps: int) -> None:
        self._wait_pending()
        self.engine.barrier()
        self.out.finish(steps, self.config, self.engine, self._tokens_per_step)
