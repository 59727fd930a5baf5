"""MX quantization semantics (`portable.mx`): the test vectors of shared/reference/mx.md bit for
bit, the properties it lists fuzzed over every format and scale rule, `ml_dtypes` and a
pure-Python scale rule as independent oracles, the error messages, and the op path."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import portable
from portable import mx
from portable.mx import elements, scale, tables
from portable.mx.vectors import cases, edge_blocks, fuzz
from tests.support.mx_programs import same_bits

FORMATS = list(mx.FORMATS)
RULES = list(mx.SCALE_RULES)


def unpacked(codes: torch.Tensor, fmt: str, axis: int = -1) -> torch.Tensor:
    return mx.unpack_fp4(codes, axis) if mx.FORMATS[fmt].packed else codes


# ----------------------------------------------------------------------------- the format table


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_table_is_consistent(fmt):
    f = mx.FORMATS[fmt]
    assert f.magnitude_value(f.max_code) == f.max_value
    assert math.floor(math.log2(f.max_value)) == f.emax
    assert f.magnitude_value(1 << f.mbits) == 2.0**f.emin  # smallest normal
    inv = np.array(f.inv_max_bits, dtype=np.int32).view(np.float32)
    assert inv == np.float32(1) / np.float32(f.max_value)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if mx.FORMATS[f].ml_dtype])
def test_decoded_codes_are_ml_dtypes_values(fmt):
    f = mx.FORMATS[fmt]
    codes = np.arange(1 << f.bits, dtype=np.uint8)
    oracle = torch.from_numpy(codes.view(getattr(ml_dtypes, f.ml_dtype)).astype(np.float32))
    table = elements.decode_table(f)
    ours = table[torch.arange(1 << f.bits)] if not f.packed else table[:16, 0]
    assert same_bits(ours, oracle)
    if f.packed:
        assert same_bits(table[torch.arange(16) << 4, 1], oracle)


def test_int8_codes_are_twos_complement_sixty_fourths():
    table = elements.decode_table(mx.FORMATS["int8"])
    assert torch.equal(table, torch.arange(256, dtype=torch.uint8).view(torch.int8).float() / 64)


# ----------------------------------------------------------------------------- mx.md vectors


@pytest.mark.parametrize(
    ("vector", "fmt", "rule"),
    cases(),
    ids=lambda v: v.id if isinstance(v, mx.vectors.Vector) else v,
)
def test_mx_md_vector(vector, fmt, rule):
    x = torch.tensor([vector.block()], dtype=torch.float32)
    codes, scales = mx.quantize(x, fmt, -1, rule)
    assert scales.tolist() == [[vector.byte]]
    flat = unpacked(codes, fmt)[0]
    assert flat[: len(vector.codes)].tolist() == list(vector.codes)
    zeros = [i for i, v in enumerate(vector.block()) if v == 0 and math.copysign(1, v) > 0]
    if vector.byte != 255:  # +0 inputs give code 0
        assert flat[zeros].eq(0).all()
    values = mx.dequantize(codes, scales, fmt, -1, torch.float32)[0]
    n = len(vector.dequant)
    assert same_bits(values[:n], torch.tensor(vector.dequant, dtype=torch.float32))


def test_fp4_packs_element_2i_into_the_low_nibble():
    x = torch.tensor([[7.0, 3.0, -6.5, 1.0] + [0.0] * 28])  # vector 4: codes 7, 5, 0xF, 2
    codes, _ = mx.quantize(x, "e2m1")
    assert codes[0, :2].tolist() == [0x57, 0x2F]
    assert torch.equal(mx.pack_fp4(torch.tensor([7, 5, 0xF, 2]), 0), torch.tensor([0x57, 0x2F]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_blocks_are_nan_with_zero_codes(fmt, rule, special):
    x = torch.ones(2, 32)
    x[0, 5] = special
    codes, scales = mx.quantize(x, fmt, -1, rule)
    assert scales[:, 0].tolist()[0] == 255 and scales[1, 0] != 255
    assert codes[0].eq(0).all()  # the scale byte alone marks the block
    values = mx.dequantize(codes, scales, fmt, -1)
    assert values[0].isnan().all() and not values[1].isnan().any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
def test_all_zero_block_is_byte_zero_and_plus_zero(fmt, rule):
    codes, scales = mx.quantize(torch.zeros(1, 64), fmt, -1, rule)
    assert scales.eq(0).all() and codes.eq(0).all()
    assert same_bits(mx.dequantize(codes, scales, fmt), torch.zeros(1, 64))


def test_scale_byte_zero_is_the_subnormal_two_to_the_minus_127():
    b = torch.tensor([0, 1, 127, 254, 253], dtype=torch.int32)
    assert scale.scale_values(b).view(torch.int32).tolist() == [
        0x00400000, 0x00800000, 0x3F800000, 0x7F000000, 0x7E800000
    ]  # fmt: skip
    assert scale.reciprocal_scales(b).tolist() == [2.0**127, 2.0**126, 1.0, 2.0**-127, 2.0**-126]


def test_floor_uses_exponent_bits_not_log2():
    # float32 log2(255.99998) rounds up to 8: the floor scale is that of 128, not 256
    x = torch.full((1, 32), np.nextafter(np.float32(256), np.float32(0)).item())
    _, scales = mx.quantize(x, "e4m3")
    assert scales.item() == 127 + 7 - 8


# ----------------------------------------------------------------------------- oracles


def _log2_floor(v: float) -> int:
    return math.frexp(v)[1] - 1


def _log2_ceil(v: float) -> int:
    m, e = math.frexp(v)
    return e - 1 if m == 0.5 else e


def _round_half_up(v: float, mbits: int) -> float:
    m, e = math.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    return math.floor(m * 2 ** (mbits + 1) + 0.5) * 2.0 ** (e - mbits - 1)


def oracle_byte(amax: float, f: mx.MXFormat, rule: str) -> int:
    """The scale rules of mx.md in Python arithmetic on the real amax (no bit tricks)."""
    if not math.isfinite(amax):
        return 255
    if amax == 0:
        return 0
    if rule == "rceil":
        d = float(np.float32(amax) * (np.float32(1) / np.float32(f.max_value)))
        return 0 if d == 0 else min(max(_log2_ceil(d) + 127, 0), 254)
    e = {
        "floor": lambda: _log2_floor(amax),
        "ceil": lambda: _log2_ceil(amax),
        "even": lambda: _log2_floor(_round_half_up(amax, f.mbits)),
        "emax": lambda: _log2_floor(amax) + 1,  # floor's scale doubled
    }[rule]()
    return min(max(e - f.emax + 127, 0), 254)


def oracle_codes(x: torch.Tensor, b: torch.Tensor, f: mx.MXFormat) -> torch.Tensor:
    """Element codes by ml_dtypes' casts (numpy round-half-even for MXINT8) of x / scale
    clipped to +-max, for blocks [rows, 32] with finite scales."""
    y = x.double() * torch.exp2(127 - b.double())[:, None]
    y = y.float().clamp(-f.max_value, f.max_value).numpy()
    if f.integer:
        return torch.from_numpy(np.round(y * 64).astype(np.int8).view(np.uint8))
    codes = y.astype(getattr(ml_dtypes, f.ml_dtype)).view(np.uint8)
    return torch.from_numpy(codes & ((1 << f.bits) - 1))


INPUTS = {"fuzz0": lambda: fuzz(0, 256), "fuzz1": lambda: fuzz(1, 256), "edges": edge_blocks}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("inputs", list(INPUTS))
def test_quantize_matches_independent_oracles(fmt, rule, inputs):
    f = mx.FORMATS[fmt]
    x = INPUTS[inputs]()
    codes, scales = mx.quantize(x, fmt, -1, rule)
    amax = x.abs().amax(dim=1)
    expected = [oracle_byte(a, f, rule) for a in amax.double().tolist()]
    assert scales[:, 0].tolist() == expected
    finite = scales[:, 0] != 255
    ours = unpacked(codes, fmt)[finite]
    assert torch.equal(ours, oracle_codes(x[finite], scales[finite, 0].int(), f))


def test_even_rule_rounds_a_subnormal_amax_by_its_value():
    # MXINT8 (emax 0) is the one format where the even rule can give byte 1 to a subnormal amax
    f = mx.FORMATS["int8"]
    for m in (0x7F7FFF, 0x7F8000, 0x7FBFFF, 0x7FC000, 0x7FFFFF, 0x400000):
        amax = torch.tensor([m], dtype=torch.int32)
        value = amax.view(torch.float32).item()
        b = scale.scale_bytes(amax, f, "even").item()
        assert b == oracle_byte(value, f, "even"), hex(m)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_integer_rounding_equals_torch_float8_cast(fmt):
    """The two element roundings of elements.py agree on every exponent and on ties."""
    f = mx.FORMATS[fmt]
    g = torch.Generator().manual_seed(3)
    e = torch.arange(-150, f.emax + 2).repeat_interleave(2048)
    mant = torch.randint(0, 1 << 23, e.shape, generator=g, dtype=torch.int32)
    mant[::4] &= ~((1 << (22 - f.mbits)) - 1)  # exact ties and grid points
    mant[1::4] = 0
    bits = ((e + 127).clamp(min=0) << 23).int() | mant
    bits[::3] |= -(2**31)  # negative
    y = bits.view(torch.float32).clone()
    a, work = torch.empty_like(bits), torch.empty_like(bits)
    integer = elements.encode_integer_path(y.clone(), bits, f, a, work).to(torch.uint8)
    cast = y.clamp(-f.max_value, f.max_value).to(f.torch_dtype).view(torch.uint8)
    assert torch.equal(integer, cast)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
def test_scale_tables_equal_the_rule_formulas(fmt, rule):
    """tables.py: the byte and reciprocal scale looked up by key are those of scale.py's
    formula, on every threshold of edge_blocks and random bits of every binade."""
    f = mx.FORMATS[fmt]
    g = torch.Generator().manual_seed(RULES.index(rule))
    amax = edge_blocks().abs().amax(dim=1).view(torch.int32)
    bits = torch.cat([amax, torch.randint(0, 0x7F800000, (20000,), generator=g, dtype=torch.int32)])
    b_table, rs_table = tables.scale_table(f, rule)
    key = tables.scale_keys(bits, f, rule)
    want = scale.scale_bytes(bits, f, rule)
    assert torch.equal(b_table[key].int(), want)
    assert same_bits(rs_table[key], scale.reciprocal_scales(want))


@pytest.mark.parametrize("fmt", [f for f in FORMATS if tables.uses_encode_table(mx.FORMATS[f])])
def test_encode_table_equals_integer_rounding(fmt):
    """The 16-bit key (high bits, low ones folded into bit 16) decides the rounding: ties,
    one ulp beside them, and random bits of every scaled magnitude, both signs."""
    f = mx.FORMATS[fmt]
    g = torch.Generator().manual_seed(5)
    e = torch.arange(100, 140).repeat_interleave(4096)  # |y| from 2^-27 to 2^12
    mant = torch.randint(0, 1 << 23, e.shape, generator=g, dtype=torch.int32)
    mant[::3] &= ~((1 << (22 - f.mbits)) - 1)  # exact ties and grid points
    mant[1::3] = (mant[1::3] & ~0xFFFF) + torch.randint(0, 2, mant[1::3].shape, generator=g)
    bits = (e.int() << 23) | mant
    bits[::2] |= -(2**31)
    key = tables.encode_keys(bits, torch.empty_like(bits))
    y, a, work = bits.view(torch.float32).clone(), torch.empty_like(bits), torch.empty_like(bits)
    want = elements.encode_integer_path(y, bits, f, a, work).to(torch.uint8)
    assert torch.equal(tables.encode_table(f)[key], want)


# ----------------------------------------------------------------------------- properties


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
def test_power_of_two_shifts_the_byte_and_keeps_the_codes(fmt, rule):
    g = torch.Generator().manual_seed(11)
    base = torch.randint(-80, 80, (64, 1), generator=g).float()
    x = torch.randn(64, 32, generator=g) * torch.exp2(base + torch.randint(-20, 1, (64, 32)))
    x[::5, 3] = 0.0
    codes, scales = mx.quantize(x, fmt, -1, rule)
    for j in (-17, -1, 1, 9, 30):
        shifted_codes, shifted = mx.quantize(x * 2.0**j, fmt, -1, rule)
        assert torch.equal(shifted.int(), scales.int() + j)
        assert torch.equal(shifted_codes, codes)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_quantize_dequantize_is_idempotent(fmt, rule):
    x = fuzz(7, 256)
    codes, scales = mx.quantize(x, fmt, -1, rule)
    once = mx.dequantize(codes, scales, fmt)
    codes2, scales2 = mx.quantize(once, fmt, -1, rule)
    assert same_bits(mx.dequantize(codes2, scales2, fmt), once)
    if rule == "floor":
        assert torch.equal(codes2, codes) and torch.equal(scales2, scales)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_the_bytes_of_their_fp32_upcast(fmt, rule, dtype):
    x = fuzz(9, 128).to(dtype)
    got = mx.quantize(x, fmt, -1, rule)
    want = mx.quantize(x.float(), fmt, -1, rule)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", RULES)
def test_any_axis_equals_transpose_quantize_transpose(fmt, rule):
    big, small = fuzz(13, 32 * 64).view(32, 64, 32), fuzz(14, 3 * 2 * 5).view(3, 64, 5)
    for x, axis in ((big, 0), (big, 1), (big, -2), (small, 1), (small, -2)):
        moved = x.movedim(axis, -1)
        want_codes, want_scales = mx.quantize(moved, fmt, -1, rule)
        codes, scales = mx.quantize(x, fmt, axis, rule)
        assert codes.is_contiguous() and scales.is_contiguous()
        assert torch.equal(codes, want_codes.movedim(-1, axis))
        assert torch.equal(scales, want_scales.movedim(-1, axis))
        values = mx.dequantize(codes, scales, fmt, axis)
        assert same_bits(values, mx.dequantize(want_codes, want_scales, fmt).movedim(-1, axis))


def test_axis_one_of_a_matrix_is_axis_zero_of_its_transpose():
    x = fuzz(17, 64, 96)
    codes, scales = mx.quantize(x, "e4m3", 1, "rceil")
    t_codes, t_scales = mx.quantize(x.t(), "e4m3", 0, "rceil")
    assert torch.equal(codes, t_codes.t()) and torch.equal(scales, t_scales.t())


DQ = (torch.float32, torch.bfloat16)  # dequantized directly into the output, or through scratch


def test_chunking_does_not_change_the_bytes(monkeypatch):
    x = fuzz(19, 64 * 8).view(8, 64, 32)
    want = [mx.quantize(x, f, 1, "even") for f in ("e4m3", "e2m1")]
    monkeypatch.setattr(mx.codec, "CHUNK", 96)  # chunks of rows and of `inner`
    got = [mx.quantize(x, f, 1, "even") for f in ("e4m3", "e2m1")]
    for (gc, gs), (wc, ws) in zip(got, want, strict=True):
        assert torch.equal(gc, wc) and torch.equal(gs, ws)
    pairs = list(zip(want, ("e4m3", "e2m1"), strict=True))
    small = [mx.dequantize(*w, f, 1, d) for w, f in pairs for d in DQ]
    monkeypatch.undo()  # the default CHUNK: whole rows, code pairs decoded at once
    big = [mx.dequantize(*w, f, 1, d) for w, f in pairs for d in DQ]
    assert all(same_bits(a, b) for a, b in zip(small, big, strict=True))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_rounds_the_fp32_values_to_dtype(fmt, dtype):
    codes, scales = mx.quantize(fuzz(23, 64), fmt, -1, "rceil")
    values = mx.dequantize(codes, scales, fmt, -1, dtype)
    assert values.dtype == dtype and values.is_contiguous()
    assert same_bits(values, mx.dequantize(codes, scales, fmt, -1).to(dtype))


def test_block_size_parameter():
    x = fuzz(29, 4, 48)
    codes, scales = mx.quantize(x, "e4m3", -1, "floor", block_size=16)
    assert scales.shape == (4, 3)
    want = mx.quantize(x.view(12, 16), "e4m3", -1, "floor", block_size=16)
    assert torch.equal(codes.view(12, 16), want[0]) and torch.equal(scales.view(12, 1), want[1])
    back = mx.dequantize(codes, scales, "e4m3", -1, torch.float32, block_size=16)
    assert same_bits(back.view(12, 16), mx.dequantize(*want, "e4m3", -1, block_size=16))


def test_empty_tensor():
    codes, scales = mx.quantize(torch.empty(0, 64), "e2m1")
    assert codes.shape == (0, 32) and scales.shape == (0, 2)
    assert mx.dequantize(codes, scales, "e2m1").shape == (0, 64)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("call", "pieces"),
    [
        (lambda: mx.quantize(torch.ones(4, 48), "e4m3"),
         ["axis -1 of shape [4, 48]", "48 is not a multiple of 32", "fix: pad dim 1", "64"]),
        (lambda: mx.quantize(torch.ones(40, 64), "e4m3", 0),
         ["axis 0 of shape [40, 64]", "fix: pad dim 0"]),
        (lambda: mx.quantize(torch.ones(2, 30), "e2m1", -1, "floor", 15),
         ["block_size must be even", "15"]),
        (lambda: mx.quantize(torch.ones(2, 32), "e4m3", 2), ["axis 2 is out of range", "[2, 32]"]),
        (lambda: mx.quantize(torch.ones(()), "e4m3", 0), ["0-dim"]),
        (lambda: mx.quantize(torch.ones(2, 32), "fp8"), ["unknown MX format 'fp8'", "e4m3"]),
        (lambda: mx.quantize(torch.ones(2, 32), "e4m3", -1, "round"),
         ["unknown MX scale rule 'round'", "rceil"]),
        (lambda: mx.quantize(torch.ones(2, 32, dtype=torch.float64), "e4m3"),
         ["torch.float64", "fix: cast the input to float32"]),
        (lambda: mx.quantize(torch.ones(2, 32), "e4m3", -1, "floor", 0), ["positive int"]),
        (lambda: mx.dequantize(torch.zeros(2, 32, dtype=torch.uint8),
                               torch.zeros(2, 2, dtype=torch.uint8), "e4m3"),
         ["scales of shape [2, 2]", "expected [2, 1]"]),
        (lambda: mx.dequantize(torch.zeros(2, 32), torch.zeros(2, 1, dtype=torch.uint8), "e4m3"),
         ["codes must be uint8"]),
        (lambda: mx.dequantize(torch.zeros(2, 32, dtype=torch.uint8),
                               torch.zeros(2, 1, dtype=torch.uint8), "e4m3", -1, torch.int32),
         ["floating dtype"]),
    ],
)  # fmt: skip
def test_errors_name_the_values_and_the_fix(call, pieces):
    with pytest.raises(portable.InputError) as info:
        call()
    message = str(info.value)
    for piece in pieces:
        assert piece in message, (piece, message)


# ----------------------------------------------------------------------------- swizzle


@pytest.mark.parametrize(("rows", "cols"), [(128, 4), (200, 7), (1, 1), (256, 12)])
def test_swizzle_places_each_scale_at_its_tile_offset(rows, cols):
    s = torch.randint(1, 256, (rows, cols), dtype=torch.uint8)
    out = mx.swizzle_scales(s)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert out.shape == (rp * cp,)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    tile = (r // 128) * (cp // 4) + c // 4
    rr, cc = r % 128, c % 4
    offset = tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc
    assert torch.equal(out[offset], s)
    assert out.eq(0).sum() == rp * cp - rows * cols  # the padding is zeros
    assert torch.equal(mx.unswizzle_scales(out, rows, cols), s)


def test_swizzle_errors():
    with pytest.raises(portable.InputError, match="2-D"):
        mx.swizzle_scales(torch.zeros(2, 3, 4, dtype=torch.uint8))
    with pytest.raises(portable.InputError, match="do not fit"):
        mx.unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 128, 4)


# ----------------------------------------------------------------------------- the ops


@pytest.mark.parametrize("fmt", FORMATS)
def test_ops_run_portable_mx(fmt):
    x = fuzz(31, 4 * 3).view(4, 96)
    codes, scales = torch.ops.portable.mx_quantize(x, fmt, -1, "rceil", 32)
    want = mx.quantize(x, fmt, -1, "rceil")
    assert torch.equal(codes, want[0]) and torch.equal(scales, want[1])
    values = torch.ops.portable.mx_dequantize(codes, scales, fmt, -1, torch.bfloat16, 32)
    assert same_bits(values, mx.dequantize(*want, fmt, -1, torch.bfloat16))


def test_cpu_backend_runs_a_captured_quantize_dequantize():
    class QDQ(torch.nn.Module):
        def forward(self, x):
            codes, scales = torch.ops.portable.mx_quantize(x, "e2m1", 0, "floor", 32)
            return torch.ops.portable.mx_dequantize(codes, scales, "e2m1", 0, torch.float32, 32)

    x = torch.randn(64, 8)
    program = portable.capture(QDQ(), (x,))
    out = portable.compile(program, backend="cpu")(x)
    assert same_bits(out, mx.dequantize(*mx.quantize(x, "e2m1", 0), "e2m1", 0))
