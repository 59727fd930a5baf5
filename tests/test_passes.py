"""Passes: spec strings, the registry, the manager, and what `dce` and `canonicalize` do.

Every pass run here goes through `PassManager(..., verify_each=True)`, so each result is also
checked by the verifier and for not mutating its input. Semantics are checked end to end: the
CPU backend's outputs (inference) or loss and state (training step) are bit-identical before and
after. Golden tests print the IR (`program.text()`) and check it FileCheck-style.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

import portable
from portable.ir.signature import TensorSpec
from portable.ir.source import SourceLoc
from portable.passes import (
    PassManager,
    PassReport,
    PassResult,
    parse_pipeline,
)
from portable.passes.canonicalize import Canonicalize
from portable.passes.dce import DeadCodeElimination
from tests.support import EXAMPLES, filecheck, load_spec

aten = torch.ops.aten
PIPELINES = ["dce", "canonicalize", "canonicalize,dce"]


# ---- helpers ---------------------------------------------------------------------------------


def run_passes(
    program: portable.Program, pipeline: str
) -> tuple[portable.Program, list[PassReport]]:
    before = program.text()
    out, reports = PassManager(parse_pipeline(pipeline), verify_each=True).run(program)
    assert program.text() == before, "the input program was mutated"
    portable.verify(out)
    return out, reports


def outputs(program: portable.Program, inputs: tuple) -> object:
    return portable.compile(program, backend="cpu")(*inputs)


def assert_identical(a: object, b: object) -> None:
    if isinstance(a, portable.StepResult):
        assert isinstance(b, portable.StepResult)
        assert_identical(a.loss, b.loss)
        assert list(a.state) == list(b.state)
        for key in a.state:
            assert_identical(a.state[key], b.state[key])
    elif isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_identical(x, y)
    else:
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.signbit(a), torch.signbit(b)) if a.is_floating_point() else True


def ops(program: portable.Program) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


@functools.cache
def example(stem: str, training: bool) -> tuple[portable.Program, tuple]:
    spec = load_spec(stem)
    program = portable.capture_spec(spec, training=training)
    return program, (spec.batch() if training else spec.inputs())


# ---- models ----------------------------------------------------------------------------------


class Layout(torch.nn.Module):
    """Identity layout changes: a view chain, a transpose pair, composed permutes, x * 1, x / 1."""

    def forward(self, x):
        y = x.view(6, 4).view(2, 12).reshape(24)
        z = x.transpose(0, 1).transpose(0, 1)
        w = x.permute(2, 0, 1).permute(1, 2, 0)
        return y * 2, z * 3, w.clone() * 1, (x / 1).view(2, 3, 4), x.expand(2, 3, 4) - 1


class Mixed(torch.nn.Module):
    """Permutes that compose to a non-identity and rewrites that would change a dtype."""

    def forward(self, x, i):
        p = x.permute(1, 2, 0).transpose(0, 2)
        return p * 2, i * 1.0, i / 1, i * 1, x + 0


def layout_program() -> tuple[portable.Program, tuple]:
    x = torch.randn(2, 3, 4)
    x[0, 0, 0] = -0.0
    return portable.capture(Layout(), (x,)), (x,)


def mixed_program() -> tuple[portable.Program, tuple]:
    inputs = (
        torch.tensor([[[-0.0, 1.5]]]).expand(2, 3, 2).contiguous(),
        torch.arange(6).view(2, 3),
    )
    return portable.capture(Mixed(), inputs), inputs


def training_program() -> tuple[portable.Program, tuple]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    batch = (torch.randn(5, 4), torch.randn(5, 2))
    program = portable.capture(
        model,
        batch,
        loss_fn=lambda m, x, y: F.mse_loss(m(x), y),
        optimizer=portable.optim.SGD(lr=0.1, momentum=0.9),
    )
    return program, batch


def add_node(program: portable.Program, target, args, *, before=None, spec=None) -> torch.fx.Node:
    """Insert an op into `program`'s graph in place, with its meta (for hand-made cases)."""
    graph = program.graph
    anchor = before if before is not None else graph.output_node()
    with graph.inserting_before(anchor):
        node = graph.create_node("call_function", target, args, name=target.__name__.split(".")[0])
    node.meta["tensor"] = spec if spec is not None else args[0].meta["tensor"]
    node.meta["source"] = SourceLoc(module="handmade")
    program.graph_module.recompile()
    return node


# ---- dce and canonicalize on the examples: valid IR, bit-identical results -------------------


@pytest.mark.parametrize("training", [False, True], ids=["inference", "train_step"])
@pytest.mark.parametrize("stem", EXAMPLES)
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_examples_keep_semantics(stem, training, pipeline):
    program, inputs = example(stem, training)
    out, reports = run_passes(program, pipeline)
    assert [r.name for r in reports] == pipeline.split(",")
    assert len(ops(out)) <= len(ops(program))
    assert_identical(outputs(program, inputs), outputs(out, inputs))


