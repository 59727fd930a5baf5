"""The reference run of a pipelined step: every stage of `split_stages` in one process,
micro-batch after micro-batch, with the cpu backend. The engines (torch.distributed, XLA,
Neuron's stand-in) are compared with it and with the single-device step."""

from __future__ import annotations

import typing

import torch

from ..api import compile as compile_program
from ..ir.program import Program
from .pipeline_split import PipelineStages

__all__ = ["run_stages"]


def run_stages(
    stages: PipelineStages, state: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One step in this process, micro-batch after micro-batch: `(outputs by the step's output
    names, the new state by weight key)`. `state` holds every weight key; `batch` the GLOBAL
    batch by input name (micro-batch i is rows i, i+M, ..., as the step's own)."""
    m = stages.microbatches
    micro = {name: _micro_batches(value, m) for name, value in batch.items()}
    run = {
        (s.index, part): compile_program(getattr(s, part), backend="cpu")
        for s in stages.stages
        for part in ("forward", "backward", "update")
    }
    saved: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    losses = []
    for i in range(m):
        carried: dict[str, torch.Tensor] = {}
        for stage in stages.stages:
            env = {**state, **{k: v[i] for k, v in micro.items()}, **carried}
            outs = _call(run[stage.index, "forward"], stage.forward, env)
            carried = {
                "act:" + k.removeprefix("out:"): v for k, v in outs.items() if k.startswith("out:")
            }
            saved[stage.index, i] = outs
            if stage.index == len(stages.stages) - 1:
                losses.append(outs[stages.loss_name])
    summed: dict[str, torch.Tensor] = {}
    for i in range(m):
        grads: dict[str, torch.Tensor] = {}
        for stage in reversed(stages.stages):
            env = {**state, **{k: v[i] for k, v in micro.items()}, **saved[stage.index, i]}
            env.update(grads)
            outs = _call(run[stage.index, "backward"], stage.backward, env)
            grads = {k: v for k, v in outs.items() if k in stage.grads_sent}
            for name in stage.param_grads:
                key = (stage.index, name)
                prev = summed.get(f"{key}")
                summed[f"{key}"] = outs[name] if prev is None else prev + outs[name]
    for tied in stages.tied:
        total = sum(summed[f"{(s, tied.name)}"] for s in tied.stages)
        for s in tied.stages:
            summed[f"{(s, tied.name)}"] = typing.cast(torch.Tensor, total)
    outputs: dict[str, torch.Tensor] = {}
    total_loss = losses[0]
    for loss in losses[1:]:
        total_loss = total_loss + loss
    outputs[stages.loss_name] = total_loss
    for stage in stages.stages:
        env = dict(state)
        env.update({f"acc:{name}": summed[f"{(stage.index, name)}"] for name in stage.param_grads})
        outs = _call(run[stage.index, "update"], stage.update, env)
        for name, value in outs.items():
            outputs.setdefault(name, value)
    new_state = dict(state)
    for out in stages.outputs:
        if out.aliases is not None and out.target is not None:
            new_state[out.target] = outputs[out.name]
    return outputs, new_state


def _micro_batches(value: torch.Tensor, m: int) -> list[torch.Tensor]:
    return [value[i::m] for i in range(m)]


def _call(
    exe: typing.Any, program: Program, env: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    labels = program.metadata["pipeline"]["inputs"]
    args = [env[labels[i.name]] for i in program.signature.inputs]
    outs = exe(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return dict(zip((o.name for o in program.signature.outputs), outs, strict=True))
