"""MX quantize / dequantize on every backend: one table, the bytes of `portable.mx` everywhere.

`BACKENDS` maps a name to the implementation under test: `run` backends quantize and dequantize
tensors (`cpu`: one-op programs run by the cpu backend; `xla`: the same programs compiled by the
xla backend; `triton`: the cuda backend's kernels in Triton's interpreter; `onnx`: programs of
every format x rule per input, exported once and run by ONNX Runtime, see `batched`), `lower`
backends only lower (`neuron`: no NeuronCore here). A new backend is one more entry.

Every run backend gets the same cases, checked bit for bit against `portable.mx` (the oracle)
and against shared/reference/mx.md's expectations directly:
- the mx.md vectors (byte, codes, dequantized values) for every format and rule they list;
- one shared [ROWS, 32] corpus (the vectors, `edge_blocks()` around every scale-rule threshold,
  seeded `fuzz()` with subnormals, ties, NaN / Inf and zero blocks) for every format x rule,
  dequantized to float32 / bfloat16 / float16;
- dequantization of every code byte under scale bytes 0 (a subnormal scale), 1, 127, 254
  (overflow) and 255 (NaN), and random bytes, to every dtype the backend takes;
- mx.md's properties on the backend's own results: x * 2^j shifts the byte by j and keeps the
  codes; q(-x) flips the sign bit (MXINT8: two's complement); quantize-dequantize is idempotent
  in value (floor and rceil; in bytes for floor); bfloat16 / float16 input gives the bytes of its
  float32 upcast; quantizing along a middle dim equals movedim, quantize last dim, movedim back.
Cases share shapes so each backend compiles few programs (xla compiles per shape and argument).

`neuron` lowers one program holding the table's formats, rules, dtypes and axes for every
generation: the offline validator passes, the HLO holds only integer / bit-pattern opcodes and
element types (no FP8 / FP4, no float64, no custom call), the manifest records how MX was
lowered, and the written graph.hlo, run on XLA:CPU, gives the oracle's bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import itertools
import json
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import portable
from portable import mx
from portable.backends import Target
from portable.ir.program import Program, ProgramKind
from portable.ir.signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    Signature,
    TensorSpec,
)
from portable.mx.vectors import VECTORS, edge_blocks, fuzz

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN / Inf on purpose

FORMATS = list(mx.FORMATS)
RULES = list(mx.SCALE_RULES)
HALF = (torch.bfloat16, torch.float16)
FLOATS = (torch.float32, *HALF)
ROWS = 512  # blocks in the shared corpus (vectors + edge blocks + fuzz)
SIGN_MASK = {"e4m3": 0x80, "e5m2": 0x80, "e3m2": 0x20, "e2m3": 0x20, "e2m1": 0x88}
# one rule per format where a case does not depend on the rule (input dtype, axis)
RULE_OF = {fmt: RULES[i % len(RULES)] for i, fmt in enumerate(FORMATS)}

Q_OP = torch.ops.portable.mx_quantize.default
DQ_OP = torch.ops.portable.mx_dequantize.default


# ----------------------------------------------------------------------------- helpers


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN matches any NaN (payloads are unspecified)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = torch.isnan(a)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(ints), b[~nan].view(ints))


def unpacked(codes: torch.Tensor, fmt: str, axis: int = -1) -> torch.Tensor:
    return mx.unpack_fp4(codes, axis) if mx.FORMATS[fmt].packed else codes


@functools.cache
def corpus() -> torch.Tensor:
    """[ROWS, 32] fp32 blocks: row i < len(VECTORS) is VECTORS[i], then the edge blocks, then
    fuzz."""
    vectors = torch.tensor([v.block() for v in VECTORS], dtype=torch.float32)
    edges = edge_blocks()
    return torch.cat([vectors, edges, fuzz(2024, ROWS - len(vectors) - len(edges))])


def middle_axis_input(seed: int) -> torch.Tensor:
    """[4, 64, 3] fp32 whose blocks along dim 1 are fuzz blocks."""
    return fuzz(seed, 4 * 2 * 3).view(4, 3, 64).transpose(1, 2).contiguous()


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


def _program(name: str, inputs: list[TensorSpec], build) -> Program:
    """An inference Program over `inputs`: `build(graph, placeholders)` adds nodes and returns
    [(node, spec)] for the outputs."""
    graph = torch.fx.Graph()
    placeholders = []
    for i, spec in enumerate(inputs):
        node = graph.placeholder(f"in{i}")
        node.meta["tensor"] = spec
        placeholders.append(node)
    outputs = build(graph, placeholders)
    graph.output(tuple(node for node, _ in outputs))
    signature = Signature(
        tuple(
            InputSpec(n.name, InputKind.USER_INPUT, s)
            for n, s in zip(placeholders, inputs, strict=True)
        ),
        tuple(OutputSpec(f"out{i}", OutputKind.OUTPUT, s) for i, (_, s) in enumerate(outputs)),
    )
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    return Program(ProgramKind.INFERENCE, module, signature, {}, metadata={"name": name})


def add_quantize(graph, x, x_spec: TensorSpec, fmt, axis, rule, block_size=32):
    """mx_quantize node on `x`; returns [(codes, spec), (scales, spec)]."""
    lay = mx.check_quantize(x_spec.shape, x_spec.dtype, fmt, axis, rule, block_size)
    specs = (TensorSpec(lay.codes_shape, torch.uint8), TensorSpec(lay.scales_shape, torch.uint8))
    node = graph.call_function(Q_OP, (x, fmt, axis, rule, block_size))
    node.meta["tensor"] = specs
    items = []
    for i, spec in enumerate(specs):
        item = graph.call_function(operator.getitem, (node, i))
        item.meta["tensor"] = spec
        items.append((item, spec))
    return items


def add_dequantize(graph, codes, scales, codes_shape, fmt, axis, dtype, block_size=32):
    lay = mx.dequantize_layout(codes_shape, fmt, axis, dtype, block_size)
    node = graph.call_function(DQ_OP, (codes, scales, fmt, axis, dtype, block_size))
    node.meta["tensor"] = spec = TensorSpec(lay.shape, dtype)
    return node, spec


def quantize_program(shape, dtype, fmt, axis, rule, block_size=32) -> Program:
    spec = TensorSpec(tuple(shape), dtype)
    return _program(
        "mx_quantize",
        [spec],
        lambda g, ph: add_quantize(g, ph[0], spec, fmt, axis, rule, block_size),
    )


def dequantize_program(codes_shape, scales_shape, fmt, axis, dtype, block_size=32) -> Program:
    inputs = [TensorSpec(tuple(shape), torch.uint8) for shape in (codes_shape, scales_shape)]
    return _program(
        "mx_dequantize",
        inputs,
        lambda g, ph: [add_dequantize(g, *ph, tuple(codes_shape), fmt, axis, dtype, block_size)],
    )


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

    return _program("mx_quantize_table", [spec], build)


def dequantize_table_program(codes_shape, scales_shape, axis, formats, dtypes, block_size=32):
    """One (codes, scales) pair dequantized as each format x dtype (format-major)."""
    inputs = [TensorSpec(tuple(shape), torch.uint8) for shape in (codes_shape, scales_shape)]

    def build(g, ph):
        return [
            add_dequantize(g, *ph, tuple(codes_shape), fmt, axis, dtype, block_size)
            for fmt in formats
            for dtype in dtypes
        ]

    return _program("mx_dequantize_table", inputs, build)


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


def _neuron_lower(variant: str = "trn3"):
    from portable.backends.neuron import NeuronBackend

    def lower(program: Program):
        return NeuronBackend().lower(program, Target("neuron", variant))

    return lower


@dataclasses.dataclass(frozen=True)
class MXBackend:
    """One implementation under test, built on first use (heavy imports happen then).

    kind "run": `make()` returns `(quantize, dequantize)` with the signatures of `portable.mx`
    (`quantize(x, fmt, axis, rule, block_size) -> (codes, scales)`, `dequantize(codes, scales,
    fmt, axis, dtype, block_size) -> values`). kind "lower": `make()` returns `lower(program)`,
    which raises when the backend cannot compile the program."""

    kind: str
    make: Callable[[], Any]
    requires: str | None = None  # a module that must be importable, else the cases skip
    dequantize_dtypes: tuple[torch.dtype, ...] = (*FLOATS, torch.float64)


BACKENDS: dict[str, MXBackend] = {
    "cpu": MXBackend("run", lambda: compiled("cpu")),
    "xla": MXBackend("run", lambda: compiled("xla"), requires="jax"),
    "triton": MXBackend("run", _triton_kernels, requires="triton"),
    "neuron": MXBackend("lower", _neuron_lower, requires="jax"),
    "onnx": MXBackend(
        "run", lambda: batched("onnx", (*FLOATS, torch.float64)), requires="onnxruntime"
    ),
}
RUN = [name for name, b in BACKENDS.items() if b.kind == "run"]


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


# ----------------------------------------------------------------------------- neuron (lower only)

# what the MX rules emit (besides the graph's parameters and root tuple)
EMULATED_OPCODES = frozenset(
    """
    parameter constant broadcast reshape slice concatenate tuple bitcast-convert convert
    and or xor add subtract negate abs shift-left shift-right-arithmetic shift-right-logical
    compare select clamp maximum minimum reduce
    """.split()
)
EMULATED_TYPES = frozenset({"f32", "bf16", "f16", "s32", "u16", "u8", "pred"})


def _neuron_program() -> tuple[Program, list[torch.Tensor]]:
    """Quantize (every format and rule, float32 / bfloat16 / float16 input, last and middle
    axis) and dequantize (to float32 / bfloat16 / float16) in one program, with its inputs."""
    x32 = corpus()
    x3 = middle_axis_input(78)
    inputs = [x32, x32.to(torch.bfloat16), x32.to(torch.float16), x3]
    specs = [TensorSpec.of(t) for t in inputs]

    def build(g, ph):
        outs = []
        for fmt in FORMATS:
            for rule in RULES:
                outs += add_quantize(g, ph[0], specs[0], fmt, -1, rule)
            for k, dtype in ((1, torch.bfloat16), (2, torch.float16)):
                (codes, cs), (scales, _) = add_quantize(g, ph[k], specs[k], fmt, -1, RULE_OF[fmt])
                outs += [(codes, cs)]
                outs.append(add_dequantize(g, codes, scales, cs.shape, fmt, -1, dtype))
            (codes, cs), (scales, ss) = add_quantize(g, ph[3], specs[3], fmt, 1, RULE_OF[fmt])
            outs += [(codes, cs), (scales, ss)]
            outs.append(add_dequantize(g, codes, scales, cs.shape, fmt, 1, torch.float32))
        return outs

    return _program("mx_table", specs, build), inputs


def _oracle(program: Program, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = portable.compile(program, "cpu")(*inputs)
    return list(out) if isinstance(out, tuple) else [out]


def _run_hlo(proto: bytes, flat: list[torch.Tensor]) -> list[torch.Tensor]:
    """Compile a serialized HloModuleProto with jaxlib's CPU client and run it."""
    import jax
    import ml_dtypes
    from jax._src.lib import xla_client

    computation = xla_client.XlaComputation(proto)
    module = xla_client._xla.mlir.xla_computation_to_mlir_module(computation)
    device = jax.devices("cpu")[0]
    options = xla_client.CompileOptions()
    options.executable_build_options.debug_options.xla_backend_optimization_level = 0  # as `xla`
    executable = device.client.compile_and_load(module, xla_client.DeviceList((device,)), options)

    def to_numpy(t):
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def to_torch(a):
        a = np.array(a, copy=True)
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    args = [jax.device_put(to_numpy(t), device) for t in flat]
    results = executable.execute_sharded(args).disassemble_into_single_device_arrays()
    return [to_torch(r[0]) for r in results]


