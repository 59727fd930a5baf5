"""The neuron offline validator on hand-written HLO: one module per class of input it refuses,
and the messages that name the instruction and the fix."""

from __future__ import annotations

import pytest
import torch

import portable
from portable.backends.neuron import TARGETS, NeuronBackend, NeuronOptions
from portable.backends.neuron.findings import NeuronValidationError, Severity
from portable.backends.neuron.hlo import (
    module_from_proto,
)
from portable.backends.neuron.memory import MemoryEstimate
from portable.errors import BackendError
from tests.support.hlo_text import codes as _codes
from tests.support.hlo_text import entry as _entry
from tests.support.hlo_text import findings_of as _findings
from tests.support.hlo_text import hlo_module as _module

# -- the validator on hand-written HLO ---------------------------------------------------------


CONVERT = """  %p = f32[4]{0} parameter(0)
  %c = {t}[4]{{0}} convert(%p)
  ROOT %t = ({t}[4]{{0}}) tuple(%c)"""


def _convert_to(element: str):
    return _module(_entry(f"{element}[4]", CONVERT.replace("{t}", element).replace("{{0}}", "{0}")))


def test_f64_is_refused_with_its_instruction():
    module = _module(
        _entry(
            "f64[4]",
            """  %p = f64[4]{0} parameter(0)
  %e = f64[4]{0} exponential(%p), metadata={op_name="jit(fn)/exp/exp"}
  ROOT %t = (f64[4]{0}) tuple(%e)""",
            params="p: f64[4]",
        )
    )
    findings = _findings(module, options=NeuronOptions(fp64="error"))
    assert _codes(findings) == ["dtype-f64", "dtype-f64"]
    text = "\n".join(f.render() for f in findings)
    assert "float64 value: no NeuronCore computes in float64" in text
    assert "HLO `e` (exponential)" in text and "fp64='downcast'" in text


def test_conditional_is_refused():
    branches = """%a (x: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  ROOT %n = f32[] negate(%x)
}

%b (y: f32[]) -> f32[] {
  %y = f32[] parameter(0)
  ROOT %c = f32[] copy(%y)
}
"""
    body = """  %p = pred[] parameter(0)
  %v = f32[] parameter(1)
  %r = f32[] conditional(%p, %v, %v), true_computation=%a, false_computation=%b
  ROOT %t = (f32[]) tuple(%r)"""
    module = _module(_entry("f32[]", body, "p: pred[], v: f32[]"), computations=branches)
    (finding,) = _findings(module)
    assert finding.code == "conditional" and finding.instruction == "r"
    assert "torch.where" in finding.fix and finding.ncc == "NCC_EVRF001"


LOOP = """%cond (s: (s32[], f32[])) -> pred[] {
  %s = (s32[], f32[]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[] get-tuple-element(%s), index=1
  %limit = {limit_type}[] constant(10)
  ROOT %lt = pred[] compare(%{compared}, %limit), direction=LT
}

%body (s: (s32[], f32[])) -> (s32[], f32[]) {
  %s = (s32[], f32[]) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[] get-tuple-element(%s), index=1
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  %x2 = f32[] multiply(%x, %x)
  ROOT %t = (s32[], f32[]) tuple(%i2, %x2)
}
"""
WHILE = """  %v = f32[] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[]) tuple(%zero, %v)
  %w = (s32[], f32[]) while(%init), condition=%cond, body=%body
  %r = f32[] get-tuple-element(%w), index=1
  ROOT %t = (f32[]) tuple(%r)"""


def test_while_needs_a_constant_trip_count():
    counted = LOOP.replace("{limit_type}", "s32").replace("{compared}", "i")
    module = _module(_entry("f32[]", WHILE, "v: f32[]"), computations=counted)
    assert _findings(module) == []
    data_dependent = LOOP.replace("{limit_type}", "f32").replace("{compared}", "x")
    module = _module(_entry("f32[]", WHILE, "v: f32[]"), computations=data_dependent)
    (finding,) = _findings(module)
    assert finding.code == "unbounded-while" and finding.instruction == "w"
    assert "constant trip count" in finding.what


