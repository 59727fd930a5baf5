"""A portable plan's layout as torch DTensors, for DCP checkpoints of sharded state.

`device_mesh(mesh)` is the DeviceMesh of a plan's Mesh (one torch.distributed rank per device,
rank order checked to be portable's `coords_of`: row-major, last axis contiguous).
`to_dtensor(local, sharding, mesh, device_mesh)` wraps this rank's shard as the DTensor that
`sharding` describes: Shard(d) on the mesh dim of each axis splitting tensor dim d, Replicate on
the others. Values partial over an axis, dims split by axes out of the mesh's order and device
meshes of another shape are refused with a CheckpointError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from ..ir.sharding import coords_of

if TYPE_CHECKING:
    from ..ir.plan import Mesh
    from ..ir.sharding import Sharding

__all__ = ["device_mesh", "to_dtensor"]


def device_mesh(mesh: Mesh, device_type: str = "cpu") -> Any:
    """`init_device_mesh` over `mesh`'s axes; checks that its rank order is portable's
    (`coords_of`: row-major, last axis contiguous). Needs torch.distributed initialized."""
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != mesh.size:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
        raise CheckpointError(
            f"a device mesh of {mesh.to_json()} needs {mesh.size} torch.distributed ranks, "
            f"{'torch.distributed is not initialized' if world is None else f'there are {world}'}",
            fix="launch one process per mesh device (portable run --nproc N, torchrun)",
        )
    sizes = tuple(size for _, size in mesh.axes)
    dm = init_device_mesh(device_type, sizes, mesh_dim_names=mesh.names)
    expected = coords_of(mesh, dist.get_rank())
    got = dm.get_coordinate()
    if got is None or list(got) != [expected[a] for a in mesh.names]:
        raise CheckpointError(
            f"rank {dist.get_rank()} is at {got} of the device mesh, portable puts it at "
            f"{expected}",
            fix="report this: DeviceMesh's rank order no longer matches portable's",
        )
    return dm


def to_dtensor(
    local: torch.Tensor, sharding: Sharding, mesh: Mesh, device_mesh: Any
) -> torch.Tensor:
    """The DTensor whose local value on this rank is `local`, laid out as `sharding` says:
    Shard(d) on the mesh dim of each axis splitting tensor dim d, Replicate elsewhere."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if sharding.partial:
        raise CheckpointError(
            f"a value partial over {', '.join(a for a, _ in sharding.partial)} cannot be "
            "checkpointed (its ranks hold addends, not shards)",
            fix="checkpoint state values, which are never partial: reduce it first",
        )
    if sharding.ndim != local.ndim:
        raise CheckpointError(
            f"sharding {sharding} has {sharding.ndim} dims, the value {local.ndim}"
        )
    for dim, axes in enumerate(sharding.dims):
        unknown = [a for a in axes if a not in mesh.names]
        order = [mesh.names.index(a) for a in axes if a in mesh.names]
        if unknown or order != sorted(order):
            raise CheckpointError(
                f"dim {dim} is split by {'+'.join(axes)} (major first), not in the mesh's axis "
                f"order ({', '.join(mesh.names)}): DTensor splits a dim by mesh dims in mesh "
                "order only",
                fix="list the axes that split one dim in the mesh's order in the plan",
            )
    names = tuple(getattr(device_mesh, "mesh_dim_names", None) or ())
    if names != mesh.names or tuple(device_mesh.shape) != tuple(s for _, s in mesh.axes):
        raise CheckpointError(
            f"the device mesh {names} {tuple(device_mesh.shape)} is not {mesh.to_json()}",
            fix="build it with portable.jobs.checkpoint.device_mesh(mesh)",
        )
    placements = [
        Replicate() if (d := sharding.dim_of(a)) is None else Shard(d) for a in mesh.names
    ]
    return DTensor.from_local(local, device_mesh, placements, run_check=False)
