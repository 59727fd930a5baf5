"""`TorchCollectives`: the portable collective ops on torch.distributed process groups.

One process group per (mesh axis, group of that axis), created with `dist.new_group` on every
rank in the same order (axes in mesh order, groups by first rank), so every rank agrees on them.
Collectives are torch's functional collectives (`torch.ops._c10d_functional.*`): each returns at
once with the transfer in flight, and `portable.wait` is where it is waited for
(`_c10d_functional.wait_tensor`), so a pass may place waits late to overlap communication with
compute. Work that a collective needs after its transfer (moving a gathered dim back into place)
happens at the wait.

Layout conventions (the per-rank program contract): "chunk i" is the i-th equal chunk along a
dim, i = the rank's position in its group = its coordinate on the axis; `all_gather` concatenates
along `dim` in that order; `reduce_scatter` leaves chunk i on rank i; `all_to_all` sends chunk j
of `split_dim` to rank j and concatenates what it receives along `concat_dim` in rank order.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ..errors import BackendError, PlanError
from ..ir.plan import Mesh
from ..ir.sharding import coords_of, groups_of
from ..opset.collectives import REDUCE_OPS

__all__ = ["CollectiveError", "TorchCollectives", "collective"]


def _rank() -> str:
    return str(dist.get_rank()) if dist.is_initialized() else os.environ.get("RANK", "?")


def _first_sentence(exc: RuntimeError) -> str:
    """gloo's message without its source location and boilerplate advice."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # [/.../gloo/transport/tcp/pair.cc:537]
    return text.split(". This is typically")[0]


class CollectiveError(BackendError):
    """A collective (or the process group set-up) did not complete on this rank: a peer died,
    hung, or took longer than the timeout to take part. Usually a consequence: the launcher
    looks for the rank that caused it."""


@contextlib.contextmanager
def collective(what: str, timeout: datetime.timedelta | None = None) -> Iterator[None]:
    """Turn torch.distributed's failures inside the block (gloo/nccl `RuntimeError`s: a timeout,
    `Connection closed by peer`) into a CollectiveError saying `what` this rank was doing."""
    try:
        yield
    except RuntimeError as exc:
        first = _first_sentence(exc)
        limit = f" (timeout {timeout.total_seconds():g}s)" if timeout is not None else ""
        raise CollectiveError(
            f"{what} did not complete on rank {_rank()}{limit}: {first}",
            fix="another rank died or hung: the launcher's message names it",
        ) from exc


_fc = torch.ops._c10d_functional
Finish = Callable[[torch.Tensor], torch.Tensor]