def test_while_from_jax_fori_loop_is_accepted():
    import jax
    import jax.numpy as jnp
    from jax._src.lib import xla_client

    def f(x):
        return (jax.lax.fori_loop(0, 5, lambda i, v: v * 2.0, x),)

    lowered = jax.jit(f).lower(jax.ShapeDtypeStruct((4,), jnp.float32))
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(
        lowered.as_text(), use_tuple_args=False, return_tuple=True
    )
    module = module_from_proto(computation.as_serialized_hlo_module_proto())
    assert any(i.opcode == "while" for i in module.instructions())
    assert _codes(_findings(module)) == []


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("xla.sdy.FuncResultSharding", "pre-partitioning HLO"),
        ("Sharding", "pre-partitioning HLO"),
        ("xla_ffi_python_cpu_callback", "host callback"),
        ("__cpu$lapack_sgetrf", "not one of the targets neuronx-cc recognises"),
        # marker names are exact (EHCA005's list), not prefixes
        ("AwsNeuronModuleMarkerStartForward", "not one of the targets"),
        ("NeuronBoundaryMarker-Middle", "not one of the targets"),
    ],
)
def test_custom_calls_outside_the_allow_list_are_refused(target, words):
    body = f"""  %p = f32[4]{{0}} parameter(0)
  %s = f32[4]{{0}} custom-call(%p), custom_call_target="{target}"
  ROOT %t = (f32[4]{{0}}) tuple(%s)"""
    (finding,) = _findings(_module(_entry("f32[4]", body)))
    assert finding.code == "custom-call" and words in finding.what and target in finding.what
    assert finding.instruction == "s" and finding.ncc == "NCC_EHCA005 or NCC_EVRF015"


@pytest.mark.parametrize(
    "target",
    [
        "AwsNeuronSoftmax",
        "AwsNeuronDevicePrint",
        "ResizeNearestGrad",
        "AwsNeuronLNCShardingConstraint",
        "AwsNeuronTransferWithStaticRing",
        "AwsNeuronModuleMarkerStart-Forward",
        "AwsNeuronModuleMarkerStart-Backward",
        "AwsNeuronModuleMarkerEnd-Forward",
        "AwsNeuronModuleMarkerEnd-Backward",
        "NeuronBoundaryMarker-Start",
        "NeuronBoundaryMarker-End",
    ],
)
def test_allow_listed_custom_calls_pass(target):
    body = f"""  %p = f32[4]{{0}} parameter(0)
  %s = f32[4]{{0}} custom-call(%p), custom_call_target="{target}"
  ROOT %t = (f32[4]{{0}}) tuple(%s)"""
    assert _findings(_module(_entry("f32[4]", body))) == []


def test_mx_custom_calls_need_trn3():
    # a well-formed QuantizeMX (its rules: tests/test_neuron_mx_validator.py)
    config = '{"block_size":32,"dim":-1,"dtype":"float8_e4m3fn","scale_method":"EMAX"}'
    body = f"""  %p = bf16[32]{{0}} parameter(0)
  %s = (u32[8]{{0}}, u8[1]{{0}}) custom-call(%p), custom_call_target="QuantizeMX", backend_config={config}
  ROOT %t = ((u32[8]{{0}}, u8[1]{{0}})) tuple(%s)"""
    module = _module(_entry("(u32[8], u8[1])", body, params="p: bf16[32]"))
    assert _findings(module, "trn3") == []
    (finding,) = _findings(module, "trn2")
    assert finding.code == "mx-target" and "Trainium3" in finding.what


@pytest.mark.parametrize(
    ("element", "errors"),
    [
        # FNUZ nowhere (EVRF005); E4M3FN Trn3 and later (EVRF051); E4M3 up to Trn3 (EVRF052),
        # so Trn3 takes both; E5M2 everywhere; E3M4 nowhere (no documented HLO path); raw FP4
        # never; complex64 in a convert (not on the 2.32 list); complex128 never
        ("f8e4m3fnuz", {"trn1", "trn2", "trn3"}),
        ("f8e4m3b11fnuz", {"trn1", "trn2", "trn3"}),
        ("f8e5m2fnuz", {"trn1", "trn2", "trn3"}),
        ("f8e4m3fn", {"trn1", "trn2"}),
        ("f8e4m3", set()),
        ("f8e5m2", set()),
        ("f8e3m4", {"trn1", "trn2", "trn3"}),
        ("f4e2m1fn", {"trn1", "trn2", "trn3"}),
        ("c64", {"trn1", "trn2", "trn3"}),
        ("c128", {"trn1", "trn2", "trn3"}),
    ],
)
def test_number_formats_per_generation(element, errors):
    module = _convert_to(element)
    refused = {v for v in TARGETS if _codes(_findings(module, v))}
    assert refused == errors


