"""The int64-downcast finding: int64 values proved to fit 32 bits (by their range or their use)
are not reported; values the analysis cannot bound are, and u64 constants beyond 32 bits are
refused."""

from __future__ import annotations

from portable.backends.neuron.findings import Severity
from tests.support.hlo_text import codes as _codes
from tests.support.hlo_text import entry as _entry
from tests.support.hlo_text import findings_of as _findings
from tests.support.hlo_text import hlo_module as _module

# -- int64 values: proved in range, or warned about --------------------------------------------

ADD64 = """%add64 (a: s64[], b: s64[]) -> s64[] {
  %a = s64[] parameter(0)
  %b = s64[] parameter(1)
  ROOT %s = s64[] add(%a, %b)
}
"""


def _int64_warnings(body: str, result: str, params: str) -> set[str]:
    module = _module(_entry(result, body, params), computations=ADD64)
    findings = _findings(module)
    assert _codes(findings) == []
    return {f.instruction for f in findings if f.code == "int64-downcast"}


def test_int64_sum_of_an_unknown_input_warns():
    body = """  %x = s64[1024]{0} parameter(0)
  %zero = s64[] constant(0)
  %sum = s64[] reduce(%x, %zero), dimensions={0}, to_apply=%add64
  ROOT %t = (s64[]) tuple(%sum)"""
    assert _int64_warnings(body, "s64[]", "x: s64[1024]") == {"sum"}


def test_int64_values_bounded_by_static_shapes_are_proved():
    # position counters (iota), cumsum of a 0/1 mask (<= its length), clamp with constant
    # bounds, converts from int32, compares: none can leave 32 bits
    body = """  %m = pred[512]{0} parameter(0)
  %x = s64[512]{0} parameter(1)
  %pos = s64[512]{0} iota(), iota_dimension=0
  %ones = s64[512]{0} convert(%m)
  %zero = s64[] constant(0)
  %cum = s64[512]{0} reduce-window(%ones, %zero), window={size=512 pad=511_0}, to_apply=%add64
  %lo = s64[] constant(-5)
  %hi = s64[] constant(70000)
  %lob = s64[512]{0} broadcast(%lo), dimensions={}
  %hib = s64[512]{0} broadcast(%hi), dimensions={}
  %cl = s64[512]{0} clamp(%lob, %x, %hib)
  %s = s64[512]{0} add(%pos, %cum)
  %t2 = s64[512]{0} add(%s, %cl)
  %count = s64[] reduce(%ones, %zero), dimensions={0}, to_apply=%add64
  ROOT %t = (s64[512]{0}, s64[]) tuple(%t2, %count)"""
    assert _int64_warnings(body, "s64[512], s64[]", "m: pred[512], x: s64[512]") == set()


def test_int64_indices_into_a_table_are_proved_by_their_use():
    # torch's embedding / nll_loss: an unknown int64 token id, negative ids wrapped (+ table
    # size), an ignore_index replaced, then the gather index: only its use bounds it
    body = """  %table = f32[128,8]{1,0} parameter(0)
  %ids = s64[16]{0} parameter(1)
  %zero = s64[] constant(0)
  %zeros = s64[16]{0} broadcast(%zero), dimensions={}
  %neg = pred[16]{0} compare(%ids, %zeros), direction=LT
  %n = s64[] constant(128)
  %ns = s64[16]{0} broadcast(%n), dimensions={}
  %wrapped = s64[16]{0} add(%ids, %ns)
  %ix = s64[16]{0} select(%neg, %wrapped, %ids)
  %ix2 = s64[16,1]{1,0} reshape(%ix)
  %g = f32[16,8]{1,0} gather(%table, %ix2), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
  %twice = s64[16]{0} multiply(%ids, %ids)
  ROOT %t = (f32[16,8]{1,0}, s64[16]{0}) tuple(%g, %twice)"""
    params = "table: f32[128,8], ids: s64[16]"
    # the index chain is proved; the squared ids (an output) are not
    assert _int64_warnings(body, "f32[16,8], s64[16]", params) == {"twice"}


def test_int64_analysis_handles_long_chains_across_calls():
    """3000 dependent int64 adds, then a call: the analysis runs in dependency order, not by
    deep recursion (a recursion limit would fail here)."""
    n = 3000
    lines = [
        "  %x0 = s64[4]{0} iota(), iota_dimension=0",
        "  %one = s64[] constant(1)",
        "  %ones = s64[4]{0} broadcast(%one), dimensions={}",
    ]
    lines += [f"  %x{i} = s64[4]{{0}} add(%x{i - 1}, %ones)" for i in range(1, n)]
    lines += [
        f"  %c = s64[4]{{0}} call(%x{n - 1}), to_apply=%f",
        "  ROOT %t = (s64[4]{0}) tuple(%c)",
    ]
    callee = """%f (a: s64[4]) -> s64[4] {
  %a = s64[4]{0} parameter(0)
  ROOT %n = s64[4]{0} negate(%a)
}
"""
    module = _module(_entry("s64[4]", "\n".join(lines), ""), computations=callee)
    assert _findings(module) == []  # every value within [-3002, 3002]


def test_u64_constants_beyond_32_bits_are_refused():
    body = """  %small = u64[2]{0} constant({1, 4294967295})
  %big = u64[] constant(4294967296)
  %b = u64[2]{0} broadcast(%big), dimensions={}
  %s = u64[2]{0} add(%small, %b)
  ROOT %t = (u64[2]{0}) tuple(%s)"""
    findings = _findings(_module(_entry("u64[2]", body, "")))
    (finding,) = [f for f in findings if f.severity is Severity.ERROR]
    assert finding.code == "u64-constant" and finding.instruction == "big"
    assert finding.ncc == "NCC_ESFH002" and "4294967296" in finding.what
