"""Type promotion at capture (portable/capture/promote.py): what eager computes on integer and
bool tensors, a captured program computes too, bit for bit on `cpu` and within the parity
policy on `xla` and `onnx`, with the casts visible in the graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import portable
from portable.testing import check_parity


class _Promoting(torch.nn.Module):
    def forward(self, i: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            torch.sin(i),  # int64 -> float32, as eager
            torch.exp(b),  # bool -> float32
            torch.sigmoid(i) * 2,
            F.softplus(i.float()) + torch.sqrt(i.abs()),
            b + b,  # bool add: logical or
            torch.maximum(b, ~b),
            torch.minimum(b, ~b),
        )


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(-6, 6).reshape(3, 4), torch.tensor([True, False, True, False])


def test_integer_and_bool_operands_promote_as_eager():
    model, inputs = _Promoting(), _inputs()
    program = portable.capture(model, inputs)
    text = program.text()
    assert "aten._to_copy.default(%i, dtype=torch.float32)" in text
    assert "aten.logical_or.default" in text and "aten.logical_and.default" in text
    got = portable.compile(program, backend="cpu")(*inputs)
    want = model(*inputs)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("backend", ["xla", "onnx"])
def test_promoted_programs_agree_on_backends(backend):
    pytest.importorskip("jax" if backend == "xla" else "onnxruntime")
    report = check_parity(portable.capture(_Promoting(), _inputs()), _inputs(), backends=[backend])
    assert report.ok, report.format()


def test_float_inputs_get_no_casts():
    class Sin(torch.nn.Module):
        def forward(self, x):
            return torch.sin(x)

    program = portable.capture(Sin(), (torch.randn(3),))
    assert "_to_copy" not in program.text()


class _BoolNumeric(torch.nn.Module):
    """Numeric ops eager defines on bools (OpInfo's bool samples of them were refused)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor):
        return (
            a < b,
            a >= b,
            a > 0.5,
            a.amax(0),
            a.amin(),
            torch.sign(a),
            torch.clamp_min(a, b),
            torch.clamp_max(a, b),
            a / b,  # float32, inf and NaN where b is False
            a * 0.5,
            a**2,  # int64
            torch.scatter_add(a, 0, index, b),
            torch.heaviside(a, b),
            torch.special.ndtr(a),
        )


def _bools() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(4, 5, generator=g) > 0.5, torch.rand(4, 5, generator=g) > 0.4
    return a, b, torch.randint(0, 4, (4, 5), generator=g)


def test_bool_operands_of_numeric_ops_compute_as_eager():
    model, inputs = _BoolNumeric(), _bools()
    program = portable.capture(model, inputs)
    assert "dtype=torch.int32" in program.text()  # comparisons and max / min on 0 / 1
    got = portable.compile(program, backend="cpu")(*inputs)
    for g, w in zip(got, model(*inputs), strict=True):
        assert g.dtype == w.dtype and torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)), (g, w)
    for backend in ("xla", "onnx"):
        pytest.importorskip("jax" if backend == "xla" else "onnxruntime")
        report = check_parity(program, inputs, backends=[backend])
        assert report.ok, report.format()


def test_bool_running_max_min_and_mode_compute_as_eager():
    class Pairs(torch.nn.Module):
        def forward(self, a: torch.Tensor):
            top, where = torch.cummax(a, 0)
            low = torch.cummin(a, 1)
            common = torch.mode(a, 0)
            return top, where, low.values, low.indices, common.values, common.indices

    model, (a, _, _) = Pairs(), _bools()
    program = portable.capture(model, (a,))
    for backend in ("cpu", "xla"):
        got = portable.compile(program, backend=backend)(a)
        for g, w in zip(got, model(a), strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), backend
