"""Collective ops of the portable opset.

Each collective names the mesh `axis` it runs over and that axis's `group_size`, so shapes are
known without a process group. Collectives are asynchronous in the IR: their result must pass
through `portable::wait` before use, which lets the comm-overlap pass move waits.

`local_shard` is this rank's chunk of a replicated value (no communication): it needs the rank's
coordinate on the axis, which only a runtime knows.

CPU kernels give the exact single-process semantics (a group of one rank: every collective is the
identity on its input). Groups of more than one rank run under `torch.distributed` or XLA
multi-device: a torch runtime installs itself with `collective_runtime(...)` and the kernels
forward to it (`portable.distributed`); the xla backend maps the ops to JAX collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from ..errors import BackendError
from .library import define

REDUCE_OPS = ("sum", "avg", "max", "min")

define("all_reduce(Tensor x, str reduce_op, str axis, int group_size) -> Tensor")
define("all_gather(Tensor x, int dim, str axis, int group_size) -> Tensor")
define("reduce_scatter(Tensor x, str reduce_op, int dim, str axis, int group_size) -> Tensor")
define("all_to_all(Tensor x, int split_dim, int concat_dim, str axis, int group_size) -> Tensor")
define("local_shard(Tensor x, int dim, str axis, int group_size) -> Tensor")
define("wait(Tensor x) -> Tensor")


class CollectiveRuntime(Protocol):
    """What executes collectives for the kernels below when groups span processes."""

    def all_reduce(self, x: torch.Tensor, reduce_op: str, axis: str, group_size: int) -> Any: ...
    def all_gather(self, x: torch.Tensor, dim: int, axis: str, group_size: int) -> Any: ...
    def reduce_scatter(
        self, x: torch.Tensor, reduce_op: str, dim: int, axis: str, group_size: int
    ) -> Any: ...
    def all_to_all(
        self, x: torch.Tensor, split_dim: int, concat_dim: int, axis: str, group_size: int
    ) -> Any: ...
    def local_shard(self, x: torch.Tensor, dim: int, axis: str, group_size: int) -> Any: ...
    def wait(self, x: torch.Tensor) -> Any: ...


_RUNTIME: list[CollectiveRuntime] = []


@contextlib.contextmanager
def collective_runtime(runtime: CollectiveRuntime) -> Iterator[None]:
    """Route collective kernels to `runtime` (e.g. torch.distributed groups) within the block."""
    _RUNTIME.append(runtime)
    try:
        yield
    finally:
        _RUNTIME.pop()


def _single_rank(op: str, group_size: int, x: torch.Tensor) -> torch.Tensor:
    if group_size != 1:
        raise BackendError(
            f"{op} over a group of {group_size} ranks cannot run in one process",
            op=f"portable.{op}",
            fix="run the per-rank program under torch.distributed (portable run --nproc N) "
            "or on XLA multi-device",
        )
    return x.clone()


@torch.library.register_kernel("portable::all_reduce", ("cpu", "cuda"))
def _all_reduce_cpu(x, reduce_op, axis, group_size):
    if _RUNTIME:
        return _RUNTIME[-1].all_reduce(x, reduce_op, axis, group_size)
    return _single_rank("all_reduce", group_size, x)


@torch.library.register_kernel("portable::all_gather", ("cpu", "cuda"))
def _all_gather_cpu(x, dim, axis, group_size):
    if _RUNTIME:
        return _RUNTIME[-1].all_gather(x, dim, axis, group_size)
    return _single_rank("all_gather", group_size, x)


@torch.library.register_kernel("portable::reduce_scatter", ("cpu", "cuda"))
def _reduce_scatter_cpu(x, reduce_op, dim, axis, group_size):
    if _RUNTIME:
        return _RUNTIME[-1].reduce_scatter(x, reduce_op, dim, axis, group_size)
    return _single_rank("reduce_scatter", group_size, x)


@torch.library.register_kernel("portable::all_to_all", ("cpu", "cuda"))
def _all_to_all_cpu(x, split_dim, concat_dim, axis, group_size):
    if _RUNTIME:
        return _RUNTIME[-1].all_to_all(x, split_dim, concat_dim, axis, group_size)
    return _single_rank("all_to_all", group_size, x)


@torch.library.register_kernel("portable::local_shard", ("cpu", "cuda"))
def _local_shard_cpu(x, dim, axis, group_size):
    if _RUNTIME:
        return _RUNTIME[-1].local_shard(x, dim, axis, group_size)
    return _single_rank("local_shard", group_size, x)


@torch.library.register_kernel("portable::wait", ("cpu", "cuda"))
def _wait_cpu(x):
    if _RUNTIME:
        return _RUNTIME[-1].wait(x)
    return x.clone()


@torch.library.register_fake("portable::all_reduce")
def _all_reduce_fake(x, reduce_op, axis, group_size):
    return torch.empty_like(x)


@torch.library.register_fake("portable::all_gather")
def _all_gather_fake(x, dim, axis, group_size):
    shape = list(x.shape)
    shape[dim] *= group_size
    return x.new_empty(shape)


@torch.library.register_fake("portable::reduce_scatter")
def _reduce_scatter_fake(x, reduce_op, dim, axis, group_size):
    shape = list(x.shape)
    shape[dim] //= group_size
    return x.new_empty(shape)


@torch.library.register_fake("portable::all_to_all")
def _all_to_all_fake(x, split_dim, concat_dim, axis, group_size):
    shape = list(x.shape)
    shape[split_dim] //= group_size
    shape[concat_dim] *= group_size
    return x.new_empty(shape)


@torch.library.register_fake("portable::local_shard")
def _local_shard_fake(x, dim, axis, group_size):
    shape = list(x.shape)
    shape[dim] //= group_size
    return x.new_empty(shape)


@torch.library.register_fake("portable::wait")
def _wait_fake(x):
    return torch.empty_like(x)
