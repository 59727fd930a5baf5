"""Per-rank collectives for neuronx-cc: explicit replica groups of GLOBAL ranks in NxD order.

neuronx-cc does not partition: each rank runs an HLO whose collectives list the global ranks of
every group (`replica_groups`). Ranks are numbered as NxD numbers them: row-major over the grid
[PP, DP, CP, TP] (TP contiguous, so a TP group sits on neighbouring cores of one chip). Mesh axes
map to those roles by name:

    pp                  -> PP
    dp, fsdp, data      -> DP
    cp, sp, seq         -> CP
    tp, mp              -> TP

Several axes with one role are ordered as declared in the mesh (major first). The portable rank
of the same coordinates (row-major in mesh order, `portable.ir.sharding`) can differ from the NxD
rank when the mesh is declared in another order; `RankLayout` keeps both.

On trn1 with TP = 4, NxD's groups are not contiguous (parallel_state.initialize_model_parallel):
each TP group is 4 cores of one trn1.32xlarge at stride 8, [[0, 8, 16, 24], [1, 9, 17, 25], ...],
so no TP group crosses a node; `RankLayout.of(mesh, trn1)` reproduces that order when each
pipeline stage fills whole nodes. Ranks run one per logical core, filling chips and then nodes of
the target's topology (`placement`).

Each collective lowers to the stablehlo op with `replica_groups` and no channel handle: a
cross-replica collective over replica ids = global ranks (one replica per rank, num_replicas =
world size), the form torch-xla hands neuronx-cc. Every rank runs the same HLO. `local_shard` (and
reduce_scatter with max/min) needs the rank's coordinate on its axis; the compiler supports
neither `replica-id` nor `partition-id`, so such a program takes the NxD rank as one more HLO
parameter, an int32 scalar (`rank_id`, the last parameter), and computes the coordinate in the
graph: coordinate(axis) = (rank_id / stride(axis)) % size(axis), stride = the product of the sizes
of the axes after it in NxD order (a sum of such terms in trn1's TP = 4 order, where an axis is
split around TP); the chunk is a `dynamic-slice` at coordinate * chunk size.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import TYPE_CHECKING, Any

import torch.fx

from portable.errors import PlanError
from portable.ir.plan import Mesh
from portable.ir.program import Program
from portable.ir.sharding import coords_of
from portable.opset import bind

from .targets import NeuronTarget

if TYPE_CHECKING:
    import jax
    from jax._src import core

__all__ = [
    "ROLES",
    "Digit",
    "RankLayout",
    "ReplicaGroupCollectives",
    "RANK_INPUT",
    "placement",
    "rank_axes",
    "rank_layout",
]

ROLES = ("PP", "DP", "CP", "TP")  # NxD grid order, major to minor
_CONTIGUOUS = "row-major over [PP, DP, CP, TP], TP contiguous (NxD)"
RANK_INPUT = "rank_id"  # the int32 HLO parameter holding the NxD rank (replica id) of the core
_ROLE_OF = {
    "pp": "PP",
    "dp": "DP",
    "fsdp": "DP",
    "data": "DP",
    "cp": "CP",
    "sp": "CP",
    "seq": "CP",
    "tp": "TP",
    "mp": "TP",
}


def rank_layout(program: Program, target: NeuronTarget | None = None) -> RankLayout | None:
    """The rank layout of a per-rank program (`Program.is_per_rank`: a layout over more than
    one device) on `target` (None: NxD's contiguous order); None for a single-device program."""
    if program.spmd is None or not program.is_per_rank:
        return None
    return RankLayout.of(program.spmd.mesh, target)


@dataclasses.dataclass(frozen=True)
class Digit:
    """One digit of the NxD rank written as a mixed-radix number: `radix` values, worth
    `weight` in the coordinate on `axis` (coordinate = sum of its digits x weights)."""

    axis: str
    radix: int
    weight: int


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """The mesh's axes as NxD roles, and global ranks in NxD order: the rank is the mixed-radix
    number of `digits` (major first). Contiguous NxD order has one digit per axis in `order`."""

    mesh: Mesh
    order: tuple[str, ...]  # mesh axes in NxD order (PP, DP, CP, TP; mesh order within a role)
    digits: tuple[Digit, ...] = ()
    rank_order: str = _CONTIGUOUS

    @staticmethod
    def of(mesh: Mesh, target: NeuronTarget | None = None) -> RankLayout:
        unknown = [a for a in mesh.names if a not in _ROLE_OF]
        if unknown:
            names = ", ".join(f"{k} ({v})" for k, v in _ROLE_OF.items())
            raise PlanError(
                f"mesh axis {unknown[0]!r} has no NxD role (PP, DP, CP, TP) for the neuron backend",
                fix=f"rename the axis to one of: {names}",
            )
        order = tuple(a for role in ROLES for a in mesh.names if _ROLE_OF[a] == role)
        contiguous = tuple(Digit(a, mesh.axis_size(a), 1) for a in order)
        layout = RankLayout(mesh, order, contiguous)
        if target is not None and target.name == "trn1":
            return _trn1_tp4(layout, target) or layout
        return layout

    @property
    def world_size(self) -> int:
        return self.mesh.size

    def role(self, axis: str) -> str:
        return _ROLE_OF[axis]

    def nxd_rank(self, coords: dict[str, int]) -> int:
        rank = 0
        for d in self.digits:
            rank = rank * d.radix + coords[d.axis] // d.weight % d.radix
        return rank

    def _places(self) -> list[int]:
        """The rank value of one step of each digit (product of the radices after it)."""
        return [math.prod(d.radix for d in self.digits[k + 1 :]) for k in range(len(self.digits))]

    def coordinate_of(self, rank: int, axis: str) -> int:
        """The coordinate on `axis` of NxD rank `rank`, as the HLO computes it from rank_id."""
        return sum(
            rank // place % d.radix * d.weight
            for d, place in zip(self.digits, self._places(), strict=True)
            if d.axis == axis
        )

    def coordinate_terms(self, axis: str) -> tuple[tuple[int | None, int | None, int], ...]:
        """(divisor, modulus, weight) per digit of `axis`: coordinate = sum of
        (rank / divisor % modulus) * weight; None where the step is the identity (the minor
        digit needs no division, the major one no modulus)."""
        return tuple(
            (
                place if place > 1 else None,
                d.radix if place * d.radix < self.world_size else None,
                d.weight,
            )
            for d, place in zip(self.digits, self._places(), strict=True)
            if d.axis == axis
        )

    def coordinate_formula(self, axis: str) -> str:
        terms = []
        for divisor, modulus, weight in self.coordinate_terms(axis):
            term = (
                RANK_INPUT
                + (f" / {divisor}" if divisor else "")
                + (f" % {modulus}" if modulus else "")
            )
            terms.append(term if weight == 1 else f"({term}) * {weight}")
        return " + ".join(terms)

    def nxd_of_portable(self, rank: int) -> int:
        return self.nxd_rank(coords_of(self.mesh, rank))

    def groups(self, axis: str) -> list[list[int]]:
        """The NxD ranks of every group of a collective over `axis` (each ordered by the
        coordinate on `axis`, groups ordered by their first rank)."""
        others = [a for a in self.mesh.names if a != axis]
        groups = []
        for values in itertools.product(*(range(self.mesh.axis_size(a)) for a in others)):
            coords = dict(zip(others, values, strict=True))
            groups.append(
                [self.nxd_rank({**coords, axis: i}) for i in range(self.mesh.axis_size(axis))]
            )
        return sorted(groups)

    def placement(self, target: NeuronTarget, rank: int) -> dict[str, int]:
        """Where NxD rank `rank` runs: one rank per logical core, cores filling chips, chips
        filling nodes (target.cores_per_chip, target.topology.chips_per_node)."""
        return placement(target, rank)

    def to_json(self, target: NeuronTarget) -> dict[str, Any]:
        ranks = []
        for rank in range(self.world_size):
            coords = coords_of(self.mesh, rank)
            nxd = self.nxd_rank(coords)
            ranks.append(
                {
                    "rank": nxd,
                    "portable_rank": rank,
                    "coords": coords,
                    **self.placement(target, nxd),
                }
            )
        return {
            "world_size": self.world_size,
            "num_replicas": self.world_size,
            "rank_order": self.rank_order,
            "axes": [
                {"axis": a, "role": self.role(a), "size": self.mesh.axis_size(a)}
                for a in self.order
            ],
            "grid": {
                role: math.prod(self.mesh.axis_size(a) for a in self.order if self.role(a) == role)
                for role in ROLES
            },
            "ranks": sorted(ranks, key=lambda r: r["rank"]),
            "nodes": -(-self.world_size // target.cores_per_node),
            "topology": target.topology.to_json(target.cores_per_chip),
            "placement_basis": target.cores_basis,
        }


def placement(target: NeuronTarget, rank: int) -> dict[str, int]:
    """Where rank `rank` runs on `target`'s topology: node, chip in the node, core in the chip."""
    chip, core = divmod(rank, target.cores_per_chip)
    node, chip_in_node = divmod(chip, target.topology.chips_per_node)
    return {"node": node, "chip": chip_in_node, "core": core}


def _trn1_tp4(layout: RankLayout, target: NeuronTarget) -> RankLayout | None:
    """NxD's trn1 layout for TP = 4 (parallel_state.initialize_model_parallel): each TP group is
    4 ranks of one trn1.32xlarge node at stride 8, so rank = pp-block + (d / 8) * 32 + tp * 8 +
    d % 8, d the rank's index over the DP and CP axes (NxD has no CP there: ours is placed as
    DP). None (the contiguous layout stays) unless TP = 4 and each pipeline stage fills whole
    nodes (DP x CP a multiple of 8), as NxD requires."""
    mesh = layout.mesh
    tp = [a for a in layout.order if _ROLE_OF[a] == "TP"]
    if math.prod(mesh.axis_size(a) for a in tp) != 4:
        return None
    lo_size = target.cores_per_node // 4  # 8 data ranks per TP coordinate on one node
    data = [a for a in layout.order if _ROLE_OF[a] in ("DP", "CP")]
    hi: list[Digit] = []
    lo: list[Digit] = []
    need = lo_size
    for a in reversed(data):  # peel the minor lo_size data ranks off the data axes
        size = mesh.axis_size(a)
        if need == 1:
            hi.insert(0, Digit(a, size, 1))
        elif need % size == 0:
            lo.insert(0, Digit(a, size, 1))
            need //= size
        elif size % need == 0:
            hi.insert(0, Digit(a, size // need, need))
            lo.insert(0, Digit(a, need, 1))
            need = 1
        else:
            return None
    if need != 1:
        return None
    pp = [Digit(a, mesh.axis_size(a), 1) for a in layout.order if _ROLE_OF[a] == "PP"]
    tp_digits = [Digit(a, mesh.axis_size(a), 1) for a in tp]
    return RankLayout(
        mesh,
        layout.order,
        tuple(pp + hi + tp_digits + lo),
        "NxD's trn1 TP=4 layout: each TP group is 4 ranks of one node at stride 8 "
        "(rank = pp-block + (d / 8) * 32 + tp * 8 + d % 8, d the DP x CP index)",
    )


# --------------------------------------------------------------------------- rank input


def rank_axes(program_graph: torch.fx.Graph) -> tuple[str, ...]:
    """Mesh axes whose coordinate the program computes from the rank input (local_shard, and
    reduce_scatter with max/min, which slice this rank's chunk), in first-use order. Empty: the
    program takes no rank input."""
    axes: dict[str, None] = {}
    for node in program_graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if name == "portable.local_shard.default" or (
            name == "portable.reduce_scatter.default"
            and bind(node).literal("reduce_op") in ("max", "min")
        ):
            axes.setdefault(bind(node).literal("axis"), None)
    return tuple(axes)


# --------------------------------------------------------------------------- JAX primitive


@functools.cache
def _primitive() -> core.Primitive:
    """`portable_collective`: one stablehlo collective with explicit replica groups (made and
    registered with JAX once)."""
    import numpy as np
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import hlo

    prim = core.Primitive("portable_collective")

    def shape_of(shape, *, kind, groups, reducer, dim, concat_dim):
        shape, n = list(shape), len(groups[0])
        if kind == "all_gather":
            shape[dim] *= n
        elif kind == "reduce_scatter":
            shape[dim] //= n
        elif kind == "all_to_all":
            shape[dim] //= n
            shape[concat_dim] *= n
        return tuple(shape)

    def abstract(x, **params):
        return core.ShapedArray(shape_of(x.shape, **params), x.dtype)

    def lowering(ctx, x, *, kind, groups, reducer, dim, concat_dim):
        (aval_out,) = ctx.avals_out
        out_type = mlir.aval_to_ir_type(ctx.module_context, aval_out)
        groups_array = np.asarray(groups, dtype=np.int64)
        replica_groups = ir.DenseIntElementsAttr.get(groups_array)  # type: ignore[call-overload]  # numpy's stubs: an ndarray is a Buffer on 3.12+ only
        if kind == "all_gather":
            return hlo.AllGatherOp(
                [out_type], [x], all_gather_dim=mlir.i64_attr(dim), replica_groups=replica_groups
            ).results
        if kind == "all_to_all":
            return hlo.AllToAllOp(
                [x],
                split_dimension=mlir.i64_attr(dim),
                concat_dimension=mlir.i64_attr(concat_dim),
                split_count=mlir.i64_attr(len(groups[0])),
                replica_groups=replica_groups,
            ).results
        op: hlo.AllReduceOp | hlo.ReduceScatterOp
        if kind == "all_reduce":
            op = hlo.AllReduceOp([out_type], [x], replica_groups=replica_groups)
        else:
            op = hlo.ReduceScatterOp(
                out_type, x, scatter_dimension=mlir.i64_attr(dim), replica_groups=replica_groups
            )
        scalar = mlir.aval_to_ir_type(ctx.module_context, core.ShapedArray((), aval_out.dtype))
        block = op.regions[0].blocks.append(scalar, scalar)
        with ir.InsertionPoint(block):
            combine = {"sum": hlo.add, "max": hlo.maximum, "min": hlo.minimum}[reducer]
            hlo.return_([combine(*block.arguments)])
        return op.results

    prim.def_abstract_eval(abstract)
    mlir.register_lowering(prim, lowering)
    return prim


class ReplicaGroupCollectives:
    """Lowers the portable collectives of a per-rank program (see the module docstring).

    `rank`: the traced int32 rank input (`with_rank`), needed by local_shard only."""

    def __init__(self, layout: RankLayout, rank: Any = None, emitted: list | None = None) -> None:
        self.layout = layout
        self.rank = rank
        self.emitted: list[dict[str, Any]] = [] if emitted is None else emitted  # per collective

    def with_rank(self, rank: Any) -> ReplicaGroupCollectives:
        """The same collectives (recording into the same list) with the traced rank input."""
        return ReplicaGroupCollectives(self.layout, rank, self.emitted)

    def _bind(
        self,
        x: jax.Array,
        kind: str,
        axis: str,
        group_size: int,
        reducer: str = "sum",
        dim: int = 0,
        concat: int = 0,
    ) -> jax.Array:
        size = self.layout.mesh.axis_size(axis)
        if size != group_size:
            raise PlanError(
                f"{kind} over {axis!r} has group_size {group_size}, the mesh axis has {size}",
                fix="a per-rank program's group_size is its axis's size (a bug in the pass "
                "that wrote it)",
            )
        groups = tuple(tuple(g) for g in self.layout.groups(axis))
        self.emitted.append({"op": kind, "axis": axis, "replica_groups": [list(g) for g in groups]})
        return _primitive().bind(
            x, kind=kind, groups=groups, reducer=reducer, dim=dim, concat_dim=concat
        )

    def all_reduce(self, x, reduce_op, axis, group_size):
        # avg = sum / n (Neuron's collectives reduce with sum, max, min)
        out = self._bind(
            x, "all_reduce", axis, group_size, "sum" if reduce_op == "avg" else reduce_op
        )
        return _divide(out, group_size) if reduce_op == "avg" else out

    def all_gather(self, x, dim, axis, group_size):
        return self._bind(x, "all_gather", axis, group_size, dim=dim)

    def reduce_scatter(self, x, reduce_op, dim, axis, group_size):
        if reduce_op in ("max", "min"):
            return self.local_shard(
                self.all_reduce(x, reduce_op, axis, group_size), dim, axis, group_size
            )
        out = self._bind(x, "reduce_scatter", axis, group_size, "sum", dim=dim)
        return _divide(out, group_size) if reduce_op == "avg" else out

    def all_to_all(self, x, split_dim, concat_dim, axis, group_size):
        return self._bind(x, "all_to_all", axis, group_size, dim=split_dim, concat=concat_dim)

    def local_shard(self, x, dim, axis, group_size):
        # chunk i of x along dim, i = the coordinate on axis computed from rank_id
        # (RankLayout.coordinate_terms); int32 throughout
        import jax
        import numpy as np

        if self.rank is None:
            raise PlanError(
                f"local_shard over {axis!r} needs the rank input, the lowering has none",
                fix="a bug in portable's neuron lowering (rank_axes missed the op): report it",
            )
        i32 = np.int32
        terms = []
        for divisor, modulus, weight in self.layout.coordinate_terms(axis):
            term = self.rank if divisor is None else jax.lax.div(self.rank, i32(divisor))
            term = term if modulus is None else jax.lax.rem(term, i32(modulus))
            terms.append(term if weight == 1 else jax.lax.mul(term, i32(weight)))
        coord = functools.reduce(jax.lax.add, terms)
        size = x.shape[dim] // group_size
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.mul(coord, i32(size)), size, axis=dim)

    def wait(self, x):
        return x


def _divide(x: jax.Array, n: int) -> jax.Array:
    import jax.numpy as jnp

    return x / jnp.asarray(n, x.dtype)
