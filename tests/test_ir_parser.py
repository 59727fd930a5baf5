"""`portable.ir.parser`: the printed form of a program reads back as the program.

Every example's inference and training program prints identically after a parse, is the
archive's program less what the text does not hold (module docstring of the parser), verifies,
and runs to the same outputs; malformed text fails with a VerifyError naming its line."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import portable
from portable.errors import VerifyError
from portable.ir.parser import parse_program
from portable.ir.serialize import program_to_json
from portable.opset import OPSET_VERSION
from tests.support import EXAMPLES, load_spec

KINDS = ("inference", "training")


@functools.cache
def _captured(stem: str, kind: str) -> portable.Program:
    return portable.capture_spec(load_spec(stem), training=kind == "training")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stem", EXAMPLES)
def test_examples_print_identically_after_a_parse(stem: str, kind: str) -> None:
    text = _captured(stem, kind).text()
    parsed = parse_program(text)
    assert parsed.text() == text
    portable.verify(parsed)  # shape rules re-derived from the parsed specs


def _without_untexted(doc: Any) -> Any:
    """An archive document less what the text does not carry: metadata, source file and line,
    a training step's phases (the remat pass re-derives them as capture does), the list/tuple
    distinction."""
    if isinstance(doc, dict):
        if set(doc) == {"tuple"}:
            return _without_untexted(doc["tuple"])
        return {
            k: ({"module": v["module"]} if k == "source" and v and "module" in v else
                _without_untexted(v))
            for k, v in doc.items()
            if k not in ("metadata", "phase")
            and not (k == "source" and (not v or "module" not in v))
        }  # fmt: skip
    if isinstance(doc, list):
        return [_without_untexted(v) for v in doc]
    return doc


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stem", ["mlp", "gpt", "moe"])
def test_the_parsed_program_is_the_archived_one(stem: str, kind: str) -> None:
    captured = _captured(stem, kind)
    parsed = parse_program(captured.text())
    assert _without_untexted(program_to_json(parsed)) == _without_untexted(
        program_to_json(captured)
    )


def test_a_parsed_program_runs_as_the_captured_one() -> None:
    captured = _captured("cnn", "inference")
    parsed = parse_program(captured.text(), weights=captured.weights)
    inputs = load_spec("cnn").inputs()
    want = portable.compile(captured, backend="cpu")(*inputs)
    assert torch.equal(portable.compile(parsed, backend="cpu")(*inputs), want)


def test_weights_are_zeros_unless_given_and_metadata_merges() -> None:
    parsed = parse_program(_captured("mlp", "training").text(), metadata={"note": "x"})
    want = {"name": "MLP.train_step", "opset_version": OPSET_VERSION, "note": "x"}
    assert parsed.metadata == want
    weight = parsed.weights["fc1.weight"]
    assert weight.shape == (64, 32) and not weight.any()
    updated = parsed.signature.outputs[1]
    assert (updated.target, updated.aliases) == ("fc1.weight", "p_model_fc1_weight")


def test_comments_blank_lines_and_indentation_are_free() -> None:
    text = """
    # a hand-written program
    program tiny (inference, opset 1.2)

    in  x: user_input float32[2x3]
        %relu = aten.relu.default(%x) : float32[2x3]  # act
    out 0: output = %relu
    """
    parsed = parse_program(text)
    assert parsed.text() == (
        "program tiny (inference, opset 1.2)\n"
        "  in  x: user_input float32[2x3]\n"
        "  %relu = aten.relu.default(%x) : float32[2x3]  # act\n"
        "  out 0: output = %relu\n"
    )


TINY = """\
program tiny (inference, opset 1.2)
  in  p_w: parameter w float32[3x3]
  in  x: user_input float32[2x3]
  %mm = aten.mm.default(%x, %p_w) : float32[2x3]
  out 0: output = %mm