@pytest.fixture(scope="module")
def neuron_table(tmp_path_factory):
    from portable.backends.neuron import NeuronBackend

    lower = backend("neuron")
    program, inputs = _neuron_program()
    lowered = lower(program)  # raises NeuronValidationError on any validator error
    out = tmp_path_factory.mktemp("neuron_mx")
    NeuronBackend().write(lowered, out)
    return program, inputs, lowered, out


def test_neuron_lowers_the_table_to_integer_hlo(neuron_table):
    from portable.backends.neuron.hlo import parse_hlo_text

    program, _, lowered, _ = neuron_table
    record = lowered.payload.programs[0]
    assert not record.findings, [f.to_json() for f in record.findings]
    module = parse_hlo_text(lowered.texts["graph.hlo.txt"])
    opcodes = {ins.opcode for ins in module.instructions()}
    types = set().union(*(ins.elements for ins in module.instructions()))
    assert opcodes <= EMULATED_OPCODES, sorted(opcodes - EMULATED_OPCODES)
    assert types <= EMULATED_TYPES, sorted(types - EMULATED_TYPES)  # no f64 / FP8 / FP4


@pytest.mark.parametrize("variant", ["trn2", "trn1"])
def test_neuron_lowers_mx_for_every_generation(variant):
    backend("neuron")
    program = quantize_program((4, 64), torch.bfloat16, "e2m1", -1, "rceil")
    lowered = _neuron_lower(variant)(program)
    assert not lowered.payload.programs[0].findings


