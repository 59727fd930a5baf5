"""The `emax` scale rule (Trainium3's QuantizeMX "EMAX": floor's scale doubled) against an
independent oracle in pure Python arithmetic on exact values (`math.frexp`, Python's half-even
`round`; no `portable.mx`, no bit tricks, no ml_dtypes), on `scale_sweep` for every format and
input dtype: every reachable scale byte, special values, subnormals, largest values, blocks that
floor saturates. Also: no finite element ever saturates (MXINT8 at byte 254 aside), emax is
floor's byte + 1 where floor's is not clamped, and `mx-quantize{scale=emax}` runs.

The backends are checked bit for bit on the same sweep by tests/test_mx_backends.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import portable
from portable import mx
from portable.mx.vectors import fuzz, scale_sweep
from tests.support.mx_pass import qdq, run_pass
from tests.support.mx_programs import same_bits

FORMATS = list(mx.FORMATS)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ----------------------------------------------------------------------------- the oracle


def emax_byte(amax: float, f: mx.MXFormat) -> int:
    """b = clamp(floor(log2 amax) + 128 - emax, 0, 254): the smallest byte with
    amax < 2^emax * 2^(b - 127); 255 for NaN / Inf, 0 for zero."""
    if not math.isfinite(amax):
        return 255
    if amax == 0:
        return 0
    return min(max(math.frexp(amax)[1] - 1 + 128 - f.emax, 0), 254)


def floor_byte(amax: float, f: mx.MXFormat) -> int:
    if amax == 0:
        return 0
    return min(max(math.frexp(amax)[1] - 1 + 127 - f.emax, 0), 254)


def element(y: float, f: mx.MXFormat) -> tuple[int, float, bool]:
    """(code, value, saturated) of the exact scaled value y: nearest even on the format's grid
    (subnormals included), then +-max."""
    a, negative = abs(y), math.copysign(1.0, y) < 0
    if f.integer:
        r = round(a * 64)  # exact: a power-of-two product; round() is half to even
        q = min(r, 127)
        return (
            (-q if negative else q) & 0xFF,
            math.copysign(q / 64, -1 if negative else 1) if q else 0.0,
            r > 127,
        )
    e = max(math.frexp(a)[1] - 1, f.emin) if a else f.emin
    quantum = 2.0 ** (e - f.mbits)
    r = round(a / quantum) * quantum
    saturated, r = r > f.max_value, min(r, f.max_value)
    if r < 2.0**f.emin:
        mag = int(r / 2.0 ** (f.emin - f.mbits))
    else:
        e = math.frexp(r)[1] - 1
        mag = ((e - f.emin + 1) << f.mbits) + int(r / 2.0 ** (e - f.mbits)) - (1 << f.mbits)
    return mag | (f.sign_bit if negative else 0), -r if negative else r, saturated


def oracle_block(values: list[float], f: mx.MXFormat):
    """(byte, codes, dequantized values, any element saturated) of one block of exact values."""
    b = emax_byte(max((abs(v) if not math.isnan(v) else math.inf) for v in values), f)
    if b == 255:
        return b, [0] * len(values), [math.nan] * len(values), False
    out = [element(v * 2.0 ** (127 - b), f) for v in values]  # exact in float64
    deq = [value * 2.0 ** (b - 127) for _, value, _ in out]  # exact: fits fp32
    return b, [c for c, _, _ in out], deq, any(s for _, _, s in out)


def unpacked(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    return mx.unpack_fp4(codes, -1) if mx.FORMATS[fmt].packed else codes


def reachable(f: mx.MXFormat, dtype: torch.dtype) -> set[int]:
    """The bytes some finite `dtype` input gets: zero, every binade, the largest value."""
    info = torch.finfo(dtype)
    lo, hi = math.frexp(info.smallest_normal * info.eps)[1] - 1, math.frexp(info.max)[1] - 1
    return {0} | {emax_byte(2.0**e, f) for e in range(lo, hi + 1)}


# ----------------------------------------------------------------------------- the sweep


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scale_sweep_matches_the_oracle(fmt, dtype):
    f = mx.FORMATS[fmt]
    x = scale_sweep(dtype)
    codes, scales = mx.quantize(x, fmt, -1, "emax")
    rows = [oracle_block(row, f) for row in x.double().tolist()]
    assert scales[:, 0].tolist() == [r[0] for r in rows]
    assert unpacked(codes, fmt).tolist() == [r[1] for r in rows]
    want = torch.tensor([r[2] for r in rows], dtype=torch.float64).float()
    assert same_bits(mx.dequantize(codes, scales, fmt, -1, torch.float32), want)
    # coverage: every byte the dtype can reach, and 255
    assert set(scales.flatten().tolist()) == reachable(f, dtype) | {255}
    if dtype != torch.float16:  # every byte 0 .. 255 - emax (254 for MXINT8)
        assert reachable(f, dtype) == set(range(min(256 - f.emax, 255)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_finite_elements_never_saturate(fmt):
    """|x| / scale < 2^emax <= max for every finite block, so no element clips; the one
    exception is MXINT8 (emax 0) above 2^127, where the byte stops at 254. The sweep holds
    blocks that floor does saturate, so the check has teeth."""
    f = mx.FORMATS[fmt]
    floor_saturates = False
    for dtype in DTYPES:
        for row in torch.cat([scale_sweep(dtype).double(), fuzz(5, 512).double()]).tolist():
            b, _, _, saturated = oracle_block(row, f)
            assert not saturated or (f.integer and b == 254), row
            amax = max(abs(v) for v in row)
            if math.isfinite(amax) and amax > 0:
                floor_saturates |= amax * 2.0 ** (127 - floor_byte(amax, f)) > f.max_value
    assert floor_saturates


@pytest.mark.parametrize("fmt", FORMATS)
def test_emax_is_floors_byte_plus_one_where_floor_is_not_clamped(fmt):
    f = mx.FORMATS[fmt]
    x = scale_sweep(torch.float32)
    _, floor = mx.quantize(x, fmt, -1, "floor")
    _, emax = mx.quantize(x, fmt, -1, "emax")
    amax = x.abs().amax(dim=1).double()
    finite = amax.isfinite() & (amax > 0)
    e = torch.frexp(amax[finite])[1] - 1  # floor(log2 amax)
    free = (e + 127 - f.emax >= 0) & (e + 127 - f.emax <= 253)
    assert free.sum() > 200
    assert torch.equal(emax[finite][free].int(), floor[finite][free].int() + 1)


# ----------------------------------------------------------------------------- the pass


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_mx_quantize_pass_parses_and_runs_scale_emax():
    torch.manual_seed(3)
    model, x = TwoLinears().eval(), torch.randn(32, 64) * 100
    text = "mx-quantize{format=e4m3,scale=emax,keep_first_last=false}"
    out, report = run_pass(portable.capture(model, (x,)), text)
    assert report.counts["forward"] == 2
    assert out.metadata["mx_quantize"]["scale"] == "emax"
    with torch.no_grad():
        h = torch.addmm(
            model.a.bias, qdq(x, 1, "e4m3", "emax"), qdq(model.a.weight, 1, "e4m3", "emax").t()
        )
        w = qdq(model.b.weight, 1, "e4m3", "emax")
        expected = torch.addmm(model.b.bias, qdq(torch.relu(h), 1, "e4m3", "emax"), w.t())
    assert torch.equal(portable.compile(out, "cpu")(x), expected)
