"""The pass framework: spec strings, the registry, the manager (history, verification, errors)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import portable
from portable.errors import PassError, RegistryError
from portable.ir.signature import TensorSpec
from portable.ir.source import SourceLoc
from portable.passes import (
    Pass,
    PassManager,
    PassReport,
    PassResult,
    get_pass,
    parse_pass,
    parse_pipeline,
    registry,
)
from portable.passes.canonicalize import PATTERNS, Canonicalize
from portable.passes.dce import DeadCodeElimination
from portable.registry import Registry


class Views(torch.nn.Module):
    """Starts with a view chain, so canonicalize changes it and the first op is a view."""

    def forward(self, x):
        return x.view(6, 4).view(2, 12).reshape(24) * 2, x.transpose(0, 1).transpose(0, 1) * 3


def views_program() -> portable.Program:
    return portable.capture(Views(), (torch.randn(2, 3, 4),))


# ---- spec strings --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Options(Pass):
    """A test-only pass with one option of each supported type."""

    name = "options"
    flag: bool = False
    count: int = 3
    scale: float = 0.5
    label: str = "x"
    pattern: str | None = None

    def apply(self, program):
        return PassResult(program, self.report(False))


@dataclasses.dataclass(frozen=True)
class CorruptMeta(Pass):
    """A test-only bad pass: records a wrong shape on the first op."""

    name = "corrupt-meta"

    def apply(self, program):
        out = program.replace()
        node = next(n for n in out.graph.nodes if n.op == "call_function")
        node.meta["tensor"] = TensorSpec((7, 7), torch.float32)
        return PassResult(out, self.report(True))


@dataclasses.dataclass(frozen=True)
class MutateInput(Pass):
    name = "mutate-input"

    def apply(self, program):
        x = next(n for n in program.graph.nodes if n.op == "call_function")
        x.meta["source"] = SourceLoc(module="mutated")
        return PassResult(program, self.report(False))


@dataclasses.dataclass(frozen=True)
class Crash(Pass):
    name = "crash"

    def apply(self, program):
        raise ZeroDivisionError("boom")


@pytest.fixture
def test_registry() -> Registry:
    reg: Registry = Registry("pass", "portable.tests.no_such_group", {})
    for cls in (Options, CorruptMeta, MutateInput, Crash):
        reg.register(cls.name, cls)
    return reg


@pytest.mark.parametrize(
    "p, text",
    [
        (Options(), "options"),
        (Options(flag=True, count=-2), "options{flag=true,count=-2}"),
        (Options(scale=1e-3, label="a,b{c}=d"), 'options{scale=0.001,label="a,b{c}=d"}'),
        (Options(label='say "hi" \\ bye'), 'options{label="say \\"hi\\" \\\\ bye"}'),
        (Options(label=""), 'options{label=""}'),
        (Options(pattern="none"), 'options{pattern="none"}'),
        (Options(pattern="blocks.0/attn"), "options{pattern=blocks.0/attn}"),
        (Options(scale=float("inf"), count=0), "options{count=0,scale=inf}"),
    ],
)
def test_spec_round_trip(test_registry, p, text):
    assert p.spec() == text
    assert parse_pass(text, test_registry) == p
    assert parse_pass(p.spec(), test_registry) == p


def test_spec_conversions(test_registry):
    p = parse_pass("options{ scale = 2 , count=0x10, pattern=none, flag=false }", test_registry)
    assert p == Options(scale=2.0, count=16, pattern=None, flag=False)
    assert type(p.scale) is float
    assert Options(scale=2) == Options(scale=2.0) and type(Options(scale=2).scale) is float
    for real in (Canonicalize(), Canonicalize(disable="clone, mul-by-one"), DeadCodeElimination()):
        assert parse_pass(real.spec()) == real
    assert get_pass("canonicalize", disable="clone") == Canonicalize(disable="clone")


def test_parse_pipeline(test_registry):
    passes = parse_pipeline('dce, canonicalize{disable="clone,mul-by-one"},dce')
    assert passes == [
        DeadCodeElimination(),
        Canonicalize(disable="clone,mul-by-one"),
        DeadCodeElimination(),
    ]
    assert parse_pipeline("") == []
    assert parse_pipeline('options{label="a,b",count=1},crash', test_registry) == [
        Options(label="a,b", count=1),
        Crash(),
    ]


def test_unknown_pass_message():
    with pytest.raises(RegistryError) as info:
        parse_pass("canonicalise{disable=clone}")
    assert (
        str(info.value)
        == "unknown pass 'canonicalise'\n  fix: use one of: canonicalize, comm-overlap, dce, mx-quantize, remat, softmax-fusion, spmd-partition"
    )
    with pytest.raises(RegistryError, match="unknown pass 'nope'"):
        get_pass("nope")


def test_unknown_option_message(test_registry):
    with pytest.raises(PassError) as info:
        parse_pass("options{colour=red}", test_registry)
    assert info.value.pass_name == "options"
    assert str(info.value) == (
        "pass 'options' has no option 'colour'\n"
        "  fix: options: flag: bool = False, count: int = 3, scale: float = 0.5, label: str = 'x', "
        "pattern: str | None = None"
    )
    with pytest.raises(PassError, match="pass 'dce' has no option 'x'\n  fix: options: none"):
        get_pass("dce", x=1)
    with pytest.raises(PassError, match="canonicalize has no pattern 'clones'"):
        parse_pass("canonicalize{disable=clones}")


@pytest.mark.parametrize(
    "text, message",
    [
        ("options{count=1.5}", "option 'count' of pass 'options' must be int, got '1.5'"),
        ("options{flag=yes}", "option 'flag' of pass 'options' must be true or false, got 'yes'"),
        ("options{scale=big}", "option 'scale' of pass 'options' must be float, got 'big'"),
        ('options{count="3"}', "option 'count' of pass 'options' must be int, got \"3\""),
        ("options{count=1,count=2}", "option 'count' of pass 'options' is given twice"),
        ("options{count}", "option 'count' of pass 'options' has no `=value`"),
        ("options{count=1", "cannot parse pass 'options{count=1'"),
        ('options{label="a}', "unbalanced braces or quotes"),
        ('options{label=a"b"}', "stray quote in option value 'a\"b\"'"),
    ],
)
def test_bad_option_value_messages(test_registry, text, message):
    with pytest.raises(PassError) as info:
        parse_pass(text, test_registry)
    assert message in str(info.value)


def test_option_types_are_checked_in_python():
    with pytest.raises(
        PassError, match=r"option 'disable' of pass 'canonicalize' must be str, got 1 \(int\)"
    ):
        get_pass("canonicalize", disable=1)
    with pytest.raises(PassError, match="option 'count' of pass 'options' must be int, got True"):
        Options(count=True)


# ---- registry --------------------------------------------------------------------------------


def test_registry_names_match_their_objects():
    assert {"dce", "canonicalize"} <= set(registry.names())
    for name in registry.names():
        cls = registry.get(name)
        assert issubclass(cls, Pass) and cls.name == name
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
        assert parse_pass(name) == cls()


def test_pattern_names_are_unique():
    names = [p.name for p in PATTERNS]
    assert len(set(names)) == len(names) and "dead-code" not in names


# ---- manager ---------------------------------------------------------------------------------


def _run(program, pipeline):
    return PassManager(parse_pipeline(pipeline), verify_each=True).run(program)


def test_manager_records_history_and_reports():
    program = views_program()
    out, reports = _run(program, "dce,canonicalize,dce")
    assert out.metadata["passes"] == ["dce", "canonicalize", "dce"]
    assert "passes" not in program.metadata
    assert [r.changed for r in reports] == [False, True, False]
    again, _ = _run(out, 'canonicalize{disable="clone"}')
    assert again.metadata["passes"] == ["dce", "canonicalize", "dce", "canonicalize{disable=clone}"]
    assert out.metadata["passes"] == ["dce", "canonicalize", "dce"]


def test_manager_wraps_invalid_ir(test_registry):
    program = views_program()
    passes = [DeadCodeElimination(), Canonicalize(), parse_pass("corrupt-meta", test_registry)]
    with pytest.raises(PassError) as info:
        PassManager(passes, verify_each=True).run(program)
    err = info.value
    assert err.pass_name == "corrupt-meta" and err.history == ("dce", "canonicalize")
    assert re.match(
        r"pass `corrupt-meta` left invalid IR: node view_\d+ records float32\[7x7\] but", str(err)
    )
    assert "after passes: dce, canonicalize" in str(err)
    assert isinstance(err.__cause__, portable.VerifyError)
    # without verification the manager does not look
    PassManager(passes, verify_each=False).run(program)


def test_manager_wraps_exceptions_and_input_mutation(test_registry):
    program = views_program()
    program.metadata["passes"] = ["canonicalize"]
    with pytest.raises(PassError) as info:
        PassManager([DeadCodeElimination(), Crash()], verify_each=True).run(program)
    assert str(info.value) == (
        "pass `crash` failed: ZeroDivisionError: boom\n  after passes: canonicalize, dce"
    )
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(
        PassError, match="pass `mutate-input` failed: RuntimeError: it mutated its input"
    ):
        PassManager([MutateInput()], verify_each=True).run(program)


def test_report_json_round_trip_shape():
    report = PassReport("canonicalize", {"disable": ""}, True, {"clone": 2}, ["note"])
    assert report.to_json() == {
        "pass": "canonicalize",
        "options": {"disable": ""},
        "changed": True,
        "counts": {"clone": 2},
        "notes": ["note"],
    }
    assert report.summary() == "canonicalize: changed (clone=2)"
    assert report == PassReport("canonicalize", {"disable": ""}, True, {"clone": 2}, ["note"])
