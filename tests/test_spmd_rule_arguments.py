"""The spmd rules read op arguments by schema name: `arg_key` maps a name to the key the walker
finds it under, and localize rebuilds a call with named arguments replaced where they sit."""

from __future__ import annotations

import torch
import torch.fx

import portable  # noqa: F401  (defines the portable:: ops)
from portable.passes.spmd.localize import _call_with
from portable.passes.spmd.rules.base import arg_key

aten = torch.ops.aten


def _call(target, args, kwargs=None) -> torch.fx.Node:
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    resolve = {"x": x, "y": y}
    args = tuple(resolve.get(a, a) if isinstance(a, str) else a for a in args)
    kwargs = {k: resolve.get(v, v) if isinstance(v, str) else v for k, v in (kwargs or {}).items()}
    return graph.call_function(target, args, kwargs)


def test_arg_key_is_the_position_the_keyword_or_none():
    att = _call(torch.ops.portable.attention.default, ("x", "x", "x"), {"mask": "y"})
    assert arg_key(att, "q") == 0
    assert arg_key(att, "v") == 2
    assert arg_key(att, "mask") == "mask"
    assert arg_key(att, "is_causal") is None
    positional = _call(torch.ops.portable.attention.default, ("x", "x", "x", "y"))
    assert arg_key(positional, "mask") == 3


def test_call_with_replaces_arguments_where_the_call_passes_them():
    view = _call(aten.view.default, ("x", [4, 8]))
    args, kwargs = _call_with(view, size=[2, 8])
    assert args[1] == [2, 8] and kwargs == {}
    sliced = _call(aten.slice.Tensor, ("x",), {"dim": 1})
    args, kwargs = _call_with(sliced, dim=0, start=2)
    assert len(args) == 1 and kwargs == {"dim": 0, "start": 2}
