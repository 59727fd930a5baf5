"""MX quantize / dequantize on every backend: one table, the bytes of `portable.mx` everywhere.

`BACKENDS` maps a name to the implementation under test: `run` backends quantize and dequantize
tensors (`cpu`: one-op programs run by the cpu backend; `xla`: the same programs compiled by the
xla backend; `triton`: the cuda backend's kernels in Triton's interpreter; `onnx`: programs of
every format x rule per input, exported once and run by ONNX Runtime, see `batched`). A new
backend is one more entry; `neuron`, which only lowers here, is tests/test_mx_neuron.py.

Every run backend gets the same cases, checked bit for bit against `portable.mx` (the oracle)
and against shared/reference/mx.md's expectations directly:
- the mx.md vectors (byte, codes, dequantized values) for every format and rule they list;
- one shared [ROWS, 32] corpus (the vectors, `edge_blocks()` around every scale-rule threshold,
  seeded `fuzz()` with subnormals, ties, NaN / Inf and zero blocks) for every format x rule,
  dequantized to float32 / bfloat16 / float16;
- dequantization of every code byte under scale bytes 0 (a subnormal scale), 1, 127, 254
  (overflow) and 255 (NaN), and random bytes, to every dtype the backend takes;
- the emax rule's sweep (`scale_sweep`: every reachable scale byte, special values,
  subnormals, largest values) for every format and float32 / bfloat16 / float16 input, whose
  oracle check is tests/test_mx_emax.py;
- mx.md's properties on the backend's own results: x * 2^j shifts the byte by j and keeps the
  codes; q(-x) flips the sign bit (MXINT8: two's complement); quantize-dequantize is idempotent
  in value (floor and rceil; in bytes for floor); bfloat16 / float16 input gives the bytes of its
  float32 upcast; quantizing along a middle dim equals movedim, quantize last dim, movedim back.
Cases share shapes so each backend compiles few programs (xla compiles per shape and argument).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import portable
from portable import mx
from portable.ir.program import Program
from portable.ir.signature import (
    TensorSpec,
)
from portable.mx.vectors import VECTORS, scale_sweep
from tests.support.mx_programs import (
    FORMATS,
    ROWS,
    RULE_OF,
    RULES,
    add_dequantize,
    add_quantize,
    build_program,
    corpus,
    dequantize_program,
    middle_axis_input,
    quantize_program,
    same_bits,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN / Inf on purpose

HALF = (torch.bfloat16, torch.float16)
FLOATS = (torch.float32, *HALF)
SIGN_MASK = {"e4m3": 0x80, "e5m2": 0x80, "e3m2": 0x20, "e2m3": 0x20, "e2m1": 0x88}


# ----------------------------------------------------------------------------- helpers


def unpacked(codes: torch.Tensor, fmt: str, axis: int = -1) -> torch.Tensor:
    return mx.unpack_fp4(codes, axis) if mx.FORMATS[fmt].packed else codes


def code_bytes(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of ROWS blocks: every code byte under scale bytes 0, 1, 127, 254 and 255,
    then random code and scale bytes."""
    per_row = 16 if mx.FORMATS[fmt].packed else 32
    every = torch.arange(256, dtype=torch.uint8).view(-1, per_row)
    special = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
    g = torch.Generator().manual_seed(FORMATS.index(fmt))
    rest = ROWS - len(special) * len(every)
    random_codes = torch.randint(0, 256, (rest, per_row), generator=g, dtype=torch.uint8)
    random_scales = torch.randint(0, 256, (rest,), generator=g, dtype=torch.uint8)
    codes = torch.cat([every.repeat(len(special), 1), random_codes])
    scales = torch.cat([special.repeat_interleave(len(every)), random_scales])
    return codes, scales.view(ROWS, 1)


# ----------------------------------------------------------------------------- the backends


