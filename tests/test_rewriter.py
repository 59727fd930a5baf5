"""`Rewriter`: new nodes carry fake value, TensorSpec and source; patterns report match counts."""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from portable.ir.rewriter import NewNode, Pattern, Rewriter
from portable.ir.signature import TensorSpec
from portable.opset import bind

aten = torch.ops.aten


def _graph(with_val: bool = True):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["tensor"] = TensorSpec((2, 3), torch.float32)
    if with_val:
        with FakeTensorMode() as mode:
            x.meta["val"] = mode.from_tensor(torch.empty(2, 3))
    return g, x


def test_call_carries_fake_value_spec_and_source():
    g, x = _graph()
    like = g.call_function(aten.neg.default, (x,))
    like.meta["source"] = "model.py:3"
    r = Rewriter(g)
    t = r.call(aten.t.default, (x,), like=like, before=like)
    assert t.name == "t" and t.next is like
    assert isinstance(t.meta["val"], FakeTensor) and t.meta["val"].shape == (3, 2)
    assert t.meta["tensor"] == TensorSpec((3, 2), torch.float32)
    assert t.meta["source"] == "model.py:3"
    pair = r.call(aten.max.dim, (t, 0))
    item = r.call(operator.getitem, (pair, 1))
    assert item.name == "getitem" and item.meta["tensor"] == TensorSpec((2,), torch.int64)


def test_fake_policies():
    g, x = _graph(with_val=False)
    r = Rewriter(g)
    specs = r.call(aten.permute.default, (x, [1, 0]), fake="specs", source=None, name=None)
    assert specs.meta["tensor"] == TensorSpec((3, 2), torch.float32)
    assert specs.meta["source"] is None and specs.name == "permute_default"
    none = r.call(aten.t.default, (x,), fake="available", tensor=TensorSpec((3, 2), torch.float32))
    assert "val" not in none.meta and none.meta["tensor"].shape == (3, 2)
    meta = r.call(aten.t.default, (x,))  # no fake input: computed on meta tensors
    assert meta.meta["val"].device.type == "meta"


def test_replace_and_erase_dead():
    g, x = _graph()
    r = Rewriter(g)
    a = r.call(aten.neg.default, (x,))
    b = r.call(aten.neg.default, (a,))
    out = g.output(b)
    r.replace(b, x)
    assert out.args == (x,) and b not in g.nodes
    r.erase_dead(a)
    assert [n.op for n in g.nodes] == ["placeholder", "output"]


def _double_neg(node):
    # neg(neg(x)) -> x
    inner = bind(node).self if node.target is aten.neg.default else None
    if isinstance(inner, torch.fx.Node) and inner.target is aten.neg.default:
        return bind(inner).self
    return None


def _neg_to_mul(node):
    # neg(x) -> x * -1
    return (
        NewNode(aten.mul.Tensor, (bind(node).self, -1)) if node.target is aten.neg.default else None
    )


def test_apply_counts_matches_per_pattern_and_reaches_a_fixed_point():
    g, x = _graph()
    r = Rewriter(g)
    n1 = r.call(aten.neg.default, (x,))
    n2 = r.call(aten.neg.default, (n1,))
    n3 = r.call(aten.neg.default, (n2,))
    g.output(n3)
    counts, converged = r.apply((Pattern("double-neg", _double_neg),))
    assert converged and counts == {"double-neg": 1}  # n3 now reads neg(x); n1 is dead
    counts, _ = r.apply((Pattern("double-neg", _double_neg), Pattern("neg", _neg_to_mul)))
    assert counts == {"neg": 1}  # dead n1 is left to dead-code removal
    mul = next(n for n in g.nodes if n.target is aten.mul.Tensor)
    assert mul.name == "mul" and mul.meta["tensor"] == TensorSpec((2, 3), torch.float32)


def test_set_args_replaces_arguments_by_name_where_the_node_holds_them():
    g, x = _graph()
    w = g.placeholder("w")
    mm = g.call_function(aten.addmm.default, (x, x, x), {"beta": 2})
    Rewriter(g).set_args(mm, {"mat2": w, "alpha": 3, "beta": 1})
    assert mm.args == (x, x, w) and mm.kwargs == {"beta": 1, "alpha": 3}
