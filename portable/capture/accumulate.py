"""Gradient accumulation inside one step program: N micro-batches, one optimizer update.

The joint graph is captured for one micro-batch of the loss `loss_fn(model, *mb) / N`. `unroll`
builds the step over the whole batch from N copies of it, in order, as the eager loop runs:

    for i in range(N):                      copy i of the joint graph on
        mb = [x[i::N] for x in batch]           every N-th row of each batch input
        (loss_fn(model, *mb) / N).backward()    grads_i, and buffers updated by copy i-1
    loss = sum of the N terms; p.grad = ((g_0 + g_1) + g_2) + ...   (AccumulateGrad's order)

so the gradients equal the eager accumulation bit for bit. A micro-batch takes every N-th row
(not a contiguous chunk) so that under data parallelism, where each rank holds a contiguous block
of rows, each rank's micro-batch is a slice of its own rows: no communication, and the per-rank
programs compute the single-device program's micro-batches. Also, a micro-batch's activations
die with its backward (memory is one micro-batch's), buffers (BatchNorm statistics, the dropout
counter) advance once per micro-batch, and under a plan the gradient reduction happens once,
where the optimizer consumes the summed gradient (spmd-partition inserts it there).
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from ..errors import CaptureError
from ..ir.program import Program
from ..ir.signature import InputKind, InputSpec, OutputKind, OutputSpec, Signature, TensorSpec
from .training import MICRO_BATCH, MICRO_LOSS, PHASE, tag_phases

__all__ = ["micro_batch", "unroll"]

aten = torch.ops.aten


def micro_batch(args: Sequence[Any], n: int) -> tuple[Any, ...]:
    """The first of `n` micro-batches of `args` (every tensor split along dim 0), checking that
    each splits evenly."""
    out = []
    for i, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor) or arg.dim() == 0 or arg.shape[0] % n:
            size = tuple(arg.shape) if isinstance(arg, torch.Tensor) else type(arg).__name__
            raise CaptureError(
                f"accumulate={n} splits every batch input along dim 0, but input {i} has shape "
                f"{size}"
                + (f" ({arg.shape[0]} % {n} = {arg.shape[0] % n})" if _split(arg) else ""),
                fix=f"pass a batch whose dim 0 is a multiple of {n}, or another accumulate",
            )
        out.append(arg[::n])
    return tuple(out)


def _split(arg: Any) -> bool:
    return isinstance(arg, torch.Tensor) and arg.dim() > 0


def unroll(program: Program, n: int) -> Program:
    """The step over n micro-batches from `program`, the joint graph of one (module doc)."""
    tag_phases(program)
    if n == 1:
        return program
    sig = program.signature
    if sig.outputs_of(OutputKind.UPDATED_INPUT):
        raise CaptureError(
            "accumulation: the model writes into its batch inputs",
            fix="do not modify batch tensors in place in the model or loss_fn",
        )
    src = program.graph
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    inputs = []
    for spec, node in zip(sig.inputs, _placeholders(src), strict=True):
        new = graph.placeholder(node.name)
        new.meta = dict(node.meta)
        if spec.kind is InputKind.USER_INPUT:
            spec = _whole(spec, n)
            new.meta["tensor"] = spec.spec
            new.meta["val"] = _fake_like(node.meta["val"], n)
        inputs.append(spec)
        env[node.name] = new
    buffers: dict[str, OutputSpec] = {
        o.aliases: o for o in sig.outputs_of(OutputKind.UPDATED_STATE) if o.aliases
    }
    loss: torch.fx.Node | None = None
    grads: list[torch.fx.Node] | None = None
    current = dict(env)  # the value each placeholder stands for in the next copy
    for i in range(n):
        val_map = {p: current[p.name] for p in _placeholders(src)}
        for spec, p in zip(sig.inputs, _placeholders(src), strict=True):
            if spec.kind is InputKind.USER_INPUT:
                val_map[p] = _slice(graph, env[p.name], i, n, p.meta["val"])
        before = set(graph.nodes)
        outs = typing.cast(tuple[torch.fx.Node, ...], graph.graph_copy(src, val_map))
        for node in graph.nodes:
            if node not in before and node.op == "call_function":
                node.meta[MICRO_BATCH] = i
        values = dict(zip((o.name for o in sig.outputs), outs, strict=True))
        term = values[sig.outputs_of(OutputKind.LOSS)[0].name]
        term.meta[MICRO_LOSS] = True
        loss = term if loss is None else _add(graph, loss, term, "forward", i)
        step_grads = [values[g.name] for g in sig.outputs_of(OutputKind.GRADIENT)]
        grads = step_grads if grads is None else [
            _add(graph, a, b, "backward", i) for a, b in zip(grads, step_grads, strict=True)
        ]  # fmt: skip
        for alias, out in buffers.items():
            current[alias] = values[out.name]
    assert loss is not None and grads is not None
    final = {o.name: current[alias] for alias, o in buffers.items()}
    final[sig.outputs_of(OutputKind.LOSS)[0].name] = loss
    final.update(zip((g.name for g in sig.outputs_of(OutputKind.GRADIENT)), grads, strict=True))
    graph.output(tuple(final[o.name] for o in sig.outputs))
    graph.eliminate_dead_code()
    graph.lint()
    step = program.replace()
    step.graph_module = torch.fx.GraphModule(program.graph_module, graph)
    step.signature = Signature(tuple(inputs), sig.outputs)
    return step


def _placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [node for node in graph.nodes if node.op == "placeholder"]


def _whole(spec: InputSpec, n: int) -> InputSpec:
    rows = spec.spec.shape[0]
    assert isinstance(rows, int)  # micro_batch checked the batch (static shapes)
    shape = (rows * n, *spec.spec.shape[1:])
    return InputSpec(spec.name, spec.kind, TensorSpec(tuple(shape), spec.spec.dtype), spec.target)


def _fake_like(value: torch.Tensor, n: int) -> torch.Tensor:
    return value.new_empty((value.shape[0] * n, *value.shape[1:]))


def _slice(
    graph: torch.fx.Graph, whole: torch.fx.Node, i: int, n: int, part: torch.Tensor
) -> torch.fx.Node:
    """Micro-batch i of a batch input: rows i, i+n, i+2n, ... (`x[i::n]`), as
    `x.view(B // n, n, ...).select(1, i)`: under data parallelism, where each rank holds a
    contiguous block of rows, that is a slice of the rank's own rows."""
    shape = [int(part.shape[0]), n, *map(int, part.shape[1:])]
    rows = whole.meta["val"].view(shape)
    view = graph.call_function(aten.view.default, (whole, shape))
    view.meta.update(val=rows, tensor=TensorSpec.of(rows), **{PHASE: "forward", MICRO_BATCH: i})
    node = graph.call_function(aten.select.int, (view, 1, i))
    node.meta.update(val=part, tensor=TensorSpec.of(part), **{PHASE: "forward", MICRO_BATCH: i})
    return node


def _add(
    graph: torch.fx.Graph, a: torch.fx.Node, b: torch.fx.Node, phase: str, i: int
) -> torch.fx.Node:
    node = graph.call_function(aten.add.Tensor, (a, b))
    node.meta.update({k: v for k, v in b.meta.items() if k in ("val", "tensor", "source")})
    node.meta.update({PHASE: phase, MICRO_BATCH: i})
    return node
