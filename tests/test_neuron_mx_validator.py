"""The MX custom-call rules of the neuron validator (validate_mx.py) on hand-written HLO: one
offending call per documented rule (NCC_EVRF036..058), each finding with its code, its message
and a fix; a well-formed pair passes."""

from __future__ import annotations

import pytest

from portable.backends.neuron import TARGETS
from portable.backends.neuron.hlo import module_from_proto, proto_from_text
from portable.backends.neuron.validate import validate

Q_CONFIG = '{"block_size":32,"dim":-1,"dtype":"float8_e4m3fn","scale_method":"EMAX"}'
DOT_CONFIG = (
    '{"scaled_dot_backend_config":{"element_dtype":"float8_e4m3fn","lhs_batch_dimensions":[],'
    '"lhs_contracting_dimensions":[1],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":[1]}}'
)


def _quantize(
    *,
    config: str | None = Q_CONFIG,
    x: str = "bf16[8,64]",
    result: str = "(u32[8,16]{1,0}, u8[8,2]{1,0})",
    operands: str = "%x",
) -> str:
    cfg = "" if config is None else f", backend_config={config}"
    return f"""HloModule m
ENTRY %main (x: {x}) -> ({result}) {{
  %x = {x} parameter(0)
  %q = {result} custom-call({operands}), custom_call_target="QuantizeMX"{cfg}
  ROOT %t = ({result}) tuple(%q)
}}"""


def _dot(
    *,
    config: str | None = DOT_CONFIG,
    lhs: str = "u32[8,16]",
    rhs: str = "u32[4,16]",
    result: str = "f32[8,4]",
    operands: str = "%a, %b, %sa, %sb",
) -> str:
    cfg = "" if config is None else f", backend_config={config}"
    return f"""HloModule m
ENTRY %main (a: {lhs}, b: {rhs}, sa: u8[8,2], sb: u8[4,2]) -> ({result}) {{
  %a = {lhs} parameter(0)
  %b = {rhs} parameter(1)
  %sa = u8[8,2] parameter(2)
  %sb = u8[4,2] parameter(3)
  %d = {result} custom-call({operands}), custom_call_target="__op$block_scaled_dot"{cfg}
  ROOT %t = ({result}) tuple(%d)
}}"""


def _mx_findings(text: str, variant: str = "trn3", severity: str = "error"):
    module = module_from_proto(proto_from_text(text))
    found = validate(module, TARGETS[variant])
    return [f for f in found if f.code.startswith("mx-") and f.severity.value == severity]


def _only(text: str):
    (finding,) = _mx_findings(text)
    assert finding.severity.value == "error" and finding.fix
    return finding


def test_well_formed_calls_pass():
    assert _mx_findings(_quantize()) == []
    assert _mx_findings(_dot()) == []
    assert _mx_findings(_dot(config=None)) == []  # every field optional: the last dims contract
    along_rows = _quantize(
        config=Q_CONFIG.replace("-1", "-2"),
        x="f16[64,8]",
        result="(u32[16,8]{1,0}, u8[2,8]{1,0})",
    )
    assert _mx_findings(along_rows) == []


def test_rules_apply_on_trn3_only():
    # on trn2 validate.custom_calls refuses the call itself (mx-target)
    assert [f.code for f in _mx_findings(_quantize(config=None), "trn2")] == ["mx-target"]


# ---------------------------------------------------------------------- QuantizeMX