class TorchCollectives:
    """The `CollectiveRuntime` of one rank of `mesh` (needs `dist.init_process_group` first).

    Creating it is itself collective: every rank of the job must construct it with the same
    mesh, in the same order relative to its other `new_group` calls. Every collective waits at
    most `timeout` for its peers (torch's default for a new group is 30 minutes with gloo), then
    raises CollectiveError."""

    def __init__(self, mesh: Mesh, timeout: datetime.timedelta | None = None) -> None:
        world = dist.get_world_size()
        if world != mesh.size:
            axes = " x ".join(f"{n}={s}" for n, s in mesh.axes)
            raise PlanError(
                f"torch.distributed has {world} ranks but the mesh ({axes}) has {mesh.size} "
                "positions",
                fix=f"launch {mesh.size} processes or change the mesh",
            )
        self.mesh = mesh
        self.timeout = timeout
        self.rank = dist.get_rank()
        self.coords = coords_of(mesh, self.rank)
        # axis -> (process group name, its ranks) of the group this rank belongs to
        self._groups: dict[str, tuple[str, list[int]]] = {}
        for axis in mesh.names:
            if mesh.axis_size(axis) == 1:
                continue  # a group of one: every collective is the identity, no group needed
            for ranks in groups_of(mesh, axis):
                with collective(f"creating the process group of {axis} {ranks}", timeout):
                    group = dist.new_group(ranks, timeout=timeout)  # every rank calls it
                if self.rank in ranks:
                    self._groups[axis] = (group.group_name, ranks)
        # in-flight results (by tensor identity) -> (result, what `wait` does after the transfer,
        # what the collective is, for messages)
        self._pending: dict[int, tuple[torch.Tensor, Finish, str]] = {}

    # ------------------------------------------------------------------ CollectiveRuntime

    def all_reduce(
        self, x: torch.Tensor, reduce_op: str, axis: str, group_size: int
    ) -> torch.Tensor:
        name = self._group(axis, group_size, reduce_op)
        if name is None:
            return x.clone()
        with self._transfer("all_reduce", axis):
            out = _fc.all_reduce(x.contiguous(), reduce_op, name)
        return self._issue(out, "all_reduce", axis)

    def all_gather(self, x: torch.Tensor, dim: int, axis: str, group_size: int) -> torch.Tensor:
        name = self._group(axis, group_size)
        if name is None:
            return x.clone()
        dim = dim % x.dim()
        # gather along dim 0 of x with `dim` moved first, then move it back
        moved = x.movedim(dim, 0).contiguous()
        with self._transfer("all_gather", axis):
            out = _fc.all_gather_into_tensor(moved, group_size, name)
        return self._issue(out, "all_gather", axis, _move_back(dim))

    def reduce_scatter(
        self, x: torch.Tensor, reduce_op: str, dim: int, axis: str, group_size: int
    ) -> torch.Tensor:
        name = self._group(axis, group_size, reduce_op)
        if name is None:
            return x.clone()
        dim = dim % x.dim()
        _check_divides(x, dim, group_size, "reduce_scatter")
        moved = x.movedim(dim, 0).contiguous()
        with self._transfer("reduce_scatter", axis):
            out = _fc.reduce_scatter_tensor(moved, reduce_op, group_size, name)
        return self._issue(out, "reduce_scatter", axis, _move_back(dim))

    def all_to_all(
        self, x: torch.Tensor, split_dim: int, concat_dim: int, axis: str, group_size: int
    ) -> torch.Tensor:
        name = self._group(axis, group_size)
        if name is None:
            return x.clone()
        split_dim, concat_dim = split_dim % x.dim(), concat_dim % x.dim()
        _check_divides(x, split_dim, group_size, "all_to_all")
        # chunk j of split_dim goes to rank j: with split_dim moved first, equal splits of dim 0
        moved = x.movedim(split_dim, 0).contiguous()
        splits = [moved.shape[0] // group_size] * group_size
        with self._transfer("all_to_all", axis):
            out = _fc.all_to_all_single(moved, splits, splits, name)

        def finish(received: torch.Tensor) -> torch.Tensor:
            # block i of dim 0 came from rank i: put split_dim back, concatenate blocks in order
            blocks = [b.movedim(0, split_dim) for b in received.chunk(group_size, 0)]
            return torch.cat(blocks, dim=concat_dim)

        return self._issue(out, "all_to_all", axis, finish)

    def local_shard(self, x: torch.Tensor, dim: int, axis: str, group_size: int) -> torch.Tensor:
        self._group(axis, group_size)
        dim = dim % x.dim()
        _check_divides(x, dim, group_size, "local_shard")
        size = x.shape[dim] // group_size
        index = self.coords[axis] if group_size > 1 else 0
        return x.narrow(dim, index * size, size).clone(memory_format=torch.contiguous_format)

    def wait(self, x: torch.Tensor) -> torch.Tensor:
        entry = self._pending.pop(id(x), None)
        if entry is None:  # not in flight (a group of one, or waited already)
            return x.clone()
        value, finish, what = entry
        with collective(f"waiting for {what}", self.timeout):
            done = _fc.wait_tensor(value)
        return finish(done)

    # ------------------------------------------------------------------ helpers

    def _issue(
        self, out: torch.Tensor, op: str, axis: str, finish: Finish | None = None
    ) -> torch.Tensor:
        self._pending[id(out)] = (out, finish or _identity, self._describe(op, axis))
        return out

    def _transfer(self, op: str, axis: str) -> contextlib.AbstractContextManager[None]:
        return collective(f"starting {self._describe(op, axis)}", self.timeout)

    def _describe(self, op: str, axis: str) -> str:
        return f"{op} over {axis} (ranks {self._groups[axis][1]})"

    def _group(self, axis: str, group_size: int, reduce_op: str | None = None) -> str | None:
        """The group name of this rank on `axis`, or None for a group of one rank."""
        if reduce_op is not None and reduce_op not in REDUCE_OPS:
            raise BackendError(
                f"unknown reduce op {reduce_op!r}", fix=f"use one of {', '.join(REDUCE_OPS)}"
            )
        size = self.mesh.axis_size(axis)  # PlanError naming the mesh's axes
        if group_size != size:
            raise PlanError(
                f"a collective over {axis} says group_size={group_size}, but the mesh has "
                f"{axis}={size}",
                fix="run the per-rank program on the mesh it was partitioned for",
            )
        return self._groups[axis][0] if size > 1 else None


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _move_back(dim: int) -> Finish:
    def finish(x: torch.Tensor) -> torch.Tensor:
        return x if dim == 0 else x.movedim(0, dim).contiguous()

    return finish


def _check_divides(x: torch.Tensor, dim: int, group_size: int, op: str) -> None:
    if x.shape[dim] % group_size:
        raise BackendError(
            f"{op}: group of {group_size} ranks does not divide dim {dim} ({x.shape[dim]}): "
            f"{x.shape[dim]} % {group_size} = {x.shape[dim] % group_size}",
            op=f"portable.{op}",
        )
