"""Declared symbolic dims: captured, verified, archived, checked at run time."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import portable


def test_gpt_dynamic_batch_and_sequence(example_spec, tmp_path):
    spec = example_spec("gpt")
    model = spec.build().eval()
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=31)
    program = portable.capture(model, spec.inputs(), dynamic_shapes=({0: batch, 1: seq},))
    symbols = program.metadata["symbolic_dims"]
    assert sorted((d["min"], d["max"]) for d in symbols.values()) == [(1, 8), (2, 31)]
    assert {d["source"] for d in symbols.values()} == {"idx.shape[0]", "idx.shape[1]"}
    program = portable.load(program.save(tmp_path / "dyn.portable"))
    run = portable.compile(program)
    for shape in [(1, 5), (3, 17), (8, 31)]:
        idx = torch.randint(0, 128, shape)
        with torch.no_grad():
            # not bit-identical: with symbolic sizes torch picks other matmul decompositions
            torch.testing.assert_close(run(idx), model(idx), rtol=1e-5, atol=1e-6)
    with pytest.raises(portable.InputError, match=r"outside its declared range \[2, 31\]"):
        run(torch.randint(0, 128, (2, 40)))


def test_undeclared_symbol_is_refused(example_spec):
    program = portable.capture_spec(example_spec("mlp"))
    node = next(n for n in program.graph.nodes if n.op == "call_function")
    spec = node.meta["tensor"]
    node.meta["tensor"] = portable.ir.TensorSpec(("n", *spec.shape[1:]), spec.dtype)
    with pytest.raises(portable.VerifyError, match="undeclared symbolic dim 'n'"):
        portable.verify(program)
