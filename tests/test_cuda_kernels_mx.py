"""The Triton MX kernels (backends/cuda/kernels/mx.py) equal `portable.mx` bit for bit, run in
Triton's interpreter: the mx.md vectors, seeded fuzz over formats x rules x axes x dtypes x
shapes, dequantization of every code byte and scale byte, and the plans' shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import portable  # noqa: E402
from portable import mx  # noqa: E402
from portable.backends.cuda.kernels import mx as kmx  # noqa: E402
from portable.backends.cuda.kernels.launch import jit_function  # noqa: E402
from portable.mx.vectors import cases, edge_blocks, fuzz  # noqa: E402
from tests.support.mx_programs import same_bits  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: Inf / NaN on purpose

FORMATS = list(mx.FORMATS)
RULES = list(mx.SCALE_RULES)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (shape, axis): last axis, first axis, a middle axis with inner > 1, a 1-D tensor, and two
# with more blocks than one program takes (kmx.TILE // 32 = 128)
SHAPES = [((3, 64), -1), ((64, 5), 0), ((2, 32, 3), 1), ((96,), 0), ((150, 64), -1),
          ((2, 64, 70), 1)]  # fmt: skip


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def assert_quantize_matches(x, fmt, axis, rule, block_size=32):
    codes, scales = kmx.quantize(x, fmt, axis, rule, block_size)
    want_codes, want_scales = mx.quantize(x, fmt, axis, rule, block_size)
    assert torch.equal(scales, want_scales), (fmt, rule, x.dtype, tuple(x.shape), axis)
    assert torch.equal(codes, want_codes), (fmt, rule, x.dtype, tuple(x.shape), axis)
    return codes, scales


@pytest.mark.parametrize(
    ("vector", "fmt", "rule"),
    cases(),
    ids=lambda v: v.id if isinstance(v, mx.vectors.Vector) else v,
)
def test_mx_md_vector(vector, fmt, rule):
    x = torch.tensor([vector.block()], dtype=torch.float32)
    codes, scales = assert_quantize_matches(x, fmt, -1, rule)
    assert scales.item() == vector.byte
    values = kmx.dequantize(codes, scales, fmt, -1, torch.float32)
    assert same_bits(values, mx.dequantize(codes, scales, fmt, -1, torch.float32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
def test_quantize_fuzz(fmt, rule):
    seed = FORMATS.index(fmt) * 10 + RULES.index(rule)
    for dtype in DTYPES:
        for i, (shape, axis) in enumerate(SHAPES):
            n = torch.Size(shape).numel()
            x = fuzz(seed * 100 + i, n // 32).view(shape).to(dtype)
            codes, scales = assert_quantize_matches(x, fmt, axis, rule)
            values = kmx.dequantize(codes, scales, fmt, axis, dtype)
            assert same_bits(values, mx.dequantize(codes, scales, fmt, axis, dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_rule_thresholds(fmt):
    x = edge_blocks()
    for rule in RULES:
        codes, scales = assert_quantize_matches(x, fmt, -1, rule)
        assert same_bits(kmx.dequantize(codes, scales, fmt, -1), mx.dequantize(codes, scales, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_dequantize_every_code_and_scale_byte(fmt, dtype):
    """All 256 code bytes (special codes, unused high bits) under scale bytes 0 (a subnormal
    scale), 1, 127, 254 (overflow to Inf) and 255 (NaN), along a middle axis."""
    blocks = 256 // 32 if not mx.FORMATS[fmt].packed else 256 // 16
    codes = torch.arange(256, dtype=torch.uint8).view(1, blocks, -1).repeat(5, 1, 1)
    codes = codes.transpose(1, 2).contiguous()  # axis 1 holds the codes of one block
    scales = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8).view(5, 1, 1)
    scales = scales.expand(5, 1, blocks).contiguous()
    got = kmx.dequantize(codes, scales, fmt, 1, dtype)
    assert same_bits(got, mx.dequantize(codes, scales, fmt, 1, dtype))


@pytest.mark.parametrize(("fmt", "block_size"), [("e4m3", 16), ("int8", 24), ("e2m1", 6)])
def test_other_block_sizes(fmt, block_size):
    x = fuzz(41, 4, 2 * block_size * 3).view(4, 2, block_size * 3)
    for axis in (-1, 1):
        x_axis = x if axis == -1 else x.transpose(1, 2).contiguous()
        codes, scales = assert_quantize_matches(x_axis, fmt, axis, "rceil", block_size)
        got = kmx.dequantize(codes, scales, fmt, axis, torch.float32, block_size)
        assert same_bits(got, mx.dequantize(codes, scales, fmt, axis, torch.float32, block_size))


def test_plan_signatures():
    (q,) = kmx.plan_quantize([4, 128, 3], torch.bfloat16, "e2m1", 1, "even")
    assert list(q.signature) == jit_function(q.fn).arg_names
    assert q.signature["X"] == "*bf16" and q.signature["n_blocks"] == "i32"
    assert {k for k, v in q.signature.items() if v == "constexpr"} == set(q.constexprs)
    assert q.constexprs["FMT"] == FORMATS.index("e2m1")
    assert q.constexprs["RULE"] == RULES.index("even")
    assert q.grid == (-(-(4 * 4 * 3) // q.constexprs["BLOCKS"]),)
    assert q.grid_rule == "(cdiv(n_blocks, BLOCKS),)"
    assert q.options == {"enable_fp_fusion": False}
    (d,) = kmx.plan_dequantize([4, 64, 3], "e2m1", 1, torch.float16)
    assert list(d.signature) == jit_function(d.fn).arg_names
    assert d.signature["OUT"] == "*fp16" and d.options == {"enable_fp_fusion": False}
    assert kmx.plan_quantize([0, 64], torch.float32, "e4m3", -1) == []
    # one compiled kernel serves every size: sizes are runtime ints only
    (big,) = kmx.plan_quantize([1024, 4096], torch.float32, "e4m3", -1, "floor")
    (small,) = kmx.plan_quantize([2, 32], torch.float32, "e4m3", -1, "floor")
    assert big.key == small.key and big.grid != small.grid


def test_errors_are_those_of_portable_mx():
    with pytest.raises(portable.InputError, match="48 is not a multiple of 32"):
        kmx.plan_quantize([4, 48], torch.float32, "e4m3", -1)
    with pytest.raises(portable.InputError, match="48 is not a multiple of 32"):
        kmx.quantize(torch.ones(4, 48), "e4m3", -1)
    with pytest.raises(portable.InputError, match="scales of shape"):
        kmx.dequantize(
            torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8), "e4m3", -1
        )