def test_fp8_messages_name_the_generation_and_the_fix():
    (fnuz,) = _findings(_convert_to("f8e4m3fnuz"), "trn3")
    assert fnuz.code == "dtype-fp8-fnuz" and "FNUZ" in fnuz.what and fnuz.instruction == "c"
    assert fnuz.ncc == "NCC_EVRF005"
    assert "float8_e4m3fn (max 448), float8_e4m3 (max 240) or float8_e5m2" in fnuz.fix
    (fn,) = _findings(_convert_to("f8e4m3fn"), "trn2")
    assert fn.code == "dtype-fp8" and "not supported on Trn1/Trn2" in fn.what
    assert fn.ncc == "NCC_EVRF051"
    assert fn.fix == (
        "use float8_e4m3 (max 240) or float8_e5m2 on neuron:trn2, or lower for neuron:trn3"
    )
    (e3m4,) = _findings(_convert_to("f8e3m4"), "trn3")
    assert "not a documented HLO input" in e3m4.what and e3m4.ncc is None
    assert e3m4.fix.startswith("use float8_e4m3fn (max 448), float8_e4m3 (max 240) or")
    (fp4,) = _findings(_convert_to("f4e2m1fn"), "trn3")
    assert fp4.code == "dtype-fp4" and "NKI" in fp4.what and fp4.ncc == "NCC_ESPP004"


def test_dynamic_shapes_are_refused():
    body = """  %p = f32[<=4]{0} parameter(0)
  %c = f32[<=4]{0} negate(%p)
  ROOT %t = (f32[<=4]{0}) tuple(%c)"""
    findings = _findings(_module(_entry("f32[<=4]", body, "p: f32[<=4]")))
    assert _codes(findings) == ["dynamic-shape", "dynamic-shape"]
    assert findings[0].ncc == "NCC_EMOD025" and "f32[<=4]" in findings[0].what


def test_variadic_reduce_is_refused():
    region = """%r (a: f32[], b: s32[], c: f32[], d: s32[]) -> (f32[], s32[]) {
  %a = f32[] parameter(0)
  %b = s32[] parameter(1)
  %c = f32[] parameter(2)
  %d = s32[] parameter(3)
  %m = f32[] maximum(%a, %c)
  %i = s32[] minimum(%b, %d)
  ROOT %t = (f32[], s32[]) tuple(%m, %i)
}
"""
    body = """  %p = f32[4]{0} parameter(0)
  %q = s32[4]{0} parameter(1)
  %ninf = f32[] constant(-inf)
  %z = s32[] constant(0)
  %red = (f32[], s32[]) reduce(%p, %q, %ninf, %z), dimensions={0}, to_apply=%r
  %g = s32[] get-tuple-element(%red), index=1
  ROOT %t = (s32[]) tuple(%g)"""
    module = _module(_entry("s32[]", body, "p: f32[4], q: s32[4]"), computations=region)
    (finding,) = _findings(module)
    assert finding.code == "variadic-reduce" and finding.instruction == "red"


MAX = """%mx (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %m = f32[] maximum(%a, %b)
}

%add (a: s32[], b: s32[]) -> s32[] {
  %a = s32[] parameter(0)
  %b = s32[] parameter(1)
  ROOT %s = s32[] add(%a, %b)
}
"""


@pytest.mark.parametrize(
    ("line", "result", "code"),
    [
        (
            "%o = f32[1,4,15,15]{3,2,1,0} convolution(%a, %w), window={size=3x3 pad=2_2x2_2 "
            "lhs_dilate=2x2 rhs_dilate=2x2}, dim_labels=bf01_oi01->bf01",
            "f32[1,4,15,15]",
            "conv-dilation",
        ),
        (
            "%o = f32[1,4,2,2]{3,2,1,0} reduce-window(%a, %ninf), window={size=1x1x2x2 "
            "stride=1x1x4x4 rhs_dilate=1x1x2x2}, to_apply=%mx",
            "f32[1,4,2,2]",
            "reduce-window-dilation",
        ),
        ("%o = u32[] replica-id()", "u32[]", "replica-id"),
        (
            "%o = f32[1,4,8,8]{3,2,1,0} reduce-precision(%a), exponent_bits=5, mantissa_bits=2",
            "f32[1,4,8,8]",
            "reduce-precision",
        ),
        (
            "%o = (u64[2]{0}, u32[4]{0}) rng-bit-generator(%key), algorithm=rng_three_fry",
            "(u64[2], u32[4])",
            "rng-algorithm",
        ),
        (
            "%o = f32[4]{0} map(%v, %v), dimensions={0}, to_apply=%mx",
            "f32[4]",
            "unsupported-opcode",
        ),
        (
            "%o = s32[4]{0} all-reduce(%iv), replica_groups={}, to_apply=%add",
            "s32[4]",
            "collective-groups",
        ),
    ],
)
def test_refused_operations(line, result, code):
    lines = f"""  %a = f32[1,4,8,8]{{3,2,1,0}} parameter(0)
  %w = f32[4,4,3,3]{{3,2,1,0}} parameter(1)
  %ninf = f32[] constant(-inf)
  %key = u64[2]{{0}} constant({{1, 2}})
  %v = f32[4]{{0}} constant({{1, 2, 3, 4}})
  %iv = s32[4]{{0}} constant({{1, 2, 3, 4}})
  {line}
  ROOT %t = ({result}) tuple(%o)"""
    params = "a: f32[1,4,8,8], w: f32[4,4,3,3]"
    module = _module(_entry(result, lines, params), computations=MAX)
    assert code in _codes(_findings(module))


