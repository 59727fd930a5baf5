"""MX quantize / dequantize lowered for `neuron` (no NeuronCore here: lower only).

One program holds the table's formats, rules, dtypes and axes (tests/test_mx_backends.py runs
the same table on the run backends); it lowers for every generation, the offline validator
passes, the HLO holds only integer / bit-pattern opcodes and element types (no FP8 / FP4, no
float64, no custom call), the manifest records how MX was lowered, and the written graph.hlo,
run on XLA:CPU, gives the oracle's bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import portable
from portable.backends import Target
from portable.ir.program import Program
from portable.ir.signature import TensorSpec
from tests.support.mx_programs import (
    DQ_OP,
    FORMATS,
    Q_OP,
    RULE_OF,
    RULES,
    add_dequantize,
    add_quantize,
    build_program,
    corpus,
    middle_axis_input,
    quantize_program,
    same_bits,
)

pytest.importorskip("jax")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN / Inf on purpose


def _lower(program: Program, variant: str = "trn3"):
    from portable.backends.neuron import NeuronBackend

    return NeuronBackend().lower(program, Target("neuron", variant))


# what the MX rules emit (besides the graph's parameters and root tuple)
EMULATED_OPCODES = frozenset(
    """
    parameter constant broadcast reshape slice concatenate tuple bitcast-convert convert
    and or xor add subtract negate abs shift-left shift-right-arithmetic shift-right-logical
    compare select clamp maximum minimum reduce
    """.split()
)
EMULATED_TYPES = frozenset({"f32", "bf16", "f16", "s32", "u16", "u8", "pred"})


def neuron_table_program() -> tuple[Program, list[torch.Tensor]]:
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

    return build_program("mx_table", specs, build), inputs


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

    program, inputs = neuron_table_program()
    lowered = _lower(program)  # raises NeuronValidationError on any validator error
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
    program = quantize_program((4, 64), torch.bfloat16, "e2m1", -1, "rceil")
    lowered = _lower(program, variant)
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
    spec = TensorSpec((4, 8), torch.float32)

    def build(g, ph):
        node = g.call_function(torch.ops.aten.neg.default, (ph[0],))
        node.meta["tensor"] = spec
        return [(node, spec)]

    portable.lower(build_program("neg", [spec], build), "neuron:trn3", tmp_path)
    assert "mx" not in json.loads((tmp_path / "manifest.json").read_text())


def test_neuron_hlo_computes_the_oracle_bytes(neuron_table):
    program, inputs, lowered, _ = neuron_table
    got = _run_hlo(lowered.payload.programs[0].hlo, inputs)
    want = _oracle(program, inputs)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert same_bits(g, w) if w.is_floating_point() else torch.equal(g, w), i