def compiled(backend: str) -> tuple[Callable, Callable]:
    """quantize / dequantize through one-op programs compiled by `backend`, one executable per
    shape, dtype and arguments."""

    @functools.cache
    def q_exe(shape, dtype, fmt, axis, rule, block_size):
        return portable.compile(
            quantize_program(shape, dtype, fmt, axis, rule, block_size), backend
        )

    @functools.cache
    def dq_exe(codes_shape, scales_shape, fmt, axis, dtype, block_size):
        program = dequantize_program(codes_shape, scales_shape, fmt, axis, dtype, block_size)
        return portable.compile(program, backend)

    def quantize(x, fmt, axis=-1, rule="floor", block_size=32):
        codes, scales = q_exe(tuple(x.shape), x.dtype, fmt, axis, rule, block_size)(x)
        return codes.contiguous(), scales.contiguous()

    def dequantize(codes, scales, fmt, axis=-1, dtype=torch.float32, block_size=32):
        exe = dq_exe(tuple(codes.shape), tuple(scales.shape), fmt, axis, dtype, block_size)
        return exe(codes, scales).contiguous()

    return quantize, dequantize


def _table_pairs(dtype: torch.dtype, axis: int) -> tuple[tuple[str, str], ...]:
    """The (format, rule) pairs the table quantizes one input with: every pair for float32
    along the last axis, one rule per format (RULE_OF) otherwise."""
    if dtype == torch.float32 and axis == -1:
        return tuple(itertools.product(FORMATS, RULES))
    return tuple(RULE_OF.items())


def quantize_table_program(shape, dtype, axis, pairs, block_size=32) -> Program:
    """One input quantized with each (format, rule) of `pairs`: outputs codes, scales, ..."""
    spec = TensorSpec(tuple(shape), dtype)

    def build(g, ph):
        outs = []
        for fmt, rule in pairs:
            outs += add_quantize(g, ph[0], spec, fmt, axis, rule, block_size)
        return outs

    return build_program("mx_quantize_table", [spec], build)


def dequantize_table_program(codes_shape, scales_shape, axis, formats, dtypes, block_size=32):
    """One (codes, scales) pair dequantized as each format x dtype (format-major)."""
    inputs = [TensorSpec(tuple(shape), torch.uint8) for shape in (codes_shape, scales_shape)]

    def build(g, ph):
        return [
            add_dequantize(g, *ph, tuple(codes_shape), fmt, axis, dtype, block_size)
            for fmt in formats
            for dtype in dtypes
        ]

    return build_program("mx_dequantize_table", inputs, build)


def batched(backend: str, dtypes: tuple[torch.dtype, ...]) -> tuple[Callable, Callable]:
    """quantize / dequantize for a backend whose compile is slow (`onnx` exports each program):
    one program per input shape, dtype and axis holding every (format, rule) pair the table asks
    of such an input (`_table_pairs`; a one-op program for any other request), one per codes /
    scales shape and axis holding every format of that packing x every dtype in `dtypes`. Results
    are cached by the input's bytes, so the table's cases that share an input run it once."""

    @functools.cache
    def exe(program_of, *key):
        return portable.compile(program_of(*key), backend)

    results: dict[tuple, list[torch.Tensor]] = {}

    def run(program_of, key, *tensors):
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        cache_key = (program_of, key, digest.hexdigest())
        if cache_key not in results:
            out = exe(program_of, *key)(*tensors)
            results[cache_key] = list(out) if isinstance(out, tuple) else [out]
        return results[cache_key]

    def quantize(x, fmt, axis=-1, rule="floor", block_size=32):
        pairs = _table_pairs(x.dtype, axis)
        pairs = pairs if (fmt, rule) in pairs else ((fmt, rule),)
        out = run(quantize_table_program, (tuple(x.shape), x.dtype, axis, pairs, block_size), x)
        i = 2 * pairs.index((fmt, rule))
        return out[i].contiguous(), out[i + 1].contiguous()

    def dequantize(codes, scales, fmt, axis=-1, dtype=torch.float32, block_size=32):
        packed = mx.FORMATS[fmt].packed
        formats = tuple(f for f in FORMATS if mx.FORMATS[f].packed == packed)
        key = (tuple(codes.shape), tuple(scales.shape), axis, formats, dtypes, block_size)
        out = run(dequantize_table_program, key, codes, scales)
        return out[formats.index(fmt) * len(dtypes) + dtypes.index(dtype)].contiguous()

    return quantize, dequantize


def _triton_kernels():
    from portable.backends.cuda.kernels import mx as kmx

    return kmx.quantize, kmx.dequantize


