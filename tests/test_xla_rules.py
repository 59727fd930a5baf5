"""OpInfo-style table for the `xla` lowering rules: every opset op, forward and backward.

The cases live in tests/xla_cases.py (builders; core ATen ops) and tests/xla_nn_cases.py (nn,
`portable::` and symbolic ops); this module holds the policy, the harness and the tests.

Each case builds small inputs, runs the op's torch overload eagerly (the `cpu` reference), wraps
the same call in a one-node Program and runs it through the backend's three stages (capability
check and lowering, XLA compile, run), then compares every output: exactly for integer and bool results and for `EXACT` ops (shape, layout,
indexing, creation), to per-dtype tolerances otherwise (`TOLERANCES`, loosened per case only with
a reason). `EXCLUDED` is the one reviewed list of ops without a rule; tests check that the table
and the exclusions together are the whole opset, and that the backend's declared capabilities
are exactly the ops this table runs. The rules are shared with `neuron`, which has no float64, so
a case whose inputs and outputs have no float64 must lower without any.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import portable
from portable.backends import Target
from portable.backends.xla import XlaBackend
from portable.backends.xla.rules import load_rules, names
from portable.ir.program import Program, ProgramKind
from portable.ir.signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    Signature,
    TensorSpec,
)
from portable.opset import opset_table

pytest.importorskip("jax")

# the case table lives beside this file, split by op family
sys.path.insert(0, str(Path(__file__).resolve().parent))
from xla_cases import (  # noqa: E402
    _CREATION,
    _ELEMENTWISE,
    _LOSSES,
    _MATMUL,
    _REDUCTIONS,
    _SHAPE,
    BF16,
    F32,
    F64,
    A,
    Call,
    Case,
    aten,
    t,
)
from xla_linalg_cases import _LINALG  # noqa: E402
from xla_math_cases import _MATH  # noqa: E402
from xla_nn2_cases import _NN_2, EXACT_NN  # noqa: E402
from xla_nn_cases import _NN, _PORTABLE, _SYMBOLIC  # noqa: E402
from xla_reduction_cases import _REDUCTIONS_2, EXACT_REDUCTIONS  # noqa: E402
from xla_selection_cases import _SELECTION  # noqa: E402
from xla_spatial_cases import _SPATIAL  # noqa: E402
from xla_special_cases import _SPECIAL, EXACT_SPECIAL  # noqa: E402

# ops with no rule yet, and why (reviewed: adding an op to the opset must add a case or a line here)
_ZETA = "Hurwitz zeta at q < 0: torch sums in double, a float32 sum cancels (2e-5 off)"
_KERNEL = "cpu and cuda only: {}"
EXCLUDED: dict[str, str] = {
    "aten.linalg_matrix_exp.default": _KERNEL.format(
        "scaling and squaring amplifies float32 rounding to 6e-4 relative at norm ~28"
    ),
    "aten.linalg_ldl_factor_ex.default": _KERNEL.format("LAPACK sytrf's Bunch-Kaufman pivots"),
    "aten.linalg_ldl_solve.default": _KERNEL.format("the factors of sytrf, which xla cannot make"),
    "aten._upsample_bilinear2d_aa.default": _KERNEL.format("no antialiased resampling rule yet"),
    "aten._upsample_bilinear2d_aa_backward.default": _KERNEL.format("its forward has no rule"),
    "aten.special_zeta.default": _ZETA,
    "aten.special_zeta.self_scalar": _ZETA,
    "aten.special_zeta.other_scalar": _ZETA,
}

# (rtol, atol) by dtype. float32: ~1e-6 (a few ulps of O(1) values after short sums);
# bfloat16: one bf16 ulp (2^-8 relative), as torch and XLA may round an intermediate differently.
TOLERANCES = {F32: (1e-6, 1e-6), F64: (1e-12, 1e-12), BF16: (1.6e-2, 1e-2)}

# ops whose results must match exactly whatever the dtype (no arithmetic, or integer arithmetic)
EXACT = (
    {
        name
        for name in opset_table()
        if opset_table()[name].shape in ("view", "index", "concat", "creation")
        or name.startswith(("aten.sym_size", "sym."))
    }
    | {
        "aten.clone.default",
        "aten.alias.default",
        "aten._to_copy.default",
        "aten.lift_fresh_copy.default",
        "aten.full_like.default",
        "aten.zeros_like.default",
        "aten.ones_like.default",
        "aten.slice_scatter.default",
        "aten.select_scatter.default",
        "aten.scatter.src",
        "aten.scatter.value",
        "aten.tril.default",
        "aten.triu.default",
        "aten.max.dim",
        "aten.amax.default",
        "aten.amin.default",
        "aten.topk.default",
        "aten.max_pool2d_with_indices.default",
        "portable.wait.default",
        "portable.mx_dequantize.default",  # exact: element * 2^(scale - 127), rounded once
        "portable.all_reduce.default",
        "portable.all_gather.default",
        "portable.reduce_scatter.default",
        "portable.all_to_all.default",
        "portable.local_shard.default",
    }
    | EXACT_REDUCTIONS
    | EXACT_NN
    | EXACT_SPECIAL
) - {
    "aten.embedding_dense_backward.default",  # sums rows
    "aten.index_put.default",  # accumulate=True sums duplicates
    "aten.arange.start_step",  # float aranges: torch rounds each SIMD block's base, within an ulp
}


CASES = [
    *_ELEMENTWISE,
    *_MATH,
    *_REDUCTIONS,
    *_REDUCTIONS_2,
    *_LOSSES,
    *_MATMUL,
    *_SHAPE,
    *_CREATION,
    *_NN,
    *_NN_2,
    *_PORTABLE,
    *_SYMBOLIC,
    *_SPECIAL,
    *_SELECTION,
    *_SPATIAL,
    *_LINALG,
]


# --------------------------------------------------------------------------- harness


def _spec(value):
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (tuple, list)):
        return tuple(_spec(v) for v in value)
    return None


def _program(name: str, build: Callable[[torch.fx.Graph, Callable], list], inputs: list) -> Program:
    """A one-op inference Program: `build(graph, lift)` adds the op (lift turns a tensor into a
    placeholder) and returns [(node, value)] for the outputs."""
    graph = torch.fx.Graph()
    placeholders = []

    def lift(value):
        if isinstance(value, torch.Tensor):
            node = graph.placeholder(f"in{len(placeholders)}")
            node.meta["tensor"] = TensorSpec.of(value)
            placeholders.append((node, value))
            inputs.append(value)
            return node
        if isinstance(value, (list, tuple)):
            return type(value)(lift(v) for v in value)
        return value

    outputs = build(graph, lift)
    graph.output(tuple(node for node, _ in outputs))
    signature = Signature(
        tuple(InputSpec(n.name, InputKind.USER_INPUT, TensorSpec.of(v)) for n, v in placeholders),
        tuple(
            OutputSpec(f"out{i}", OutputKind.OUTPUT, TensorSpec.of(v))
            for i, (_, v) in enumerate(outputs)
        ),
    )
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    return Program(ProgramKind.INFERENCE, module, signature, {}, metadata={"name": name})


def _op_program(case: Case, call: Call, result, inputs: list) -> Program:
    target = opset_table()[case.op].overload

    def build(graph, lift):
        node = graph.call_function(
            target, lift(call.args), {k: lift(v) for k, v in call.kwargs.items()}
        )
        node.meta["tensor"] = _spec(result)
        if not isinstance(result, (tuple, list)):
            return [(node, result)]
        outs = []
        for i, value in enumerate(result):
            if value is not None:  # an output the op's mask did not ask for
                item = graph.call_function(operator.getitem, (node, i))
                item.meta["tensor"] = TensorSpec.of(value)
                outs.append((item, value))
        return outs

    return _program(case.op, build, inputs)


def _symbolic_program(case: Case, call: Call, inputs: list) -> Program:
    x, *rest = call.args
    size = opset_table()["aten.sym_size.int"].overload

    def build(graph, lift):
        node = lift(x)
        if case.op == "aten.sym_size.int":
            n = graph.call_function(size, (node, *rest))
        else:
            a, b = (graph.call_function(size, (node, dim)) for dim in (0, 1))
            n = graph.call_function(opset_table()[case.op].overload, (a, b))
        out = graph.call_function(aten.full.default, ([n, 2], 1.0))
        value = torch.ones(_symbolic_value(case, call), 2)
        out.meta["tensor"] = TensorSpec.of(value)
        return [(out, value)]

    return _program(case.op, build, inputs)


def _symbolic_value(case: Case, call: Call) -> int:
    x, *rest = call.args
    if case.op == "aten.sym_size.int":
        return x.shape[rest[0]]
    return opset_table()[case.op].overload(x.shape[0], x.shape[1])


def _flat(result) -> list:
    if isinstance(result, (tuple, list)):
        return [r for r in result if r is not None]
    return [result]


def _assert_match(case: Case, got, want) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{TensorSpec.of(got)} vs {TensorSpec.of(want)}"
    )
    if case.meta_only:
        return
    if case.op in EXACT or not want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        return
    rtol, atol = case.tol if case.tol and want.dtype == F32 else TOLERANCES[want.dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)


def _params():
    for case in CASES:
        for dtype in case.dtypes:
            name = f"{case.op}-{case.label}-{str(dtype).removeprefix('torch.')}".replace("--", "-")
            yield pytest.param(case, dtype, id=name)


@pytest.mark.parametrize(("case", "dtype"), list(_params()))
def test_rule_matches_eager_torch(case: Case, dtype):
    torch.manual_seed(0)
    call = case.make(dtype)
    inputs: list[torch.Tensor] = []
    if case.op in {c.op for c in _SYMBOLIC}:
        program = _symbolic_program(case, call, inputs)
        want = [portable.compile(program, backend="cpu")(*inputs)]
    else:
        result = opset_table()[case.op].overload(*call.args, **call.kwargs)
        program = _op_program(case, call, result, inputs)
        want = _flat(result)
    backend = XlaBackend()
    lowered = backend.lower(program, Target("xla"))
    if F64 not in {v.dtype for v in (*inputs, *want)}:
        # the rules are shared with neuron, which has no float64: none may appear on its own
        assert "f64" not in lowered.texts["graph.stablehlo.mlir"]
    got = backend.executable(backend.write(lowered))(*inputs)
    got = list(got) if isinstance(got, tuple) else [got]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        _assert_match(case, g, w)


# --------------------------------------------------------------------------- coverage and claims


def test_table_and_exclusions_are_the_whole_opset():
    covered = {c.op for c in CASES}
    opset = set(opset_table())
    assert not covered & set(EXCLUDED), "an op is both tested and excluded"
    assert covered | set(EXCLUDED) == opset, (
        f"ops without a case: {sorted(opset - covered - set(EXCLUDED))}"
    )


def test_every_op_has_a_rule_except_the_excluded():
    rules = load_rules()
    assert rules.names("xla") == set(opset_table()) - set(EXCLUDED)
    # neuron shares the generic rules; the xla-only ones (names.ONLY["xla"]: linalg) it lacks
    assert rules.names("neuron") >= rules.names("xla") - names.ONLY["xla"]


def test_capabilities_are_what_the_table_runs():
    # every case above runs and passes through the xla backend's lower/compile/run, so the
    # declared ops must be exactly the table's ops: no claim without a case, no case unclaimed
    assert XlaBackend().capabilities().ops == frozenset(c.op for c in CASES)


def test_mx_arguments_are_refused_with_the_op_backend_and_fix():
    x = torch.randn(4, 48)  # 48 along axis 1 is not a multiple of the block size 32
    with FakeTensorMode() as mode:
        codes, scales = torch.ops.portable.mx_quantize(mode.from_tensor(x), "e4m3", 1)
    inputs: list = []
    case = Case("portable.mx_quantize.default", lambda d: A(x, "e4m3", 1))
    program = _op_program(case, case.make(F32), (codes, scales), inputs)
    with pytest.raises(portable.LoweringError) as info:
        portable.compile(program, backend="xla")
    message = str(info.value)
    assert info.value.backend == "xla" and "portable.mx_quantize.default" in message
    assert "48 is not a multiple of 32" in message and "fix: pad dim 1" in message


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("all_reduce", ("sum", "dp", 2)),
        ("all_gather", (0, "tp", 2)),
        ("reduce_scatter", ("sum", 0, "tp", 2)),
        ("all_to_all", (0, 1, "ep", 2)),
        ("local_shard", (0, "tp", 2)),
    ],
)
def test_multi_rank_collectives_need_the_spmd_pass(op, args):
    x = torch.randn(4, 6)
    with FakeTensorMode() as mode:
        fake = getattr(torch.ops.portable, op)(mode.from_tensor(x), *args)
    result = torch.empty(fake.shape, dtype=fake.dtype)
    case = Case(f"portable.{op}.default", lambda d: A(x, *args))
    inputs: list = []
    program = _op_program(case, case.make(F32), result, inputs)
    with pytest.raises(portable.LoweringError) as info:
        portable.compile(program, backend="xla")
    message = str(info.value)
    assert f"{op} over mesh axis" in message and "group_size 2" in message
    assert "spmd-partition" in message


def test_boolean_mask_indexing_is_refused_with_a_fix():
    x, mask = torch.randn(4, 5), torch.randn(4, 5) > 0
    case = Case("aten.index.Tensor", lambda d: A(x, [mask]))
    inputs: list = []
    program = _op_program(case, case.make(F32), aten.index.Tensor(x, [mask]), inputs)
    with pytest.raises(portable.LoweringError) as info:
        portable.compile(program, backend="xla")
    assert "data-dependent shape" in str(info.value) and "torch.where" in str(info.value)


@pytest.mark.parametrize("op", ["_softmax", "_log_softmax"])
def test_half_to_float_softmax_returns_float32(op):
    # torch's CPU kernels refuse half_to_float (a CUDA fast path), so the reference is its meaning:
    # the softmax of the float32 upcast input, returned in float32
    x = t(BF16, 3, 5) * 3
    want = getattr(torch, op.lstrip("_"))(x.float(), -1)
    case = Case(f"aten.{op}.default", lambda d: A(x, -1, True))
    inputs: list = []
    program = _op_program(case, case.make(BF16), want, inputs)
    got = portable.compile(program, backend="xla")(*inputs)
    assert got.dtype == F32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
