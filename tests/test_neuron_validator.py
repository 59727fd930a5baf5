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
    proto_from_text,
)
from portable.backends.neuron.memory import MemoryEstimate
from portable.backends.neuron.validate import validate
from portable.errors import BackendError

# -- the validator on hand-written HLO ---------------------------------------------------------


def _module(body: str, *, header: str = "HloModule m", computations: str = ""):
    """Parse HLO text with XLA's parser, serialize it, read it back (the validator's path)."""
    return module_from_proto(proto_from_text(f"{header}\n{computations}\n{body}"))


def _entry(result: str, lines: str, params: str = "p: f32[4]") -> str:
    decl = ", ".join(params.split(", "))
    return f"ENTRY %main ({decl}) -> ({result}) {{\n{lines}\n}}"


def _findings(module, variant: str = "trn3", **kw):
    return validate(module, TARGETS[variant], kw.pop("options", None), **kw)


def _codes(findings, severity: Severity = Severity.ERROR) -> list[str]:
    return [f.code for f in findings if f.severity is severity]


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