@dataclasses.dataclass(frozen=True)
class MXBackend:
    """One implementation under test, built on first use (heavy imports happen then): `make()`
    returns `(quantize, dequantize)` with the signatures of `portable.mx` (`quantize(x, fmt,
    axis, rule, block_size) -> (codes, scales)`, `dequantize(codes, scales, fmt, axis, dtype,
    block_size) -> values`)."""

    make: Callable[[], Any]
    requires: str | None = None  # a module that must be importable, else the cases skip
    dequantize_dtypes: tuple[torch.dtype, ...] = (*FLOATS, torch.float64)


BACKENDS: dict[str, MXBackend] = {
    "cpu": MXBackend(lambda: compiled("cpu")),
    "xla": MXBackend(lambda: compiled("xla"), requires="jax"),
    "triton": MXBackend(_triton_kernels, requires="triton"),
    "onnx": MXBackend(lambda: batched("onnx", (*FLOATS, torch.float64)), requires="onnxruntime"),
}
RUN = list(BACKENDS)


@functools.cache
def _made(name: str):
    return BACKENDS[name].make()


def backend(name: str):
    """The made backend `name` (skips the test when its requirement is not installed)."""
    module = BACKENDS[name].requires
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{name} needs {module}")
    return _made(name)


def quantize(name: str, x: torch.Tensor, fmt: str, axis: int = -1, rule: str = "floor"):
    """`name`'s (codes, scales), after checking them against the oracle bit for bit."""
    codes, scales = backend(name)[0](x, fmt, axis, rule, 32)
    want_codes, want_scales = mx.quantize(x, fmt, axis, rule)
    where = f"{name} {fmt} {rule} {x.dtype} {tuple(x.shape)} axis {axis}"
    bad = (scales != want_scales).nonzero()
    assert not len(bad), f"{where}: scale bytes differ at {bad[:5].tolist()}"
    bad = (codes != want_codes).nonzero()
    assert not len(bad), f"{where}: codes differ at {bad[:5].tolist()}"
    return codes, scales


def dequantize(name: str, codes, scales, fmt: str, axis: int = -1, dtype=torch.float32):
    """`name`'s values, after checking them against the oracle bit for bit."""
    got = backend(name)[1](codes, scales, fmt, axis, dtype, 32)
    want = mx.dequantize(codes, scales, fmt, axis, dtype)
    assert same_bits(got, want), f"{name} {fmt} dequantize to {dtype}: {_first_diff(got, want)}"
    return got


def _first_diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{TensorSpec.of(got)} vs {TensorSpec.of(want)}"
    differ = (got != want) & ~(got.isnan() & want.isnan())
    i = differ.nonzero()[:3]
    return f"at {i.tolist()}: {got[differ][:3].tolist()} vs {want[differ][:3].tolist()}"


def _params(*axes):
    """pytest params over run backends x the given (name, values) axes."""
    for be in RUN:
        for combo in itertools.product(*(a[1] for a in axes)):
            ids = "-".join(str(c).removeprefix("torch.") for c in (be, *combo))
            yield pytest.param(be, *combo, id=ids)


def parametrize(*axes):
    names = ",".join(["be", *(a[0] for a in axes)])
    return pytest.mark.parametrize(names, list(_params(*axes)))


# ----------------------------------------------------------------------------- the table


@parametrize(("fmt", FORMATS), ("rule", RULES))
def test_mx_md_vectors_and_corpus(be, fmt, rule):
    x = corpus()
    codes, scales = quantize(be, x, fmt, -1, rule)
    values = dequantize(be, codes, scales, fmt)
    for dtype in HALF:
        dequantize(be, codes, scales, fmt, -1, dtype)
    checked = 0
    for row, v in enumerate(VECTORS):
        if fmt not in v.formats or rule not in v.rules:
            continue
        checked += 1
        assert scales[row, 0].item() == v.byte, f"vector {v.id}"
        got = unpacked(codes[row], fmt)[: len(v.codes)].tolist()
        assert got == list(v.codes), f"vector {v.id}: codes {[hex(c) for c in got]}"
        want = torch.tensor(v.dequant, dtype=torch.float32)
        assert same_bits(values[row, : len(v.dequant)], want), f"vector {v.id}: dequantized"
    assert checked == sum(1 for v in VECTORS if fmt in v.formats and rule in v.rules)


