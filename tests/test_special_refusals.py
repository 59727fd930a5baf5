"""The special-function ops a backend refuses, and how: a typed error naming the op and a fix,
never a result that differs from torch's (portable/backends/xla/rules/special.py,
backends/onnx/unsupported.py)."""

from __future__ import annotations

import pytest
import torch

import portable
from portable.backends.neuron.backend import NeuronBackend

pytest.importorskip("jax")


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def test_bfloat16_i0e_is_refused_on_xla_with_a_fix():
    # torch's bfloat16 i0e rounds the elements past its last full SIMD vector in bfloat16
    x = torch.randn(40).bfloat16()
    program = portable.capture(_Call(torch.special.i0e), (x,))
    with pytest.raises(portable.LoweringError) as info:
        portable.compile(program, backend="xla")
    message = str(info.value)
    assert info.value.backend == "xla" and "aten.special_i0e.default" in message
    assert "bfloat16" in message and "fix: compute i0e in float32" in message
    # float32 runs, and matches torch
    x32 = x.float()
    got = portable.compile(portable.capture(_Call(torch.special.i0e), (x32,)), backend="xla")(x32)
    torch.testing.assert_close(got, torch.special.i0e(x32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["xla", "neuron", "onnx"])
def test_zeta_is_refused_by_capability(backend):
    # Hurwitz zeta at q < 0 cancels in float32 where torch sums in double: no backend but cpu
    # and cuda claims it
    x, q = torch.tensor([2.0, 3.0]), torch.tensor([-2.5, 0.5])
    program = portable.capture(_Call(torch.special.zeta), (x, q))
    with pytest.raises(portable.PortableError) as info:
        if backend == "neuron":  # no Trainium here: lowering is where neuron refuses
            NeuronBackend().lower(program, portable.backends.Target("neuron", "trn3"))
        else:
            portable.compile(program, backend=backend)
    assert "aten.special_zeta.default" in str(info.value)
    assert "cpu" in str(info.value)


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda x: torch.polygamma(2, x), "aten.polygamma.default"),
        (torch.special.erfcx, "aten.special_erfcx.default"),
        (lambda x: torch.special.chebyshev_polynomial_t(x, torch.tensor(3.0)), "chebyshev"),
        (torch.signbit, "aten.signbit.default"),  # no bit cast: -0.0 and -NaN
    ],
)
def test_onnx_refuses_what_it_has_no_operator_for(fn, op):
    x = torch.rand(4) + 0.5
    program = portable.capture(_Call(fn), (x,))
    with pytest.raises(portable.PortableError) as info:
        portable.compile(program, backend="onnx")
    assert op in str(info.value) and "xla" in str(info.value)


def test_onnx_angle_keeps_nan_and_signed_zero():
    pytest.importorskip("onnxruntime")
    x = torch.tensor([-0.0, 0.0, float("nan"), -1.0, float("-inf"), 2.0])
    program = portable.capture(_Call(torch.angle), (x,))
    got = portable.compile(program, backend="onnx")(x)
    torch.testing.assert_close(got, torch.angle(x), rtol=0, atol=0, equal_nan=True)