def test_neuron_manifest_records_the_mx_lowering(neuron_table):
    program, _, _, out = neuron_table
    manifest = json.loads((out / "manifest.json").read_text())
    n = sum(1 for node in program.graph.nodes if node.target in (Q_OP, DQ_OP))
    assert manifest["mx"]["ops"] == n
    assert manifest["mx"]["by_op"] == {
        "portable.mx_dequantize.default": sum(1 for x in program.graph.nodes if x.target == DQ_OP),
        "portable.mx_quantize.default": sum(1 for x in program.graph.nodes if x.target == Q_OP),
    }
    assert manifest["mx"]["lowering"] == "emulated-hlo"
    assert "QuantizeMX" in manifest["mx"]["reason"]


def test_neuron_manifest_has_no_mx_field_without_mx_ops(tmp_path):
    backend("neuron")
    spec = TensorSpec((4, 8), torch.float32)

    def build(g, ph):
        node = g.call_function(torch.ops.aten.neg.default, (ph[0],))
        node.meta["tensor"] = spec
        return [(node, spec)]

    portable.lower(_program("neg", [spec], build), "neuron:trn3", tmp_path)
    assert "mx" not in json.loads((tmp_path / "manifest.json").read_text())


def test_neuron_hlo_computes_the_oracle_bytes(neuron_table):
    program, inputs, lowered, _ = neuron_table
    got = _run_hlo(lowered.payload.programs[0].hlo, inputs)
    want = _oracle(program, inputs)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert same_bits(g, w) if w.is_floating_point() else torch.equal(g, w), i
