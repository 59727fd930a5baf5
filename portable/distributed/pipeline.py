"""Pipelined training steps on torch.distributed: the stages of `passes/pipeline_split.py` under
`torch.distributed.pipelining`'s own schedules (no scheduler here).

Each pipeline rank wraps each of its stages in a `torch.distributed.pipelining.PipelineStage`
whose module runs the stage's programs with the cpu backend's executables:

- forward: an autograd Function over (received activations, the stage's parameters) running the
  stage's `forward` program; it keeps the residuals for its backward. The last stage's module
  returns the micro-batch's loss (the program's, already divided by the micro-batch count, so the
  schedule runs with `scale_grads=False` and an identity loss function);
- backward: the Function's backward runs the `backward` program, returning the gradients of the
  received activations (sent back by the schedule); the parameters' gradients are summed by the
  stage's runtime, micro-batch after micro-batch, as the single-device step sums them;
- zero-bubble: the backward runs `backward_input` only and stashes its outputs; the stage's
  `dw_builder` runs `backward_weight` when the schedule reaches the weight-gradient action.

The first stage takes the batch inputs the schedule splits (rows reordered so that torch's
contiguous chunk i is the step's micro-batch i: rows i, i+M, ...); later stages read their batch
inputs' micro-batch by counting their forward calls (every schedule runs a stage's forwards in
micro-batch order; checked after each step). After the schedule, tied gradients are all-reduced
over the ranks holding them, each stage runs its `update` program, and the new state replaces
the old. `step_times` records each rank's forward and backward compute, from which the runner
reports the measured bubble: 1 - busy / step time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..api import compile as compile_program
from ..errors import PlanError
from ..ir.plan import Mesh
from ..ir.sharding import coords_of, groups_of
from ..opset.collectives import collective_runtime
from ..passes.pipeline_split import PipelineStages, StagePrograms

__all__ = ["PipelineRank", "bubble_formula", "schedule_class"]


def schedule_class(name: str, virtual_stages: int) -> type:
    """torch.distributed.pipelining's schedule for a `Pipeline.schedule` name."""
    from torch.distributed.pipelining import schedules

    table: dict[str, type] = {
        "gpipe": schedules.ScheduleGPipe,
        "1f1b": schedules.Schedule1F1B,
        "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
        "zero-bubble": schedules.ScheduleInterleavedZeroBubble,
    }
    return table[name]


