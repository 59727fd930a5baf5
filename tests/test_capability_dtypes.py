"""Capabilities.dtype_gaps: a backend that lowers an op, but not on every dtype the opset
declares, refuses such a node before lowering with a typed error at the user's line that names
the backends that take it."""

from __future__ import annotations

import pytest
import torch

import portable
from portable.backends import Capabilities, registry
from portable.backends.base import takes_op
from portable.backends.cpu import CpuBackend
from portable.errors import LoweringError


class _NoBf16Sin(CpuBackend):
    name = "nobf16"

    def capabilities(self) -> Capabilities:
        base = super().capabilities()
        return Capabilities(
            ops=base.ops,
            program_kinds=base.program_kinds,
            dtype_gaps={"aten.sin.default": {"bfloat16": "no bfloat16 sine kernel"}},
        )


class _Sin(torch.nn.Module):
    def forward(self, x):
        return torch.sin(x) * 2


def test_a_dtype_gap_is_refused_at_the_node_naming_the_backends_that_take_it():
    with registry.temporarily("nobf16", _NoBf16Sin):
        x = torch.randn(4, dtype=torch.bfloat16)
        program = portable.capture(_Sin(), (x,))
        with pytest.raises(LoweringError) as info:
            portable.compile(program, backend="nobf16")
        error = info.value
        assert error.op == "aten.sin.default" and "bfloat16" in str(error)
        assert "test_capability_dtypes.py" in (error.source or "")
        assert "cpu" in (error.fix or "") and "nobf16" not in takes_op(
            "aten.sin.default", "bfloat16"
        )
        # float32 has no gap: the same op lowers and runs
        y = torch.randn(4)
        got = portable.compile(portable.capture(_Sin(), (y,)), backend="nobf16")(y)
        assert torch.equal(got, torch.sin(y) * 2)