@pytest.mark.parametrize(
    ("text", "ncc", "words"),
    [
        (_quantize(config=None), "NCC_EVRF036", "backend_config missing"),
        (_quantize(config='"dim=1"'), "NCC_EVRF036", "is not a JSON object"),
        (_quantize(operands="%x, %x"), "NCC_EVRF037", "has 2 operands; it takes exactly 1"),
        (
            _quantize(
                x="bf16[2,8,64]",
                result="(u32[2,8,16]{2,1,0}, u8[2,8,2]{2,1,0})",
                config=Q_CONFIG.replace('"dim":-1', '"dim":0'),
            ),
            "NCC_EVRF038",
            "dim 0 is invalid for a rank-3 input",
        ),
        (_quantize(config=Q_CONFIG.replace("32", "16")), "NCC_EVRF039", "block_size 16"),
        (
            _quantize(config=Q_CONFIG.replace("EMAX", "FLOOR")),
            "NCC_EVRF040",
            "scale_method 'FLOOR'; only \"EMAX\"",
        ),
        (_quantize(x="f32[8,64]"), "NCC_EVRF041", "input is f32; it quantizes BF16 or F16"),
        (
            _quantize(config=Q_CONFIG.replace("float8_e4m3fn", "float8_e2m1fn")),
            "NCC_EVRF042",
            "dtype 'float8_e2m1fn'",
        ),
        (
            _quantize(config=Q_CONFIG.replace(',"dtype":"float8_e4m3fn"', "")),
            "NCC_EVRF042",
            "dtype missing",
        ),
        (
            _quantize(result="(u8[8,64]{1,0}, u8[8,2]{1,0})"),
            "NCC_EVRF042",
            "quantized_data is u8; it must be U32",
        ),
        (
            _quantize(result="(u32[8,32]{1,0}, u8[8,2]{1,0})"),
            "NCC_EVRF042",
            "quantized_data shape [8, 32] for input [8, 64] along dim 1: expected [8, 16]",
        ),
        (_quantize(result="u32[8,16]{1,0}"), "NCC_EVRF057", "it must return a 2-tuple"),
        (
            _quantize(x="bf16[8,66]", result="(u32[8,16]{1,0}, u8[8,2]{1,0})"),
            "NCC_EVRF058",
            "size 66, not divisible by 4 (66 % 4 = 2)",
        ),
    ],
)
def test_quantize_mx_rules(text, ncc, words):
    findings = _mx_findings(text)
    hit = [f for f in findings if f.ncc == ncc]
    assert hit, [f.what for f in findings]
    assert any(words in f.what for f in hit), [f.what for f in hit]
    assert all(f.fix and f.instruction == "q" for f in hit)


def test_quantize_mx_defaults_are_the_documented_ones():
    # dim defaults to 0, block_size to 32, scale_method to "EMAX": for a rank-2 input dim 0 is
    # the second-to-last dim, so a config with only dtype is well formed (data along dim 0)
    config = '{"dtype":"float8_e5m2"}'
    text = _quantize(config=config, x="bf16[64,8]", result="(u32[16,8]{1,0}, u8[2,8]{1,0})")
    assert _mx_findings(text) == []


def test_quantize_mx_partial_block_has_no_documented_code():
    finding = _only(_quantize(x="bf16[8,48]", result="(u32[8,12]{1,0}, u8[8,2]{1,0})"))
    assert finding.ncc is None and "48 % 32 = 16" in finding.what


# ---------------------------------------------------------------------- block-scaled dot


def _cfg(**dims) -> str:
    fields = {"lhs_batch": [], "lhs_contracting": [1], "rhs_batch": [], "rhs_contracting": [1]}
    fields.update(dims)
    inner = ",".join(f'"{k}_dimensions":{v}' for k, v in sorted(fields.items()))
    return '{"scaled_dot_backend_config":{' + inner.replace(" ", "") + "}}"


