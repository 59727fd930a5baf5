"""The spmd rules and localize rebuild calls with arguments replaced by schema name
(`portable.ir.rewriter.replaced_args`), where the call passes them."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

import portable  # noqa: F401  (defines the portable:: ops)
from portable.errors import PortableError
from portable.ir.rewriter import Rewriter, replaced_args

aten = torch.ops.aten


def _call(target, args, kwargs=None) -> torch.fx.Node:
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    resolve = {"x": x, "y": y}
    args = tuple(resolve.get(a, a) if isinstance(a, str) else a for a in args)
    kwargs = {k: resolve.get(v, v) if isinstance(v, str) else v for k, v in (kwargs or {}).items()}
    return graph.call_function(target, args, kwargs)


def test_replaced_args_keep_positions_and_keywords():
    view = _call(aten.view.default, ("x", [4, 8]))
    args, kwargs = replaced_args(view, {"size": [2, 8]})
    assert args[1] == [2, 8] and kwargs == {}
    assert view.args[1] == [4, 8], "the node itself is unchanged"
    sliced = _call(aten.slice.Tensor, ("x",), {"dim": 1})
    args, kwargs = replaced_args(sliced, {"dim": 0, "start": 2})
    assert len(args) == 1 and kwargs == {"dim": 0, "start": 2}
    att = _call(torch.ops.portable.attention.default, ("x", "x", "x"), {"mask": "y"})
    args, kwargs = replaced_args(att, {"v": "v2", "mask": None, "is_causal": True})
    assert args[2] == "v2" and kwargs == {"mask": None, "is_causal": True}


def test_replaced_args_need_an_op_schema():
    getitem = _call(operator.getitem, ("x", 0))
    with pytest.raises(PortableError, match="getitem.*no op schema"):
        replaced_args(getitem, {"index": 1})


def test_nodes_made_mid_pass_carry_no_fake_value():
    # spmd-partition inserts per-rank collectives into a graph of global shapes: no value yet
    x = _call(aten.neg.default, ("x",))
    x.meta["source"] = "here"
    new = Rewriter(x.graph).call(aten.neg.default, (x,), like=x, fake="none", name=None)
    assert "val" not in new.meta and "tensor" not in new.meta
    assert new.meta["source"] == "here" and new.name == "neg_default_1"  # torch.fx naming