@pytest.mark.parametrize("make", [layout_program, mixed_program, training_program])
def test_handwritten_models_keep_semantics(make):
    program, inputs = make()
    out, _ = run_passes(program, "canonicalize,dce")
    assert_identical(outputs(program, inputs), outputs(out, inputs))


def test_canonicalize_shrinks_the_examples():
    """The examples contain view chains and transposed transposes (linear backward)."""
    program, _ = example("gpt", True)
    out, (report,) = run_passes(program, "canonicalize")
    assert report.changed and report.counts["dead-code"] > 0
    assert len(ops(out)) < len(ops(program))
    # clones that fed views became reshapes, so no clone is left
    assert "aten.clone.default" not in ops(out)


# ---- golden text -----------------------------------------------------------------------------


def test_canonicalize_golden_layout():
    program, _ = layout_program()
    filecheck(
        program.text(),
        """
        CHECK: %view = aten.view.default(%x, [6, 4])
        CHECK: aten.view.default(%view, [2, 12])
        CHECK: %transpose = aten.transpose.int(%x, 0, 1)
        CHECK: %transpose_1 = aten.transpose.int(%transpose, 0, 1)
        CHECK: aten.clone.default
        """,
    )
    out, (report,) = run_passes(program, "canonicalize")
    filecheck(
        out.text(),
        """
        CHECK: in  x: user_input float32[2x3x4]
        CHECK-NOT: transpose
        CHECK-NOT: permute
        CHECK: %{{view_\\d+}} = aten.view.default(%x, [24]) : float32[24]  # <root>
        CHECK-NEXT: %mul = aten.mul.Tensor(%{{view_\\d+}}, 2) : float32[24]
        CHECK-NEXT: %mul_1 = aten.mul.Tensor(%x, 3) : float32[2x3x4]
        CHECK-NEXT: %sub = aten.sub.Tensor(%x, 1) : float32[2x3x4]
        CHECK-NEXT: out 0: output = %mul
        CHECK-NEXT: out 1: output = %mul_1
        CHECK-NEXT: out 2: output = %x
        CHECK-NEXT: out 3: output = %x
        CHECK-NEXT: out 4: output = %sub
        """,
    )
    assert report.counts == {
        "identity-reshape": 2,  # view(x / 1, [2, 3, 4]); expand(x, [2, 3, 4])
        "reshape-chain": 2,  # view(view(view(x)))
        "identity-permute": 0,
        "transpose-pair": 1,
        "permute-chain": 1,  # permute(permute(x, [2, 0, 1]), [1, 2, 0]) is the identity
        "view-of-copy": 0,
        "clone": 1,
        "same-dtype-copy": 0,
        "mul-by-one": 1,
        "div-by-one": 1,
        "dead-code": 4,  # view(x, [6, 4]), view(x, [2, 12]), transpose, permute
    }
    assert report.summary() == (
        "canonicalize: changed (identity-reshape=2, reshape-chain=2, transpose-pair=1, "
        "permute-chain=1, clone=1, mul-by-one=1, div-by-one=1, dead-code=4)"
    )


def test_canonicalize_golden_mixed():
    """Composed permutes become one; no rewrite that would change a dtype; x + 0 stays."""
    program, _ = mixed_program()
    out, (report,) = run_passes(program, "canonicalize")
    filecheck(
        out.text(),
        """
        CHECK: %{{permute_\\d+}} = aten.permute.default(%x, [0, 2, 1]) : float32[2x2x3]
        CHECK: aten.mul.Tensor(%i, 1.0) : float32[2x3]
        CHECK: aten.div.Tensor(%i, 1) : float32[2x3]
        CHECK-NOT: aten.mul.Tensor(%i, 1) :
        CHECK: aten.add.Tensor(%x, 0)
        CHECK: out 3: output = %i
        """,
    )
    assert report.counts["permute-chain"] == 1 and report.counts["mul-by-one"] == 1
    assert report.counts["div-by-one"] == 0


