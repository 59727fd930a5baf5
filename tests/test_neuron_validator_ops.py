"""The neuron validator's rules on windows, shifts, sort comparators and complex64, each with
the NCC code of its documentation page."""

from __future__ import annotations

import pytest
import torch

import portable
from portable.backends.neuron import TARGETS, NeuronBackend, NeuronOptions
from tests.support.hlo_text import codes as _codes
from tests.support.hlo_text import entry as _entry
from tests.support.hlo_text import findings_of as _findings
from tests.support.hlo_text import hlo_module as _module

# -- windows, shifts, sort comparators, complex64 ----------------------------------------------


@pytest.mark.parametrize(
    ("line", "result", "code", "ncc"),
    [
        (  # a strided transposed convolution: stride with input dilation
            "%o = f32[1,4,7,7]{3,2,1,0} convolution(%a, %w), window={size=3x3 stride=2x2 "
            "pad=2_2x2_2 lhs_dilate=2x2}, dim_labels=bf01_oi01->bf01",
            "f32[1,4,7,7]",
            "conv-stride-dilation",
            "NCC_EVRF011",
        ),
        (
            "%o = f32[1,4,15,15]{3,2,1,0} convolution(%a, %w), window={size=3x3 pad=2_2x2_2 "
            "lhs_dilate=2x2 rhs_dilate=2x2}, dim_labels=bf01_oi01->bf01",
            "f32[1,4,15,15]",
            "conv-dilation",
            "NCC_EVRF010",
        ),
        (
            "%o = f32[1,4,15,15]{3,2,1,0} reduce-window(%a, %ninf), window={size=1x1x1x1 "
            "lhs_dilate=1x1x2x2}, to_apply=%mx",
            "f32[1,4,15,15]",
            "reduce-window-dilation",
            "NCC_EVRF017",
        ),
        (
            "%o = f32[1,4,2,2]{3,2,1,0} reduce-window(%a, %ninf), window={size=1x1x2x2 "
            "stride=1x1x4x4 rhs_dilate=1x1x2x2}, to_apply=%mx",
            "f32[1,4,2,2]",
            "reduce-window-dilation",
            "NCC_EVRF018",
        ),
        (  # max and argmax pooling in one reduce-window: 4 operands
            "%o = (f32[1,4,4,4]{3,2,1,0}, s32[1,4,4,4]{3,2,1,0}) reduce-window(%a, %ia, %ninf, "
            "%izero), window={size=1x1x2x2 stride=1x1x2x2}, to_apply=%mxi",
            "(f32[1,4,4,4], s32[1,4,4,4])",
            "variadic-reduce-window",
            "NCC_EVRF019",
        ),
        (
            "%o = s16[4]{0} shift-right-arithmetic(%h, %h)",
            "s16[4]",
            "shift-width",
            "NCC_EVRF022",
        ),
        (
            "%o = s64[4]{0} shift-right-arithmetic(%l, %l)",
            "s64[4]",
            "shift-width",
            "NCC_EVRF022",
        ),
    ],
)
def test_window_and_shift_rules_cite_their_codes(line, result, code, ncc):
    regions = """%mx (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%mxi (a: f32[], i: s32[], b: f32[], j: s32[]) -> (f32[], s32[]) {
  %a = f32[] parameter(0)
  %i = s32[] parameter(1)
  %b = f32[] parameter(2)
  %j = s32[] parameter(3)
  %ge = pred[] compare(%a, %b), direction=GE
  %m = f32[] select(%ge, %a, %b)
  %k = s32[] select(%ge, %i, %j)
  ROOT %t = (f32[], s32[]) tuple(%m, %k)
}
"""
    lines = f"""  %a = f32[1,4,8,8]{{3,2,1,0}} parameter(0)
  %w = f32[4,4,3,3]{{3,2,1,0}} parameter(1)
  %ninf = f32[] constant(-inf)
  %izero = s32[] constant(0)
  %ia = s32[1,4,8,8]{{3,2,1,0}} iota(), iota_dimension=3
  %h = s16[4]{{0}} constant({{1, 2, 3, 4}})
  %l = s64[4]{{0}} constant({{1, 2, 3, 4}})
  {line}
  ROOT %t = ({result}) tuple(%o)"""
    params = "a: f32[1,4,8,8], w: f32[4,4,3,3]"
    findings = _findings(_module(_entry(result, lines, params), computations=regions))
    (finding,) = [f for f in findings if f.code == code]
    assert finding.ncc == ncc and finding.instruction == "o"


