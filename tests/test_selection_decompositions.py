"""The selection family's capture decompositions (capture/decompositions.py `_EXTRA`): each op
torch keeps whole is spelled with opset ops and runs bit-identical to eager on `cpu`; where the
spelling would not be exact (a strided view reading outside its input, overlapping strided
writes) the op stays whole and capture refuses it by name."""

from __future__ import annotations

import pytest
import torch

import portable


class _Op(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _captured_ops(program) -> set[str]:
    return {str(n.target) for n in program.graph_module.graph.nodes if n.op == "call_function"}


CASES = {
    "view_copy": (lambda x: torch.view_copy(x, [4, 3]), (torch.randn(3, 4),)),
    "permute_copy": (lambda x: torch.permute_copy(x, [2, 0, 1]), (torch.randn(2, 3, 4),)),
    "narrow_copy": (lambda x: torch.narrow_copy(x, 1, -3, 2), (torch.randn(2, 5),)),
    "unbind_copy": (lambda x: torch.unbind_copy(x, 1), (torch.randn(2, 3),)),
    "unfold": (lambda x: x.unfold(1, 3, 2), (torch.randn(2, 8, 3),)),
    "unfold_0d": (lambda x: x.unfold(0, 1, 1), (torch.randn(()),)),
    "as_strided": (lambda x: x.as_strided([3, 2], [1, 3], 2), (torch.randn(4, 3),)),
    "as_strided_scatter": (
        lambda x, y: torch.as_strided_scatter(x, y, [2, 2], [3, 1], 1),
        (torch.randn(4, 3), torch.randn(2, 2)),
    ),
    "put_accumulate": (
        lambda x, s: x.put(torch.tensor([0, -1, 0]), s, accumulate=True),
        (torch.randn(2, 3), torch.randn(3)),
    ),
    "index_reduce_amax": (
        lambda x, s: x.index_reduce(0, torch.tensor([0, 2, 0]), s, "amax", include_self=False),
        (torch.randn(3, 4), torch.randn(3, 4)),
    ),
    "masked_scatter": (
        lambda x, m, s: x.masked_scatter(m, s),
        (torch.randn(3, 4), torch.rand(4) > 0.5, torch.randn(20)),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_decomposed_op_captures_and_matches_eager_bit_for_bit(name):
    fn, inputs = CASES[name]
    program = portable.capture(_Op(fn), inputs)
    got = portable.compile(program, backend="cpu")(*inputs)
    want = fn(*inputs)
    for g, w in zip(
        *((o,) if isinstance(o, torch.Tensor) else o for o in (got, want)), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_masked_scatter_training_step_captures_its_backward():
    x, mask = torch.randn(3, 4), torch.tensor([True, False, True, True])
    source = torch.nn.Parameter(torch.randn(12))

    class Scatter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.source = source

        def forward(self, x):
            return x.masked_scatter(mask, self.source * 2)

    program = portable.capture(
        Scatter(),
        (x,),
        loss_fn=lambda model, x: model(x).sum(),
        optimizer=portable.optim.SGD(lr=0.1),
    )
    assert "aten.masked_scatter_backward.default" not in _captured_ops(program)


@pytest.mark.parametrize(
    "fn, inputs",
    [
        # reads past the input's own elements (into storage a view would share): not x's values
        (lambda x: x.as_strided([2, 2], [1, 5], 0), (torch.randn(2, 3),)),
        # two view elements on one storage element: which write lands is the kernel's order
        (
            lambda x, y: torch.as_strided_scatter(x, y, [2, 2], [1, 1], 0),
            (torch.randn(6), torch.randn(2, 2)),
        ),
    ],
    ids=["as_strided_out_of_range", "as_strided_scatter_overlapping"],
)
def test_inexact_strided_views_stay_whole_and_are_refused(fn, inputs):
    with pytest.raises(portable.PortableError, match="not in the portable opset"):
        portable.capture(_Op(fn), inputs)