def bubble_formula(schedule: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of a step the schedule's own analysis gives (equal forward and backward
    costs): (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) interleaved (Narayanan et al.
    2021); zero-bubble (ZB-H1, Qi et al. 2024) fills a third of 1F1B's: (p-1)/(3m+p-1) with
    backward-input and weight-gradient each costing one forward."""
    p, m, v = ranks, microbatches, virtual_stages
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero-bubble":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


@dataclasses.dataclass
class _Timer:
    busy: float = 0.0

    def add(self, start: float) -> None:
        self.busy += time.perf_counter() - start


class _StageRuntime:
    """One stage's executables, parameters and per-step bookkeeping."""

    def __init__(
        self,
        stage: StagePrograms,
        state: Mapping[str, torch.Tensor],
        batch: Mapping[str, list[torch.Tensor]],
        timer: _Timer,
        last: bool,
    ) -> None:
        self.stage = stage
        self.last = last
        self.timer = timer
        self.batch = batch
        self.run = {
            part: compile_program(getattr(stage, part), backend="cpu")
            for part in ("forward", "backward", "backward_input", "backward_weight", "update")
        }
        self.params = {key: nn.Parameter(state[key].clone()) for key in stage.grad_targets}
        self.state = {k: state[k] for k in stage.state if k not in self.params}
        self.forwards = 0
        self.stash: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.grads: dict[str, torch.Tensor] = {}  # gradient name -> sum over micro-batches

    def accumulate(self, outs: Mapping[str, torch.Tensor]) -> None:
        """Add a micro-batch's parameter gradients: ((g0 + g1) + g2) + ..., the step's order."""
        for name in self.stage.param_grads:
            prev = self.grads.get(name)
            self.grads[name] = outs[name] if prev is None else prev + outs[name]

    def env(self, micro_batch: int) -> dict[str, torch.Tensor]:
        values = {k: p.detach() for k, p in self.params.items()}
        values.update(self.state)
        values.update({name: parts[micro_batch] for name, parts in self.batch.items()})
        return values

    def call(self, part: str, env: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        program = getattr(self.stage, part)
        labels = program.metadata["pipeline"]["inputs"]
        args = [env[labels[i.name]] for i in program.signature.inputs]
        start = time.perf_counter()
        outs = self.run[part](*args)
        self.timer.add(start)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return dict(zip((o.name for o in program.signature.outputs), outs, strict=True))


class _StageFunction(torch.autograd.Function):
    """Forward: the stage's forward program; backward: its backward (or backward_input)."""

    @staticmethod
    def forward(ctx: Any, rt: _StageRuntime, zero_bubble: bool, *inputs: torch.Tensor) -> Any:
        micro_batch = rt.forwards
        rt.forwards += 1
        acts = inputs[: len(rt.stage.receives)]
        env = rt.env(micro_batch)
        env.update(zip(rt.stage.receives, (a.detach() for a in acts), strict=True))
        outs = rt.call("forward", env)
        ctx.rt, ctx.zero_bubble, ctx.micro_batch = rt, zero_bubble, micro_batch
        ctx.saved = {k: v for k, v in outs.items() if k.startswith("res:")}
        ctx.floats = [a.dtype.is_floating_point for a in acts]
        if rt.last:
            return outs[_loss_name(rt)]
        return tuple(outs[name] for name in rt.stage.sends)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        rt: _StageRuntime = ctx.rt
        env = rt.env(ctx.micro_batch)
        env.update(ctx.saved)
        seed = None
        if rt.last:
            seed = grads[0]
        else:
            for name, grad in zip(rt.stage.sends, grads, strict=True):
                env["grad:" + name.removeprefix("out:")] = grad
        part = "backward_input" if ctx.zero_bubble else "backward"
        outs = rt.call(part, env)
        if seed is not None and float(seed) != 1.0:
            outs = {k: v * seed for k, v in outs.items()}
        sent = iter(outs[name] for name in rt.stage.grads_sent)
        act_grads = [next(sent) if f else None for f in ctx.floats]
        if ctx.zero_bubble:
            rt.stash.append((ctx.micro_batch, {**env, **outs}))
        else:
            rt.accumulate(outs)
        del ctx.saved
        # parameter gradients are summed by the runtime (their per-rank shapes may differ from
        # the parameters' shards: a tensor-parallel gradient is sliced in the update), not by
        # autograd: the parameters are inputs here only so that every stage's backward runs
        return (None, None, *act_grads, *([None] * len(rt.params)))


def _loss_name(rt: _StageRuntime) -> str:
    return next(o.name for o in rt.stage.forward.signature.outputs if not o.name.startswith("res:"))


class _StageModule(nn.Module):
    def __init__(self, rt: _StageRuntime, zero_bubble: bool) -> None:
        super().__init__()
        self.rt = rt
        self.zero_bubble = zero_bubble
        for i, param in enumerate(rt.params.values()):
            self.register_parameter(f"p{i}", param)

    def forward(self, *acts: torch.Tensor) -> Any:
        if self.rt.stage.index == 0:
            acts = ()  # the first stage reads its batch micro-batch itself (the same rows)
        out = _StageFunction.apply(self.rt, self.zero_bubble, *acts, *self.rt.params.values())
        return out.reshape(1) if self.rt.last else out

    def weight_job(self) -> Any:
        """The zero-bubble weight-gradient action of the micro-batch whose backward just ran
        (torch calls a stage's `dw_builder` right after that backward, runs the job later)."""
        rt = self.rt
        _, env = rt.stash.pop()

        def run() -> None:
            rt.accumulate(rt.call("backward_weight", env))

        return run


class PipelineRank:
    """This process's stages of `stages` under torch.distributed.pipelining.

    Over a mesh of the pipeline axis alone the world's ranks are the pipeline ranks. Over a
    mesh with other axes (`mesh`, the stages cut from a step spmd-partition made per-rank over
    the other axes) each group of the pipeline axis runs its own pipeline, and the collectives
    inside the stage programs (tensor-parallel all-reduces, data-parallel gradient all-reduces in
    the update) run on `collectives` (a TorchCollectives over the whole mesh). Every rank must
    construct it (process groups are created collectively)."""

    def __init__(
        self,
        stages: PipelineStages,
        state: Mapping[str, torch.Tensor],
        batch_shapes: Mapping[str, torch.Tensor],
        *,
        mesh: Mesh | None = None,
        collectives: Any = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.stages = stages
        self.collectives = collectives
        axis = stages.pipeline.axis
        world = dist.get_rank()
        group = None
        self.rank = world
        self.tied_groups: dict[str, Any] = {}
        if mesh is not None and mesh.size > mesh.axis_size(axis):
            self.rank = coords_of(mesh, world)[axis]
            for ranks in groups_of(mesh, axis):  # every rank creates every group, in order
                made = dist.new_group(ranks)
                if world in ranks:
                    group = made
                for tied in stages.tied:
                    holders = sorted({ranks[s % stages.ranks] for s in tied.stages})
                    made = dist.new_group(holders) if len(holders) > 1 else None
                    if world in holders:
                        self.tied_groups[tied.name] = made
        else:
            for tied in stages.tied:
                holders = sorted({s % stages.ranks for s in tied.stages})
                made = dist.new_group(holders) if len(holders) > 1 else None
                self.tied_groups[tied.name] = made
        self.timer = _Timer()
        pipeline = stages.pipeline
        self.zero_bubble = pipeline.schedule == "zero-bubble"
        self.micro: dict[str, list[torch.Tensor]] = {}
        self.local = stages.stages_of_rank(self.rank)
        n = len(stages.stages)
        self.runtimes = [
            _StageRuntime(s, state, self.micro, self.timer, s.index == n - 1) for s in self.local
        ]
        self.modules = [_StageModule(rt, self.zero_bubble) for rt in self.runtimes]
        torch_stages = []
        for module, rt in zip(self.modules, self.runtimes, strict=True):
            inputs = _examples(rt.stage.forward, rt.stage.receives, grad=True)
            if rt.stage.index == 0:
                inputs = tuple(_first_stage_inputs(stages, batch_shapes))
            outputs = (
                (torch.zeros(1),)
                if rt.last
                else _examples(rt.stage.forward, rt.stage.sends, grad=False)
            )
            # static metadata: the shapes of what each stage sends and receives, both ways
            input_grads = None
            if rt.stage.index:
                input_grads = tuple(
                    x.detach() if x.dtype.is_floating_point else None for x in inputs
                )
            output_grads = None if rt.last else tuple(x.detach() for x in outputs)
            torch_stages.append(
                PipelineStage(
                    module,
                    rt.stage.index,
                    n,
                    torch.device("cpu"),
                    input_args=inputs,
                    output_args=outputs,
                    input_grads=input_grads,
                    output_grads=output_grads,
                    group=group,
                    dw_builder=module.weight_job if self.zero_bubble else None,
                )
            )
        cls = schedule_class(pipeline.schedule, pipeline.virtual_stages)
        kwargs: dict[str, Any] = {"loss_fn": _identity_loss, "scale_grads": False}
        if pipeline.virtual_stages == 1 and pipeline.schedule in ("gpipe", "1f1b"):
            self.schedule = cls(torch_stages[0], stages.microbatches, **kwargs)
        else:
            self.schedule = cls(torch_stages, stages.microbatches, **kwargs)

    def step(
        self, batch: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """One training step on the GLOBAL batch: (the loss on the rank holding the last stage,
        else None; the step's outputs this rank computed, by name). State is updated in place."""
        m = self.stages.microbatches
        self.micro.clear()
        self.micro.update({name: [v[i::m] for i in range(m)] for name, v in batch.items()})
        for rt in self.runtimes:
            rt.forwards = 0
            rt.grads = {}
        first = [_interleave(batch[name], m) for name in _first_names(self.stages)]
        losses: list[torch.Tensor] = []
        self.timer.busy = 0.0
        start = time.perf_counter()
        # the last stage's loss is its module's output; the target the schedule insists on
        # handing the loss function is a placeholder, one row per micro-batch
        target = torch.zeros(m)
        with self._collective_runtime():
            self.schedule.step(*first if self._holds(0) else (), target=target, losses=losses)
        self.step_s = time.perf_counter() - start
        self.busy_s = self.timer.busy
        for rt in self.runtimes:
            if rt.forwards != m:
                raise PlanError(
                    f"stage {rt.stage.index} ran {rt.forwards} forwards for {m} micro-batches",
                    fix="use one of the schedules portable names (Pipeline.schedule)",
                )
        self._sum_tied()
        with self._collective_runtime():
            outputs = self._update()
        loss = None
        if losses:
            loss = losses[0]
            for part in losses[1:]:
                loss = loss + part
            outputs[self.stages.loss_name] = loss.detach()
        return loss, outputs

    def _collective_runtime(self) -> Any:
        if self.collectives is None:
            return contextlib.nullcontext()
        return collective_runtime(self.collectives)

    def _holds(self, index: int) -> bool:
        return any(rt.stage.index == index for rt in self.runtimes)

    def _sum_tied(self) -> None:
        for tied in self.stages.tied:
            group = self.tied_groups.get(tied.name)
            held = [rt for rt in self.runtimes if tied.name in rt.grads]
            if not held:
                continue
            total = held[0].grads[tied.name].clone()
            for rt in held[1:]:
                total += rt.grads[tied.name]
            if group is not None:
                dist.all_reduce(total, group=group)
            for rt in held:
                rt.grads[tied.name] = total

    def _update(self) -> dict[str, torch.Tensor]:
        outputs: dict[str, torch.Tensor] = {}
        for rt in self.runtimes:
            env = {**rt.env(0)}
            for name in rt.stage.param_grads:
                env[f"acc:{name}"] = rt.grads[name]
            outs = rt.call("update", env)
            new = {
                o.target: outs[o.name] for o in self.stages.outputs if o.name in outs and o.target
            }
            for key, value in new.items():
                if key in rt.params:
                    rt.params[key].data = value
                elif key in rt.state:
                    rt.state[key] = value
            for name, value in outs.items():
                outputs.setdefault(name, value)
        return outputs

    def load(self, values: Mapping[str, torch.Tensor]) -> None:
        """Replace held state entries (by weight key) with `values` (whole tensors)."""
        for rt in self.runtimes:
            for key, value in values.items():
                if key in rt.params:
                    rt.params[key].data = value.detach().clone()
                elif key in rt.state:
                    rt.state[key] = value.detach().clone()

    def state(self) -> dict[str, torch.Tensor]:
        """The state this rank holds, by weight key (a tied parameter from each holder)."""
        held: dict[str, torch.Tensor] = {}
        for rt in self.runtimes:
            held.update({k: p.detach() for k, p in rt.params.items()})
            held.update(rt.state)
        return held


def _identity_loss(output: torch.Tensor, target: Any = None) -> torch.Tensor:
    """The last stage's module returns its loss as one row (the schedule concatenates stage
    outputs); the loss is that row."""
    return output.reshape(())


def _first_names(stages: PipelineStages) -> list[str]:
    labels = stages.stages[0].forward.metadata["pipeline"]["inputs"].values()
    return [name for name in stages.batch_inputs if name in labels]


def _first_stage_inputs(
    stages: PipelineStages, batch: Mapping[str, torch.Tensor]
) -> list[torch.Tensor]:
    m = stages.microbatches
    return [batch[name][::m] for name in _first_names(stages)]


def _interleave(value: torch.Tensor, m: int) -> torch.Tensor:
    """Rows reordered so that contiguous chunk i holds rows i, i+m, ... (micro-batch i)."""
    return torch.cat([value[i::m] for i in range(m)])


def _examples(program: Any, names: Sequence[str], *, grad: bool) -> tuple[torch.Tensor, ...]:
    labels = program.metadata["pipeline"]["inputs"]
    specs = {labels[i.name]: i.spec for i in program.signature.inputs}
    specs.update({o.name: o.spec for o in program.signature.outputs})
    out = []
    for name in names:
        spec = specs[name]
        value = torch.zeros(tuple(int(d) for d in spec.shape), dtype=spec.dtype)
        if grad and value.dtype.is_floating_point:
            value.requires_grad_(True)
        out.append(value)
    return tuple(out)
