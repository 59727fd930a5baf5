"""Graph walks the pipeline split needs over a training step's joint graph: ancestors, the
micro-batch-0 value under an accumulation sum, the parts of a gradient summed across stages, and
phases for the ops a pass inserted without one."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.fx

__all__ = [
    "MICRO_BATCH",
    "PHASE",
    "ancestors",
    "closure_up",
    "first_micro_batch",
    "sum_leaves",
    "sum_nodes",
    "tag_inserted",
]

aten = torch.ops.aten

PHASE, MICRO_BATCH = "phase", "micro_batch"  # node tags of a training step (capture/training.py)


def closure_up(node: torch.fx.Node, stop: Iterable[torch.fx.Node]) -> set[torch.fx.Node]:
    """`node` and its ancestors, not looking past the nodes in `stop`."""
    stop = set(stop)
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop or n is node:
            todo.extend(n.all_input_nodes)
    return seen


def ancestors(roots: Sequence[torch.fx.Node], within: set[torch.fx.Node]) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = [r for r in roots if r in within]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(a for a in n.all_input_nodes if a in within)
    return seen


_COLLECTIVES = frozenset(
    {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "wait", "local_shard"}
)


def tag_inserted(nodes: list[torch.fx.Node]) -> None:
    """Give ops a pass inserted without a phase (spmd-partition's collectives and waits, in a
    per-rank step) one: those only the update reads belong to the update (a data-parallel
    gradient all-reduce after accumulation), the others to the phase and micro-batch of the value
    they carry (a tensor-parallel all-reduce of one micro-batch's activation or gradient)."""

    def tag(node: torch.fx.Node, phase: str, micro_batch: int) -> None:
        node.meta[PHASE], node.meta[MICRO_BATCH] = phase, micro_batch

    order = {"forward": 0, "backward": 1, "optimizer": 2}
    for node in reversed(nodes):
        users = [u for u in node.users if u.op == "call_function"]
        collective = (
            str(node.target).startswith("portable.")
            and str(node.target).split(".")[1] in _COLLECTIVES
        )
        if PHASE not in node.meta and users and collective:
            if all(u.meta.get(PHASE) == "optimizer" for u in users):
                tag(node, "optimizer", 0)
    for node in nodes:
        if PHASE not in node.meta:
            tagged = [a for a in node.all_input_nodes if PHASE in a.meta]
            if tagged:  # the latest of what it reads: an accumulation's micro-batch i
                source = max(
                    tagged, key=lambda a: (order[a.meta[PHASE]], a.meta.get(MICRO_BATCH, 0))
                )
                tag(node, source.meta[PHASE], source.meta.get(MICRO_BATCH, 0))
    for node in reversed(nodes):
        if PHASE not in node.meta:
            user = next((u for u in node.users if PHASE in u.meta), None)
            if user is not None:
                tag(node, user.meta[PHASE], user.meta.get(MICRO_BATCH, 0))


def first_micro_batch(grad: torch.fx.Node) -> torch.fx.Node:
    """Micro-batch 0's value under the accumulation chain `((g0 + g1) + g2) + ...` (a gradient,
    or the loss)."""
    while (
        grad.target is aten.add.Tensor
        and grad.meta.get(MICRO_BATCH, 0) >= 1
        and isinstance(grad.args[0], torch.fx.Node)
        and grad.args[0].meta.get(MICRO_BATCH, 0) < grad.meta[MICRO_BATCH]
    ):
        grad = grad.args[0]
    return grad


def sum_leaves(grad: torch.fx.Node, stage: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    """The parts of a gradient that is a sum of parts from different stages."""
    if grad.target is aten.add.Tensor and len(grad.args) == 2:
        a, b = grad.args
        if isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node):
            if a in stage and b in stage and _stages(a, stage) != _stages(b, stage):
                return sum_leaves(a, stage) + sum_leaves(b, stage)
    return [grad]


def _stages(node: torch.fx.Node, stage: dict[torch.fx.Node, int]) -> set[int]:
    return {stage[leaf] for leaf in sum_leaves(node, stage)} if node in stage else set()


def sum_nodes(grad: torch.fx.Node, stage: dict[torch.fx.Node, int]) -> list[torch.fx.Node]:
    leaves = set(sum_leaves(grad, stage))
    out, todo = [], [grad]
    while todo:
        n = todo.pop()
        if n in leaves:
            continue
        out.append(n)
        todo.extend(a for a in n.args if isinstance(a, torch.fx.Node))
    return out