def test_lossy_integer_work_is_a_warning():
    body = """  %p = f32[4]{0} parameter(0)
  %i = s32[4,4]{1,0} constant({{1,2,3,4},{1,2,3,4},{1,2,3,4},{1,2,3,4}})
  %d = s32[4,4]{1,0} dot(%i, %i), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %w = s64[4,4]{1,0} convert(%d)
  %l = s64[4,4]{1,0} multiply(%w, %w)
  %ar = s32[4,4]{1,0} all-reduce(%d), replica_groups={{0}}, to_apply=%add
  %one = s32[] constant(1)
  %ia = s32[1,4,6,6]{3,2,1,0} broadcast(%one), dimensions={}
  %iw = s32[4,4,3,3]{3,2,1,0} broadcast(%one), dimensions={}
  %c = s32[1,4,4,4]{3,2,1,0} convolution(%ia, %iw), window={size=3x3}, dim_labels=bf01_oi01->bf01
  ROOT %t = (s64[4,4]{1,0}, s32[4,4]{1,0}, s32[1,4,4,4]{3,2,1,0}) tuple(%l, %ar, %c)"""
    result = "s64[4,4], s32[4,4], s32[1,4,4,4]"
    findings = _findings(_module(_entry(result, body), computations=MAX))
    assert _codes(findings) == []
    warnings = {(f.code, f.instruction) for f in findings if f.severity is Severity.WARNING}
    assert warnings == {
        ("fp32-accumulation", "d"),
        ("fp32-accumulation", "ar"),
        ("fp32-accumulation", "c"),  # an integer convolution is an integer dot
        ("int64-downcast", "l"),  # s32 x s32 in int64 can exceed 2^31 (`w` alone cannot)
    }
    assert any("exact only below 2^24" in f.what for f in findings)


def _estimate(total_activations: int, budget: int = 16 << 30) -> MemoryEstimate:
    return MemoryEstimate(
        weights_bytes=4 << 30,
        buffers_bytes=0,
        constants_bytes=0,
        optimizer_state_bytes=8 << 30,
        inputs_bytes=0,
        gradients_bytes=4 << 30,
        activations_bytes=total_activations,
        intermediates_bytes=total_activations,
        budget_bytes=budget,
        budget_basis="test",
    )


def test_hbm_budget():
    module = _convert_to("f32")
    (over,) = _findings(module, "trn1", memory=_estimate(1 << 30))
    assert over.severity is Severity.ERROR and over.code == "hbm-budget"
    assert "= 17.00 GiB vs 16 GiB per core on trn1" in over.what
    assert "weights 4.00 + " in over.what and "shard" in over.fix
    (near,) = _findings(module, "trn1", memory=_estimate(0, budget=17 << 30))
    assert near.severity is Severity.WARNING and near.code == "hbm-headroom"
    assert _findings(module, "trn1", memory=_estimate(0, budget=32 << 30)) == []


def test_graph_size_warning():
    module = _convert_to("f32")
    (finding,) = _findings(module, options=NeuronOptions(max_instructions=2))
    assert finding.severity is Severity.WARNING and finding.code == "graph-size"
    assert finding.ncc == "NCC_EVRF007" and "pipeline stages" in finding.fix


def test_validation_error_lists_every_finding(tmp_path):
    class Bad(torch.nn.Module):
        def forward(self, x):
            return (x.double() * 2).float()  # the float64 line

    program = portable.capture(Bad(), (torch.randn(4),))
    backend = NeuronBackend(NeuronOptions(fp64="error"))
    with pytest.raises(NeuronValidationError) as info:
        backend.lower(program, portable.backends.Target("neuron", "trn3"))
    error = info.value
    assert isinstance(error, BackendError)
    assert error.what.startswith("Bad cannot be compiled for neuron:trn3: ")
    assert all(f.code == "dtype-f64" for f in error.findings if f.severity is Severity.ERROR)
    mul = next(f for f in error.findings if f.node == "mul")
    assert (
        mul.source and "test_neuron_validator.py" in mul.source and "the float64 line" in mul.source
    )
    assert "node `mul`" in str(error) and "fp64='downcast'" in str(error)
    assert not (tmp_path / "manifest.json").exists()