def test_canonicalize_same_dtype_copy_and_view_of_copy():
    program, inputs = layout_program()
    x = next(n for n in program.graph.nodes if n.op == "placeholder")
    copy = add_node(program, aten._to_copy.default, (x,))
    copy.kwargs = {"dtype": torch.float32}
    cast = add_node(program, aten._to_copy.default, (x,), spec=TensorSpec((2, 3, 4), torch.float16))
    cast.kwargs = {"dtype": torch.float16}
    perm = add_node(
        program, aten.permute.default, (copy, [1, 0, 2]), spec=TensorSpec((3, 2, 4), torch.float32)
    )
    clone = add_node(program, aten.clone.default, (perm,), spec=perm.meta["tensor"])
    clone.kwargs = {"memory_format": torch.contiguous_format}  # what makes the view valid
    view = add_node(
        program, aten.view.default, (clone, [6, 4]), spec=TensorSpec((6, 4), torch.float32)
    )
    out_node = program.graph.output_node()
    out_node.args = ((*out_node.args[0][:-2], view, cast),)
    program.graph_module.recompile()
    program.signature = dataclasses.replace(
        program.signature,
        outputs=(
            *program.signature.outputs[:-2],
            dataclasses.replace(program.signature.outputs[-2], spec=view.meta["tensor"]),
            dataclasses.replace(program.signature.outputs[-1], spec=cast.meta["tensor"]),
        ),
    )
    portable.verify(program)
    out, (report,) = run_passes(program, "canonicalize")
    filecheck(
        out.text(),
        """
        CHECK: %_to_copy_1 = aten._to_copy.default(%x, dtype=torch.float16) : float16[2x3x4]  # handmade
        CHECK-NOT: clone
        CHECK: %permute_2 = aten.permute.default(%x, [1, 0, 2])
        CHECK-NEXT: %reshape = aten.reshape.default(%permute_2, [6, 4]) : float32[6x4]  # handmade
        """,
    )
    assert report.counts["same-dtype-copy"] == 1 and report.counts["view-of-copy"] == 1
    assert_identical(outputs(program, inputs), outputs(out, inputs))


def test_canonicalize_disable():
    program, _ = layout_program()
    out, (report,) = run_passes(program, 'canonicalize{disable="transpose-pair,permute-chain"}')
    assert "transpose-pair" not in report.counts and "permute-chain" not in report.counts
    filecheck(
        out.text(),
        "CHECK: aten.transpose.int(%x, 0, 1)\nCHECK: aten.transpose.int(%transpose, 0, 1)",
    )


def test_canonicalize_on_canonical_program_is_unchanged():
    program, _ = layout_program()
    once, _ = run_passes(program, "canonicalize")
    twice, (report,) = run_passes(once, "canonicalize")
    assert not report.changed and twice.text() == once.text()
    assert twice.metadata["passes"] == ["canonicalize", "canonicalize"]


# ---- dce -------------------------------------------------------------------------------------


def test_dce_removes_dead_ops():
    program, inputs = layout_program()
    x = next(n for n in program.graph.nodes if n.op == "placeholder")
    neg = add_node(program, aten.neg.default, (x,))
    add_node(program, aten.exp.default, (neg,))  # dead, and makes neg dead transitively
    portable.verify(program)
    filecheck(
        program.text(), "CHECK: %neg = aten.neg.default(%x)\nCHECK: %exp = aten.exp.default(%neg)"
    )
    out, (report,) = run_passes(program, "dce")
    filecheck(
        out.text(),
        "CHECK: in  x\nCHECK-NOT: %neg =\nCHECK-NOT: %exp =\nCHECK: out 0: output = %mul",
    )
    assert report.counts == {"removed": 2} and report.changed
    assert report.to_json() == {
        "pass": "dce",
        "options": {},
        "changed": True,
        "counts": {"removed": 2},
        "notes": [],
    }
    assert report.summary() == "dce: changed (removed=2)"
    assert len(ops(out)) == len(ops(program)) - 2
    assert_identical(outputs(program, inputs), outputs(out, inputs))


def test_dce_keeps_placeholders_and_outputs():
    program, _ = training_program()
    out, (report,) = run_passes(program, "dce")
    assert not report.changed and report.summary() == "dce: unchanged"
    assert out.text() == program.text()
    assert [n.name for n in out.graph.nodes if n.op == "placeholder"] == [
        i.name for i in program.signature.inputs
    ]


def test_pass_does_not_mutate_its_input():
    program, _ = layout_program()
    text, graph_module, weights = program.text(), program.graph_module, dict(program.weights)
    for p in (Canonicalize(), DeadCodeElimination()):
        result = p.apply(program)
        assert isinstance(result, PassResult)
        assert program.text() == text and program.graph_module is graph_module
        assert program.weights == weights and "passes" not in program.metadata


class ViewOfProduct(torch.nn.Module):
    def forward(self, x):
        return (x.expand(2, 3, 4) * 1).view(6, 4)


def test_copy_feeding_a_view_is_kept():
    """x * 1 is dense where expand(x) is not: replacing it would make the view invalid."""
    x = torch.randn(1, 3, 4)
    program = portable.capture(ViewOfProduct(), (x,))
    out, (report,) = run_passes(program, "canonicalize")
    assert report.counts["mul-by-one"] == 0
    filecheck(
        out.text(),
        "CHECK: aten.expand.default\nCHECK-NEXT: aten.mul.Tensor(%expand, 1)\nCHECK-NEXT: aten.view.default",
    )
    assert_identical(outputs(program, (x,)), outputs(out, (x,)))