@parametrize(("fmt", FORMATS), ("dtype", FLOATS))
def test_emax_scale_sweep(be, fmt, dtype):
    x = scale_sweep(dtype, rows=4 * ROWS)
    codes, scales = quantize(be, x, fmt, -1, "emax")
    dequantize(be, codes, scales, fmt)
    assert len(set(scales.flatten().tolist())) > (40 if dtype == torch.float16 else 240)


@parametrize(("fmt", FORMATS))
def test_dequantize_every_code_and_scale_byte(be, fmt):
    codes, scales = code_bytes(fmt)
    for dtype in BACKENDS[be].dequantize_dtypes:
        dequantize(be, codes, scales, fmt, -1, dtype)


@parametrize(("fmt", FORMATS), ("rule", RULES))
def test_power_of_two_shifts_the_byte_and_keeps_the_codes(be, fmt, rule):
    # normal fp32 elements (and zeros) far from the clamps: scales stay in [1, 254]
    g = torch.Generator().manual_seed(11)
    base = torch.randint(-80, 80, (ROWS, 1), generator=g).float()
    spread = torch.randint(-20, 1, (ROWS, 32), generator=g).float()
    x = torch.randn(ROWS, 32, generator=g) * torch.exp2(base + spread)
    x[::5, 3] = 0.0
    codes, scales = quantize(be, x, fmt, -1, rule)
    for j in (-17, 1, 30):
        shifted_codes, shifted = quantize(be, x * 2.0**j, fmt, -1, rule)
        assert torch.equal(shifted.int(), scales.int() + j), j
        assert torch.equal(shifted_codes, codes), j


@parametrize(("fmt", FORMATS), ("rule", RULES))
def test_negation_flips_the_sign(be, fmt, rule):
    x = corpus()
    codes, scales = quantize(be, x, fmt, -1, rule)
    neg_codes, neg_scales = quantize(be, -x, fmt, -1, rule)
    assert torch.equal(neg_scales, scales)
    special = scales[:, 0] == 255
    assert neg_codes[special].eq(0).all() and codes[special].eq(0).all()
    if fmt == "int8":  # two's complement
        expected = (-codes.view(torch.int8).int()).to(torch.int8).view(torch.uint8)
    else:
        expected = codes ^ SIGN_MASK[fmt]
    assert torch.equal(neg_codes[~special], expected[~special])


@parametrize(("fmt", FORMATS), ("rule", ["floor", "rceil"]))
def test_quantize_dequantize_is_idempotent(be, fmt, rule):
    x = corpus()
    codes, scales = quantize(be, x, fmt, -1, rule)
    once = dequantize(be, codes, scales, fmt)
    codes2, scales2 = quantize(be, once, fmt, -1, rule)
    twice = dequantize(be, codes2, scales2, fmt)
    # rceil may round a block whose amax is near the fp32 maximum up past it (to +-Inf)
    overflow = once.isinf().any(dim=1)
    assert rule == "rceil" or not overflow.any()
    assert (x[overflow].abs().amax(dim=1) > 2.0**127).all()
    assert same_bits(twice[~overflow], once[~overflow])
    if rule == "floor":
        assert torch.equal(codes2, codes) and torch.equal(scales2, scales)


@parametrize(("fmt", FORMATS), ("dtype", HALF))
def test_half_input_gives_the_bytes_of_its_fp32_upcast(be, fmt, dtype):
    x = corpus().to(dtype)
    rule = RULE_OF[fmt]
    codes, scales = quantize(be, x, fmt, -1, rule)
    up_codes, up_scales = quantize(be, x.float(), fmt, -1, rule)
    assert torch.equal(codes, up_codes) and torch.equal(scales, up_scales)


@parametrize(("fmt", FORMATS))
def test_middle_axis_equals_movedim_quantize_movedim(be, fmt):
    rule = RULE_OF[fmt]
    x = middle_axis_input(77)
    codes, scales = quantize(be, x, fmt, 1, rule)
    moved_codes, moved_scales = quantize(be, x.movedim(1, -1).contiguous(), fmt, -1, rule)
    assert torch.equal(codes, moved_codes.movedim(-1, 1))
    assert torch.equal(scales, moved_scales.movedim(-1, 1))
    values = dequantize(be, codes, scales, fmt, 1)
    moved = dequantize(be, moved_codes, moved_scales, fmt, -1)
    assert same_bits(values, moved.movedim(-1, 1).contiguous())
