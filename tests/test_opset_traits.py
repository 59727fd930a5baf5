"""Op traits: each trait's ops checked against what the trait claims, where that is checkable."""

from __future__ import annotations

import operator

import pytest
import torch

from portable.opset import TRAITS, has_trait, ops_with, opset_table
from portable.opset import table as t

aten = torch.ops.aten
_X = torch.arange(24.0).reshape(2, 3, 4)

# one call per VIEW op, on a contiguous input
_VIEW_CALLS = {
    "aten.view.default": lambda op: op(_X, [6, 4]),
    "aten._unsafe_view.default": lambda op: op(_X, [4, 6]),
    "aten.reshape.default": lambda op: op(_X, [24]),
    "aten.permute.default": lambda op: op(_X, [2, 0, 1]),
    "aten.transpose.int": lambda op: op(_X, 0, 2),
    "aten.t.default": lambda op: op(
        _X[0],
    ),
    "aten.unsqueeze.default": lambda op: op(_X, 1),
    "aten.squeeze.dim": lambda op: op(_X[:1], 0),
    "aten.squeeze.dims": lambda op: op(_X[:1], [0]),
    "aten.expand.default": lambda op: op(_X[:1], [5, 3, 4]),
    "aten.alias.default": lambda op: op(_X),
    "aten.slice.Tensor": lambda op: op(_X, 2, 1, 3),
    "aten.select.int": lambda op: op(_X, 1, 2),
}


def _base(x: torch.Tensor) -> int:
    return x.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", TRAITS[t.VIEW])
def test_views_alias_their_input_under_the_cpu_kernel(name):
    out = _VIEW_CALLS[name](opset_table()[name].overload)
    assert _base(out) == _base(_X)


def test_reshapes_permutes_and_unit_dims_are_views():
    for trait in (t.RESHAPE, t.PERMUTE, t.UNIT_DIM):
        assert set(TRAITS[trait]) <= set(TRAITS[t.VIEW]), trait


def test_reshapes_keep_row_major_order_and_permutes_reorder_dims():
    for name in TRAITS[t.RESHAPE]:
        out = _VIEW_CALLS[name](opset_table()[name].overload)
        assert torch.equal(out.flatten(), _X.flatten()) and out.shape != _X.shape
    for name in TRAITS[t.PERMUTE]:
        out = _VIEW_CALLS[name](opset_table()[name].overload)
        source = _X[0] if out.dim() == 2 else _X
        assert sorted(out.stride()) == sorted(source.stride()) and not out.is_contiguous()


def test_identities_keep_values_and_casts_change_only_the_dtype():
    for name in TRAITS[t.IDENTITY]:
        assert torch.equal(opset_table()[name].overload(_X), _X)
    for name in TRAITS[t.CAST]:
        out = opset_table()[name].overload(_X, dtype=torch.float16)
        assert out.dtype == torch.float16 and torch.equal(out.float(), _X)


def test_shape_rules_agree_with_the_traits():
    by_trait = {
        t.ELEMENTWISE: {"same", "broadcast"},
        t.REDUCTION: {"reduce", "tuple"},
        t.COLLECTIVE: {"collective"},
        t.SHAPE_PRODUCING: {"scalar"},
        t.MATMUL: {"matmul"},
    }
    for trait, shapes in by_trait.items():
        for name in TRAITS[trait]:
            assert opset_table()[name].shape in shapes, (trait, name)


def test_elementwise_ops_commute_with_a_permutation_of_elements():
    perm = torch.randperm(12)
    x = torch.rand(12) + 0.5
    checked = 0
    for name in TRAITS[t.ELEMENTWISE]:
        op = opset_table()[name].overload
        args = [a.name for a in op._schema.arguments if not a.has_default_value()]
        tensors = [a for a in op._schema.arguments if a.type.isSubtypeOf(torch._C.TensorType.get())]
        if len(args) != 1 or len(tensors) != 1:
            continue  # unary tensor ops only; the others are checked by their shape rule
        if name in ("aten.clamp.default", "aten.clamp.Tensor"):
            continue  # needs a bound
        value = x if "bitwise" not in name and "logical" not in name else x > 1
        # bit for bit, NaN included (asin, acosh, erfinv of values outside their domain)
        torch.testing.assert_close(
            op(value)[perm], op(value[perm]), rtol=0, atol=0, equal_nan=True, msg=name
        )
        checked += 1
    assert checked >= 15


def test_queries():
    assert has_trait(aten.view.default, t.VIEW) and not has_trait(aten.add.Tensor, t.VIEW)
    assert has_trait(operator.mul, t.SHAPE_PRODUCING) and not has_trait(print, t.VIEW)
    assert opset_table()["aten.mm.default"].has(t.MATMUL)
    assert ops_with(t.RESHAPE, t.PERMUTE) == ops_with(t.RESHAPE) | ops_with(t.PERMUTE)
    with pytest.raises(KeyError, match="unknown op trait 'views'"):
        ops_with("views")


def test_every_trait_names_opset_ops_only():
    for trait, names in TRAITS.items():
        assert names and set(names) <= set(opset_table()), trait
        assert all(opset_table()[n].has(trait) for n in names)
