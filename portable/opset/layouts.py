"""Ops whose ATen CPU kernel lays its result out differently from the op's fake (meta) kernel.

A captured graph is traced with fake kernels, and a `view` in it may rely on the layout a fake
kernel gave: e.g. `nn.MultiheadAttention(batch_first=True)` returns a transposed view, so the
backward of an MSE loss on it gets a transposed `mse_loss_backward` result from torch's meta
kernel, and views it; ATen's CPU kernel returns that result row-major, and the view fails at run
time. Executing a program eagerly (the `cpu` backend) therefore copies the results of these ops
into the layout their fake kernels give, when the two differ (values are unchanged).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["FAKE_LAYOUT_OPS", "in_fake_layout"]

aten = torch.ops.aten

# the meta kernel follows an input's layout, the CPU kernel writes row-major (torch 2.13)
FAKE_LAYOUT_OPS = frozenset(
    {
        aten.mse_loss_backward.default,
        aten._log_softmax_backward_data.default,
    }
)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_meta(v) for v in value)
    return value


def _fake(key: Any) -> Any:
    if isinstance(key, tuple) and key[:1] == ("tensor",):
        _, shape, stride, dtype = key
        return torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
    if isinstance(key, tuple):
        return [_fake(k) for k in key]
    return key


@functools.lru_cache(maxsize=512)
def _fake_strides(op: torch._ops.OpOverload, key: tuple) -> tuple[int, ...]:
    """The strides of op's fake result for arguments with these shapes, strides and dtypes."""
    with FakeTensorMode():
        return tuple(op(*(_fake(k) for k in key)).stride())


def _in_fake_layout_call(op: torch._ops.OpOverload) -> Callable[..., torch.Tensor]:
    def call(*args: Any) -> torch.Tensor:
        out = op(*args)
        strides = _fake_strides(op, tuple(_meta(a) for a in args))
        if tuple(out.stride()) == strides:
            return out
        like = torch.empty_strided(out.shape, strides, dtype=out.dtype, device=out.device)
        return like.copy_(out)

    call.__name__ = call.__qualname__ = f"{op.__name__.replace('.', '_')}_in_fake_layout"
    return call


def in_fake_layout(gm: torch.fx.GraphModule) -> int:
    """Make each FAKE_LAYOUT_OPS node of `gm` (a graph to execute, not a program's) return its
    result in the fake kernel's layout; returns how many nodes changed."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in FAKE_LAYOUT_OPS:
            if node.kwargs:
                node.args, node.kwargs = _positional(node), {}
            node.target = _in_fake_layout_call(node.target)
            changed += 1
    if changed:
        gm.recompile()
    return changed


def _positional(node: torch.fx.Node) -> tuple[Any, ...]:
    schema = node.target._schema  # type: ignore[union-attr]
    args = list(node.args)
    for arg in schema.arguments[len(args) :]:
        args.append(node.kwargs.get(arg.name, arg.default_value))
    return tuple(args)