def test_window_rules_leave_plain_strides_and_32_bit_shifts_alone():
    body = """  %a = f32[1,4,8,8]{3,2,1,0} parameter(0)
  %w = f32[4,4,3,3]{3,2,1,0} parameter(1)
  %c = f32[1,4,3,3]{3,2,1,0} convolution(%a, %w), window={size=3x3 stride=2x2}, dim_labels=bf01_oi01->bf01
  %g = f32[1,4,15,15]{3,2,1,0} convolution(%a, %w), window={size=3x3 pad=2_2x2_2 lhs_dilate=2x2}, dim_labels=bf01_oi01->bf01
  %i = s32[4]{0} constant({1, 2, 3, 4})
  %s = s32[4]{0} shift-right-arithmetic(%i, %i)
  ROOT %t = (f32[1,4,3,3]{3,2,1,0}, f32[1,4,15,15]{3,2,1,0}, s32[4]{0}) tuple(%c, %g, %s)"""
    result = "f32[1,4,3,3], f32[1,4,15,15], s32[4]"
    module = _module(_entry(result, body, "a: f32[1,4,8,8], w: f32[4,4,3,3]"))
    assert _findings(module) == []


SORT = """%cmp (a: f32[], b: f32[], i: s32[], j: s32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  %i = s32[] parameter(2)
  %j = s32[] parameter(3)
  {body}
}
"""


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ("ROOT %lt = pred[] compare(%a, %b), direction=LT", False),
        ("ROOT %ge = pred[] compare(%a, %b), direction=GE, type=TOTALORDER", False),
        ("ROOT %ne = pred[] compare(%a, %b), direction=NE", True),
        (  # two sort keys: lexicographic (a, i)
            """%lt = pred[] compare(%a, %b), direction=LT
  %eq = pred[] compare(%a, %b), direction=EQ
  %ilt = pred[] compare(%i, %j), direction=LT
  %both = pred[] and(%eq, %ilt)
  ROOT %or = pred[] or(%lt, %both)""",
            True,
        ),
    ],
)
def test_sort_comparators(body, refused):
    entry = """  %p = f32[8]{0} parameter(0)
  %ix = s32[8]{0} iota(), iota_dimension=0
  %s = (f32[8]{0}, s32[8]{0}) sort(%p, %ix), dimensions={0}, is_stable=true, to_apply=%cmp
  %k = s32[8]{0} get-tuple-element(%s), index=1
  ROOT %t = (s32[8]{0}) tuple(%k)"""
    module = _module(
        _entry("s32[8]", entry, "p: f32[8]"), computations=SORT.replace("{body}", body)
    )
    findings = _findings(module)
    assert bool(_codes(findings)) == refused
    if refused:
        (finding,) = findings
        assert finding.code == "sort-comparator" and "one key" in finding.fix


def test_torch_sort_argsort_topk_validate_on_every_target():
    """portable's own rules (one-key stable sort of (key, iota), JAX's TOTALORDER comparator)."""

    class Sorts(torch.nn.Module):
        def forward(self, x):
            values, index = torch.sort(x, dim=-1, descending=True)
            top, top_index = torch.topk(x, 3)
            return values, index, torch.argsort(x, dim=0), top, top_index

    program = portable.capture(Sorts(), (torch.randn(4, 8),))
    for variant in TARGETS:
        lowered = NeuronBackend().lower(program, portable.backends.Target("neuron", variant))
        (record,) = lowered.payload.programs
        assert any(i.opcode == "sort" for i in record.module.instructions())
        assert not any(f.code == "sort-comparator" for f in record.findings)


def test_complex64_only_on_the_documented_ops():
    body = """  %re = f32[4]{0} parameter(0)
  %im = f32[4]{0} parameter(1)
  %z = c64[4]{0} complex(%re, %im)
  %e = c64[4]{0} exponential(%z)
  %m = c64[4]{0} multiply(%e, %z)
  %a = f32[4]{0} abs(%m)
  %bad = c64[4]{0} cbrt(%m)
  %out = f32[4]{0} real(%bad)
  %wide = c128[4]{0} convert(%z)
  %w = f64[4]{0} real(%wide)
  %n = f32[4]{0} convert(%w)
  ROOT %t = (f32[4]{0}, f32[4]{0}, f32[4]{0}) tuple(%a, %out, %n)"""
    module = _module(_entry("f32[4], f32[4], f32[4]", body, "re: f32[4], im: f32[4]"))
    findings = _findings(module, options=NeuronOptions(fp64="downcast"))
    complex_ = {f.instruction: f for f in findings if f.code == "dtype-complex"}
    # c64 in complex / exponential / multiply / abs / real: on the 2.32 list
    assert set(complex_) == {"bad", "wide"}  # (c128 is reported where it is made)
    assert "complex64 in `cbrt`" in complex_["bad"].what and "dynamic-update-slice" in (
        complex_["bad"].what
    )
    wide = [f.what for f in findings if f.instruction == "wide"]
    assert any("complex128" in w for w in wide) and complex_["wide"].ncc == "NCC_EVRF004"
