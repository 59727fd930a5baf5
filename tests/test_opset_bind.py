"""`bind(node)`: a call node's arguments by schema name, defaults filled, Node vs literal typed."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

import portable.opset  # noqa: F401  (registers portable:: ops)
from portable.opset import OperandError, bind

aten = torch.ops.aten


def _graph():
    g = torch.fx.Graph()
    return g, g.placeholder("x"), g.placeholder("w")


def test_positional_keyword_and_default_arguments_bind_by_name():
    g, x, w = _graph()
    node = g.call_function(aten.addmm.default, (x, x, w), {"alpha": 2})
    bound = bind(node)
    assert list(bound) == ["self", "mat1", "mat2", "beta", "alpha"]
    assert bound.self is x and bound["mat2"] is w
    assert bound.alpha == 2 and bound.beta == 1  # keyword given, default filled
    assert bound.get("bias") is None and "bias" not in bound and "beta" in bound


def test_node_and_literal_accessors_refuse_the_other_kind():
    g, x, _ = _graph()
    node = g.call_function(aten.sum.dim_IntList, (x, [1]))
    bound = bind(node)
    assert bound.node("self") is x and bound.literal("dim") == [1]
    with pytest.raises(OperandError, match="argument dim is the literal \\[1\\]"):
        bound.node("dim")
    with pytest.raises(OperandError, match="argument self is the node x"):
        bound.literal("self")
    with pytest.raises(OperandError, match="has no argument 'weight'; it has self, dim"):
        bound.weight  # noqa: B018
    assert bound.optional_node("dtype") is None


def test_portable_ops_bind_with_their_schema_defaults():
    g, x, w = _graph()
    node = g.call_function(torch.ops.portable.rms_norm.default, (x, [8], w))
    bound = bind(node)
    assert bound.node("weight") is w and bound.literal("normalized_shape") == [8]
    assert "eps" in bound  # declared with a default


def test_getitem_and_size_arithmetic_have_fixed_names():
    g, x, _ = _graph()
    pair = g.call_function(aten.max.dim, (x, 0))
    item = g.call_function(operator.getitem, (pair, 1))
    assert bind(item).node("self") is pair and bind(item).index == 1
    product = g.call_function(operator.mul, (item, 3))
    assert bind(product).a is item and bind(product).b == 3


def test_a_target_without_schema_is_a_typed_error():
    g, x, _ = _graph()
    node = g.call_function(print, (x,))
    with pytest.raises(OperandError, match="no op schema to bind"):
        bind(node)