"""
MM = "  %mm = aten.mm.default(%x, %p_w) : float32[2x3]"


@pytest.mark.parametrize(
    ("old", "new", "line", "message"),
    [
        ("program tiny (inference", "prog tiny (inference", 1, "is not a `program"),
        ("(inference,", "(eval,", 1, "program kind 'eval'"),
        ("opset 1.2", "opset 9.0", 1, "opset 9.0 is not readable"),
        ("parameter w", "weight w", 2, "input kind 'weight'"),
        ("float32[3x3]", "float99[3x3]", 2, "unknown dtype 'float99'"),
        ("float32[3x3]", "float32[3xq-]", 2, "dim 'q-' is not an int"),
        ("float32[3x3]", "float32[3x(2)]", 2, "writes a constant"),
        ("in  x:", "in  for:", 3, "is a Python keyword"),
        ("in  x:", "in  p_w:", 3, "%p_w is defined twice"),
        ("aten.mm.default", "aten.mmm.default", 4, "op aten.mmm.default is not in the portable"),
        ("aten.mm.default", "os.system", 4, "op os.system is not in the portable opset"),
        ("(%x, %p_w)", "(%x, %y)", 4, "%y is not defined before this line"),
        ("(%x, %p_w)", "(%x)", 4, "lacks its required argument mat2"),
        ("(%x, %p_w)", "(%x, %p_w, alpha=2)", 4, "keyword argument 'alpha'"),
        ("(%x, %p_w)", "(%x, __import__('os'))", 4, "cannot read the arguments"),
        ("(%x, %p_w)", "(%x, eval)", 4, "cannot read the value 'eval'"),
        ("(%x, %p_w)", "(%x %p_w)", 4, "not separated by `, `"),
        ("(%x, %p_w)", "(%x, [[[[[[[[[1]]]]]]]]])", 4, "nest deeper than 8"),
        ("(%x, %p_w)", "(%x, [1, 2)", 4, "a `[` is not closed"),
        (" : float32[2x3]\n", "\n", 4, "has no ` : META`"),
        ("%mm = aten", "%mm aten", 4, "is not `%name = op(args)"),
        ("out 0: output = %mm", "out 0: result = %mm", 5, "output kind 'result'"),
        ("out 0: output = %mm", "out 0: output = %mm (aliases q)", 5, "which is no input"),
        ("out 0: output = %mm", "", 4, "has no `out` lines"),
        ("out 0: output = %mm", "outs 0", 5, "is not an `in`, `%name = ...` or `out` line"),
        (MM, "  out 0: output = %x\n" + MM, 5, "an `op` line after an `out` line"),
    ],
)
def test_malformed_text_names_its_line(old: str, new: str, line: int, message: str) -> None:
    assert TINY.count(old) == 1
    with pytest.raises(VerifyError) as info:
        parse_program(TINY.replace(old, new))
    assert f"IR text line {line}:" in str(info.value)
    assert message in str(info.value)


def test_an_unknown_op_names_the_closest() -> None:
    with pytest.raises(VerifyError, match=r"fix: closest: aten\.mm\.default"):
        parse_program(TINY.replace("aten.mm.default", "aten.mm.defualt"))


def test_strings_and_devices_read_as_their_schema_says() -> None:
    text = TINY.replace(
        MM,
        "  %all_reduce = portable.all_reduce.default(%x, sum, dp, 2) : float32[2x3]\n"
        "  %mm = aten.mm.default(%all_reduce, %p_w) : float32[2x3]\n"
        "  %full = aten.full.default([2], 1.0, dtype=torch.float32, device=cpu) : float32[2]",
    )
    parsed = parse_program(text)
    nodes = {n.name: n for n in parsed.graph.nodes}
    assert nodes["all_reduce"].args[1:] == ("sum", "dp", 2)
    assert nodes["full"].kwargs == {"dtype": torch.float32, "device": torch.device("cpu")}
    assert parsed.text() == text
    with pytest.raises(VerifyError, match="device 'cuda'"):
        parse_program(text.replace("device=cpu", "device=cuda"))


def test_a_declared_weight_size_allocates_nothing() -> None:
    parsed = parse_program(TINY.replace("w float32[3x3]", "w float32[1000000x1000000]"))
    weight = parsed.weights["w"]
    assert weight.shape == (1000000, 1000000) and weight.untyped_storage().nbytes() == 4


def test_a_symbolic_weight_needs_its_tensor() -> None:
    with pytest.raises(VerifyError, match="has a symbolic shape and no weight"):
        parse_program(TINY.replace("w float32[3x3]", "w float32[s0x3]"))


def test_text_is_a_string() -> None:
    with pytest.raises(VerifyError, match="not a string"):
        parse_program(b"program")  # type: ignore[arg-type]
    with pytest.raises(VerifyError, match="is empty"):
        parse_program("# only a comment\n")


def test_a_placeholder_named_like_a_builtin_keeps_its_name() -> None:
    text = TINY.replace("%x", "%input").replace("in  x:", "in  input:")
    parsed = parse_program(text)
    assert [n.name for n in parsed.graph.nodes][:2] == ["p_w", "input"]
    assert parsed.text() == text
    with pytest.raises(VerifyError, match="collides with a name the graph needs"):
        parse_program(TINY.replace("%mm", "%sum").replace(" = %mm", " = %sum"))