@pytest.mark.parametrize(
    ("text", "ncc", "words"),
    [
        (_dot(operands="%a, %b, %sa"), "NCC_EVRF043", "has 3 operands; it takes exactly 4"),
        (_dot(lhs="bf16[8,16]"), "NCC_EVRF044", "LHS is bf16; it must be U32"),
        (_dot(result="f16[8,4]"), "NCC_EVRF045", "result is f16; only F32 or BF16"),
        (_dot(lhs="u32[16]", config=_cfg(lhs_contracting=[0])), "NCC_EVRF046", "LHS has rank 1"),
        (_dot(rhs="u32[16]", config=_cfg(rhs_contracting=[0])), "NCC_EVRF047", "RHS has rank 1"),
        (
            _dot(
                lhs="u32[2,8,16]",
                rhs="u32[3,4,16]",
                result="f32[2,8,4]",
                config=_cfg(lhs_batch=[0], rhs_batch=[0], lhs_contracting=[2], rhs_contracting=[2]),
            ),
            "NCC_EVRF048",
            "batch sizes differ: lhs 2, rhs 3",
        ),
        (_dot(config='"{not json"'), "NCC_EVRF049", "is not JSON"),
        (_dot(config=_cfg(lhs_contracting='["x"]')), "NCC_EVRF049", "holds a non-integer"),
        (
            _dot(rhs="u32[4,8]"),
            "NCC_EVRF050",
            "contracting dims differ: lhs dim 1 = 16, rhs dim 1 = 8",
        ),
        (
            _dot(config=_cfg(lhs_batch=[1], rhs_batch=[0])),
            "NCC_EVRF053",
            "lhs contracting dim 1 is also a batch dim [1]",
        ),
        (_dot(config=_cfg(lhs_batch=[5], rhs_batch=[0])), "NCC_EVRF054", "batch dims [5] outside"),
        (_dot(config=_cfg(rhs_contracting=[2])), "NCC_EVRF055", "rhs contracting dim 2 outside"),
    ],
)
def test_block_scaled_dot_rules(text, ncc, words):
    findings = _mx_findings(text)
    hit = [f for f in findings if f.ncc == ncc]
    assert hit, [(f.ncc, f.what) for f in findings]
    assert any(words in f.what for f in hit), [f.what for f in hit]
    assert all(f.fix and f.instruction == "d" for f in hit)


def test_block_scaled_dot_contracts_the_last_dims_by_default():
    # no config: lhs [8, 16] and rhs [16, 4] contract their last dims, 16 vs 4
    finding = _only(_dot(rhs="u32[16,4]", config=None))
    assert finding.ncc == "NCC_EVRF050" and "lhs dim 1 = 16, rhs dim 1 = 4" in finding.what


def test_block_scaled_dot_undocumented_rules_have_no_code():
    (rhs,) = [f for f in _mx_findings(_dot(rhs="bf16[4,16]")) if "RHS" in f.what]
    assert rhs.ncc is None and "must be U32 like the LHS" in rhs.what
    element = _only(_dot(config=DOT_CONFIG.replace("float8_e4m3fn", "float4_e2m1fn")))
    assert element.ncc is None and "element_dtype 'float4_e2m1fn'" in element.what


# ---------------------------------------------------------------------- the assumed layout

CHAIN = f"""HloModule m
ENTRY %main (x: bf16[8,64], w: bf16[4,64]) -> (f32[8,4]) {{
  %x = bf16[8,64] parameter(0)
  %w = bf16[4,64] parameter(1)
  %qx = (u32[8,16]{{1,0}}, u8[8,2]{{1,0}}) custom-call(%x), custom_call_target="QuantizeMX", backend_config={Q_CONFIG}
  %qw = (u32[4,16]{{1,0}}, u8[SCALES]{{1,0}}) custom-call(%w), custom_call_target="QuantizeMX", backend_config={Q_CONFIG}
  %a = u32[8,16] get-tuple-element(%qx), index=0
  %b = u32[4,16] get-tuple-element(%qw), index=0
  %sa = u8[8,2] get-tuple-element(%qx), index=1
  %sb = u8[SCALES] get-tuple-element(%qw), index=1
  %d = f32[8,4] custom-call(%a, %b, %sa, OPERAND), custom_call_target="__op$block_scaled_dot", backend_config={DOT_CONFIG}
  ROOT %t = (f32[8,4]) tuple(%d)
}}"""


def test_a_quantize_dot_chain_in_the_assumed_layout_has_no_findings():
    text = CHAIN.replace("SCALES", "4,2").replace("OPERAND", "%sb")
    assert _mx_findings(text) == _mx_findings(text, severity="warning") == []


def test_departures_from_the_assumed_layout_are_warnings():
    scales = _mx_findings(
        CHAIN.replace("SCALES", "4,4").replace("OPERAND", "%sb"), "trn3", "warning"
    )
    assert [f.instruction for f in scales] == ["qw"] and "expected u8[4, 2]" in scales[0].what
    (fed,) = _mx_findings(
        CHAIN.replace("SCALES", "4,2").replace("OPERAND", "%sa"), "trn3", "warning"
    )
    assert fed.ncc is None and "rhs_scale (sa) is the scales of qx, its data of qw" in fed.what
