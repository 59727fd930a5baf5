"""Validator checks of collectives: explicit replica groups, and for per-rank programs groups that
partition the world's ranks into the groups of each collective's mesh axis (range, cover, equal
sizes, size == axis size) with a split dim the group size divides; and the Neuron runtime's
limits on groups, for every module:

- at most 12 distinct replica groups per NEFF (`NEC_MAX_COMM_N 12`, "Max supported
  replica-groups in NEFF", nrt/nec.h in the Neuron runtime API reference). Counted over the
  grouped collectives (all-reduce, all-gather, reduce-scatter, all-to-all); collective-permute's
  source_target_pairs are not replica groups and are not counted;
- a group that spans nodes must be symmetric: the same number of its ranks on every node it
  spans (docs/reference/neuron.md, Corrections: "inter-node groups must be symmetric"; no public
  runtime page states it). Ranks are placed one per logical core, filling the target topology's
  nodes (collectives.placement).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from portable.opset import bind

from .collectives import placement
from .findings import Finding
from .hlo import Instruction

if TYPE_CHECKING:
    import torch.fx

    from .validate import Context

__all__ = ["COLLECTIVES", "MAX_REPLICA_GROUPS", "collectives"]

COLLECTIVES = frozenset(
    {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}
)
MAX_REPLICA_GROUPS = 12  # NEC_MAX_COMM_N (nrt/nec.h): replica groups one NEFF may use


def collectives(ctx: Context) -> Iterator[Finding]:
    distinct: dict[tuple[tuple[int, ...], ...], Instruction] = {}
    for ins in ctx.module.instructions():
        base = ins.opcode.removesuffix("-start")
        if base not in COLLECTIVES or base == "collective-permute":
            continue
        groups = ins.attrs.get("replica_groups", "").replace(" ", "")
        if groups in ("", "{}"):
            yield ctx.error(
                ins,
                "collective-groups",
                f"{base} without explicit replica_groups",
                "list the global ranks of each group explicitly (the spmd-partition pass does)",
            )
            continue
        parsed = _parse_groups(groups)
        distinct.setdefault(tuple(sorted(tuple(sorted(g)) for g in parsed)), ins)
        yield from _symmetry(ctx, ins, base, parsed)
        if ctx.ranks is not None:
            yield from _group_findings(ctx, ins, base, parsed)
    if len(distinct) > MAX_REPLICA_GROUPS:
        yield _too_many(ctx, distinct)


def _too_many(ctx: Context, distinct: dict[tuple[tuple[int, ...], ...], Instruction]) -> Finding:
    """The program uses more distinct replica groups than one NEFF may; the finding points at
    the first collective past the limit."""
    first_over = list(distinct.values())[MAX_REPLICA_GROUPS]
    sizes = sorted({len(groups[0]) for groups in distinct if groups})
    return ctx.error(
        first_over,
        "replica-groups-count",
        f"{len(distinct)} distinct replica groups in one program (group sizes {sizes}); the "
        f"Neuron runtime loads at most {MAX_REPLICA_GROUPS} per NEFF (NEC_MAX_COMM_N, "
        f"{len(distinct)} > {MAX_REPLICA_GROUPS})",
        "run collectives over fewer distinct plan axes per program (every collective over one "
        "mesh axis shares that axis's groups), or split the program (pipeline stages) so each "
        f"NEFF uses at most {MAX_REPLICA_GROUPS}",
    )


def _symmetry(
    ctx: Context, ins: Instruction, op: str, groups: list[list[int]]
) -> Iterator[Finding]:
    """Each group that spans nodes has the same number of ranks on every node it spans (the
    first group that does not is reported)."""
    per_node = ctx.target.cores_per_node
    for group in groups:
        counts: dict[int, int] = {}
        for rank in group:
            node = placement(ctx.target, rank)["node"]
            counts[node] = counts.get(node, 0) + 1
        if len(counts) > 1 and len(set(counts.values())) > 1:
            shown = ", ".join(f"node {n}: {c}" for n, c in sorted(counts.items()))
            yield ctx.error(
                ins,
                "replica-groups-symmetric",
                f"{op} group {group} spans {len(counts)} nodes unevenly ({shown}); the Neuron "
                "runtime needs a group that crosses nodes to have the same number of ranks on "
                f"each node ({ctx.target.topology.name}: {per_node} ranks per node)",
                f"choose mesh sizes whose groups hold whole nodes or an equal share of each "
                f"node: the ranks of one node's {per_node} cores divided evenly (a different "
                "topology= changes the node size)",
            )
            return


def _parse_groups(text: str) -> list[list[int]]:
    """`{{0,1},{2,3}}` -> [[0, 1], [2, 3]] (XLA's iota form `[2,2]<=[4]` expanded)."""
    iota = re.fullmatch(r"\[(\d+),(\d+)\]<=\[(\d+)\]", text)
    if iota:
        count, size = int(iota[1]), int(iota[2])
        return [list(range(g * size, (g + 1) * size)) for g in range(count)]
    return [[int(r) for r in g.split(",") if r] for g in re.findall(r"\{([\d,]*)\}", text)]


def _group_findings(
    ctx: Context, ins: Instruction, op: str, groups: list[list[int]]
) -> Iterator[Finding]:
    """Every rank exactly once, equal group sizes, group size == the axis size, ranks < world;
    the scattered / split dim divisible by the group size."""
    world = ctx.ranks.world_size
    node = ctx.locator.node_of(ins)
    axis = _collective_axis(node)
    shown = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"
    fix = (
        "replica groups must partition the world's ranks into the groups of the collective's "
        "mesh axis (a bug in portable's neuron lowering or the spmd-partition pass: report it)"
    )
    ranks = [r for g in groups for r in g]
    outside = sorted({r for r in ranks if not 0 <= r < world})
    if outside:
        yield ctx.error(
            ins,
            "replica-groups-range",
            f"{op} replica groups {shown} name ranks {outside} outside the world of {world}",
            fix,
        )
    missing = sorted(set(range(world)) - set(ranks))
    repeated = sorted({r for r in ranks if ranks.count(r) > 1})
    if missing or repeated:
        yield ctx.error(
            ins,
            "replica-groups-cover",
            f"{op} replica groups {shown} must hold each of the {world} "
            f"ranks once: missing {missing}, repeated {repeated}",
            fix,
        )
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        yield ctx.error(
            ins, "replica-groups-size", f"{op} replica groups {shown} differ in size ({sizes})", fix
        )
    if axis is not None and axis in ctx.ranks.mesh.names:
        want = ctx.ranks.mesh.axis_size(axis)
        if sizes and sizes[0] != want:
            yield ctx.error(
                ins,
                "replica-groups-axis",
                f"{op} over mesh axis {axis!r} (size {want}) has groups of {sizes[0]} ranks",
                fix,
            )
    yield from _divisibility(ctx, ins, op, len(groups[0]) if groups else 1)


def _collective_axis(node: torch.fx.Node | None) -> str | None:
    """The mesh axis a portable collective node runs over (its `axis` argument)."""
    if node is None or not str(node.target).startswith("portable."):
        return None
    axis = bind(node).get("axis")
    return axis if isinstance(axis, str) else None


def _divisibility(ctx: Context, ins: Instruction, op: str, size: int) -> Iterator[Finding]:
    if op not in ("reduce-scatter", "all-to-all") or size <= 1:
        return
    dims = re.findall(r"\d+", ins.attrs.get("dimensions", ""))
    computation = ctx.module.computation(ins.computation)
    operand = computation.by_name().get(ins.operands[0]) if computation is not None else None
    if not dims or operand is None or not operand.leaves:
        return
    dim = int(dims[0])
    extent = operand.leaves[0].dims[dim]
    if extent % size:
        yield ctx.error(
            ins,
            "collective-divisibility",
            f"{op} splits dim {dim} ({extent}) into {size} chunks: {extent} % {size} = "
            f"{extent % size}",
            "choose mesh sizes that divide the dim, or pad it to a multiple of the group size",
        )
