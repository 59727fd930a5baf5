"""The IR verifier: every node against the opset and the program invariants.

Checks, per node: the op is in the opset; its arguments are graph values or plain data (no Python
callables or closures); its shape and dtype are recorded and static (ints, or declared symbolic
dims); its recorded result equals the op's shape rule applied to its recorded inputs (evaluated
with the op's fake kernel); its input dtypes are ones the op declares. Per program: placeholders
match the signature, the output tuple matches the signature, every state input has a weight of the
recorded shape and dtype (the global shape in a per-rank program: it keeps the global weights); a
per-rank program's layout (`Program.spmd`) names every signature input and output in order, and
each one's sharding over its local shape gives its global shape.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._sympy.value_ranges import ValueRanges

from .errors import VerifyError
from .ir.fake_calls import FakeCalls
from .ir.plan import Mesh
from .ir.program import Program
from .ir.signature import InputSpec, OutputSpec, TensorSpec
from .ir.source import source_of
from .ir.spmd import TensorLayout
from .ir.symbolic import DimBounds, SizeExprError, parse_size
from .opset import OpDef, lookup, op_name

__all__ = ["verify"]

_NOT_IN_OPSET = (
    "rewrite that line with supported ops (`portable ops` lists them), or ask for the op to be "
    "added to the opset"
)
_RANDOM = (
    "torch's RNG cannot be reproduced across backends: in a training capture, dropout "
    "(F.dropout, nn.Dropout, SDPA's dropout_p) draws from the program's counter-based "
    "generator; draw other noise with portable.random.uniform(...), or set p=0 / model.eval()"
)
_HINTS = {
    "aten.native_dropout.default": _RANDOM,
    "aten.bernoulli.p": _RANDOM,
    "aten.bernoulli.default": _RANDOM,
    "aten.rand.default": _RANDOM,
    "aten.randn.default": _RANDOM,
    "aten.rand_like.default": _RANDOM,
    "aten.randn_like.default": _RANDOM,
    "aten.randint.low": _RANDOM,
    "aten.randperm.default": _RANDOM,
    "aten.normal.Tensor_float": _RANDOM,
    "aten.uniform.default": _RANDOM,
    "aten.nonzero.default": "nonzero has a value-dependent shape: use a mask with torch.where",
    "aten._local_scalar_dense.default": "avoid .item() / float(tensor) in forward: keep values as tensors",
}

_PLAIN = (
    int,
    float,
    bool,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def _fail(
    what: str, node: torch.fx.Node | None = None, fix: str | None = None, op: str | None = None
) -> NoReturn:
    src = source_of(node) if node is not None else None
    raise VerifyError(
        what,
        op=op
        or (op_name(node.target) if node is not None and node.op == "call_function" else None),
        module=src.module if src else None,
        source=src.location() if src else None,
        fix=fix,
    )


def _check_arg(node: torch.fx.Node, value: object) -> None:
    if isinstance(value, torch.fx.Node) or isinstance(value, _PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_arg(node, v)
        return
    _fail(
        f"node {node.name} has a non-data argument of type {type(value).__name__}",
        node,
        fix="graphs may only hold tensors, numbers, strings, dtypes and lists of them; "
        "Python callables and closures cannot be serialized or lowered",
    )


def _specs(meta: object) -> list[TensorSpec]:
    if isinstance(meta, TensorSpec):
        return [meta]
    if isinstance(meta, tuple):
        return [m for m in meta if isinstance(m, TensorSpec)]
    return []


def _free_symbols(dim: str) -> set[str]:
    """Names in a size expression such as `s75*s95` or `2*s3 + 1`."""
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", dim))


def _check_static(node: torch.fx.Node, symbols: set[str]) -> None:
    for spec in _specs(node.meta.get("tensor")):
        for dim in spec.shape:
            if not isinstance(dim, str) or _free_symbols(dim) <= symbols:
                continue
            if any(re.fullmatch(r"u\d+", name) for name in _free_symbols(dim) - symbols):
                # torch's unbacked symbols: a size that depends on the values (x[mask], nonzero)
                _fail(
                    f"node {node.name} has a shape that depends on the input's values ({dim!r}); "
                    "no backend takes data-dependent shapes",
                    node,
                    fix="keep the shape static: torch.where(mask, x, 0) instead of x[mask], or a "
                    "fixed-size selection such as torch.topk",
                )
            _fail(
                f"node {node.name} has an undeclared symbolic dim {dim!r}",
                node,
                fix="declare it with dynamic_shapes=... at capture, or capture with static shapes",
            )


def verify(program: Program, *, check_shapes: bool = True) -> None:
    """Raise VerifyError on the first violation; return None when the program is valid."""
    graph = program.graph
    sig = program.signature
    symbols = set(program.metadata.get("symbolic_dims", []))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if [p.name for p in placeholders] != [i.name for i in sig.inputs]:
        _fail(
            "graph placeholders do not match the signature inputs",
            fix=f"placeholders {[p.name for p in placeholders]} vs signature {[i.name for i in sig.inputs]}",
        )
    _check_spmd(program)
    # a per-rank program (spmd-partition) keeps the global weights; runtimes shard them
    global_shapes = {t.name: t.global_shape for t in program.spmd.inputs} if program.spmd else {}
    for spec in sig.state_inputs:
        weight = program.weights.get(spec.key)
        if weight is None:
            _fail(
                f"state input {spec.name} ({spec.key}) has no weight",
                fix="re-capture the program",
            )
        expected = spec.spec
        if spec.name in global_shapes:
            expected = TensorSpec(tuple(global_shapes[spec.name]), spec.spec.dtype)
        if TensorSpec.of(weight) != expected:
            _fail(f"weight {spec.key} is {TensorSpec.of(weight)}, signature says {expected}")
    outputs = graph.output_node().args[0]
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(sig.outputs):
        _fail("the graph output does not match the signature outputs")

    for node in graph.nodes:
        if node.op in ("get_attr", "call_module", "call_method"):
            _fail(
                f"node {node.name} is a {node.op}",
                node,
                fix="programs hold only call_function nodes over the opset",
            )
        if node.op != "call_function":
            continue
        if node.target is not operator.getitem and lookup(node.target) is None:
            name = op_name(node.target)
            _fail(
                f"op {name} is not in the portable opset", node, fix=_HINTS.get(name, _NOT_IN_OPSET)
            )
        for value in (*node.args, *node.kwargs.values()):
            _check_arg(node, value)
        if "tensor" not in node.meta:
            _fail(
                f"node {node.name} has no recorded shape and dtype",
                node,
                fix="re-capture the program",
            )
        _check_static(node, symbols)
    if check_shapes:
        _check_shape_rules(program)


def _check_spmd(program: Program) -> None:
    """The layout covers the signature, and sharding(local shape) is the global shape."""
    layout = program.spmd
    if layout is None:
        return
    _check_side("input", program.signature.inputs, layout.inputs, layout.mesh)
    _check_side("output", program.signature.outputs, layout.outputs, layout.mesh)


def _check_side(
    kind: str,
    specs: Sequence[InputSpec | OutputSpec],
    layouts: Sequence[TensorLayout],
    mesh: Mesh,
) -> None:
    """The layout's inputs (or outputs) are the signature's, in order, each one consistent."""
    if [s.name for s in specs] != [t.name for t in layouts]:
        _fail(
            f"the spmd layout's {kind}s {[t.name for t in layouts]} are not the signature's "
            f"{[s.name for s in specs]}",
            fix="the layout is written by spmd-partition; re-run it on the global program",
        )
    for spec, t in zip(specs, layouts, strict=True):
        _check_layout(kind, spec.spec.shape, t, mesh)


def _check_layout(kind: str, local: tuple[int | str, ...], t: TensorLayout, mesh: Mesh) -> None:
    if len(local) != t.sharding.ndim or not all(isinstance(d, int) for d in local):
        _fail(
            f"{kind} `{t.name}` has local shape {list(local)}, its sharding {t.sharding} "
            f"has {t.sharding.ndim} static dims",
            fix="a per-rank program has static shapes; re-run spmd-partition",
        )
    glob = t.sharding.global_shape([int(d) for d in local], mesh)
    if glob != t.global_shape:
        _fail(
            f"{kind} `{t.name}`: local shape {list(local)} sharded {t.sharding} is global "
            f"{list(glob)}, the spmd layout says {list(t.global_shape)}",
            fix="a bug in the pass that wrote the layout: report it",
        )


def _check_shape_rules(program: Program) -> None:
    """Re-derive each node's shape and dtype with the op's fake kernel from recorded inputs.

    Declared dynamic dims become symbolic sizes (a ShapeEnv, as torch.export uses), so a
    program with dynamic shapes is checked as fully as a static one."""
    dims: dict[str, DimBounds] = program.metadata.get("symbolic_dims", {})
    shape_env = ShapeEnv() if dims else None
    mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=shape_env)
    symbols = {} if shape_env is None else {n: _symbol(shape_env, n, b) for n, b in dims.items()}
    env: dict[torch.fx.Node, Any] = {}  # node -> its fake value (tensor, tuple, SymInt)
    calls = FakeCalls(mode)  # a deep model's layers repeat the same calls

    def fake(node: torch.fx.Node, spec: TensorSpec) -> torch.Tensor:
        shape = [_size(node, d, symbols) for d in spec.shape]
        with mode:
            return torch.empty(shape, dtype=spec.dtype)

    def load(value: torch.fx.node.Argument) -> Any:
        """`value` with each node replaced by its fake value."""
        return torch.fx.node.map_arg(value, lambda n: env[n])

    for node in program.graph.nodes:
        if node.op == "placeholder":
            env[node] = fake(node, node.meta["tensor"])
        elif node.op == "call_function":
            args, kwargs = load(node.args), load(node.kwargs)
            if node.target is operator.getitem:
                env[node] = _getitem(node, args)
                continue
            entry = lookup(node.target)
            assert entry is not None, "verify() refuses ops outside the opset before this"
            _check_dtypes(node, entry, args, kwargs)
            try:
                result = calls(node.target, args, kwargs)
            except Exception as exc:
                _fail(f"the shape rule of {entry.name} rejects node {node.name}: {exc}", node)
            _check_scalar(node, result)
            recorded = node.meta["tensor"]
            if not _same(recorded, _to_spec(result), result, symbols):
                _fail(
                    f"node {node.name} records {_fmt(recorded)} but {entry.name}'s shape rule "
                    f"gives {_fmt(_to_spec(result))}",
                    node,
                    fix="a pass changed this node without updating meta['tensor']",
                )
            env[node] = result


_MAX_SIZE = 1 << 62


def _symbol(shape_env: ShapeEnv, name: str, bounds: DimBounds) -> torch.SymInt:
    """A SymInt named `name` with the declared range; its hint (the value torch guards
    on while checking) is inside the range and not 0 or 1, which torch specializes."""
    low, top = int(bounds.get("min", 0)), bounds.get("max")
    high = _MAX_SIZE if top is None else int(top)
    hint = min(max(low, 7), high)
    sym = _sym(name)
    shape_env.backed_var_to_val[sym] = sympy.Integer(hint)
    shape_env.var_to_range[sym] = ValueRanges(low, high)
    size = shape_env.create_symintnode(sym, hint=hint)
    assert isinstance(size, torch.SymInt), "a free symbol does not simplify to an int"
    return size


def _sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, nonnegative=True)


def _size(
    node: torch.fx.Node, dim: int | str, symbols: Mapping[str, torch.SymInt]
) -> int | torch.SymInt:
    if isinstance(dim, int):
        return dim
    try:
        return parse_size(dim).evaluate(symbols)
    except SizeExprError as exc:
        _fail(f"node {node.name} has a dim {dim!r} that cannot be evaluated: {exc}", node)


def _getitem(node: torch.fx.Node, args: tuple[Any, Any]) -> Any:
    try:
        return args[0][args[1]]
    except (TypeError, IndexError, KeyError):
        _fail(f"getitem {node.name} indexes a value that has no item {args[1]!r}", node)


def _check_scalar(node: torch.fx.Node, result: object) -> None:
    """Size arithmetic (`sym.*`) stays within tensor sizes, so a chain of them cannot grow
    an integer without bound."""
    if isinstance(result, int) and not isinstance(result, bool) and abs(result) > _MAX_SIZE:
        _fail(f"node {node.name} computes a size beyond 2**62", node)


def _same(
    recorded: object, derived: object, result: Any, symbols: Mapping[str, torch.SymInt]
) -> bool:
    """Recorded and derived specs agree; symbolic dims agree as expressions (the same text,
    or the same value at several points of the declared ranges)."""
    if recorded == derived:
        return True
    if not symbols or not isinstance(recorded, TensorSpec) or not isinstance(derived, TensorSpec):
        if isinstance(recorded, tuple) and isinstance(derived, tuple) and symbols:
            return len(recorded) == len(derived) and all(
                _same(r, d, v, symbols) for r, d, v in zip(recorded, derived, result, strict=True)
            )
        return False
    if recorded.dtype != derived.dtype or len(recorded.shape) != len(derived.shape):
        return False
    return all(
        _same_dim(r, size, symbols) for r, size in zip(recorded.shape, result.shape, strict=True)
    )


def _same_dim(
    recorded: int | str, size: int | torch.SymInt, symbols: Mapping[str, torch.SymInt]
) -> bool:
    expr = size.node.expr if isinstance(size, torch.SymInt) else int(size)
    expr = sympy.Integer(expr) if isinstance(expr, int) else expr
    for point in _sample_points(symbols):
        want = point[recorded] if isinstance(recorded, str) and recorded in point else None
        try:
            want = parse_size(str(recorded)).evaluate(point) if want is None else want
        except SizeExprError:
            return False
        got = expr.xreplace({_sym(k): sympy.Integer(v) for k, v in point.items()})
        if not got.is_Integer or int(got) != want:
            return False
    return True


def _sample_points(symbols: Mapping[str, torch.SymInt]) -> list[dict[str, int]]:
    """Three assignments of the declared symbols: the hints, the minimums, and primes
    inside the ranges (distinct values, so that s0*s1 and s0+s1 differ)."""
    points = []
    for pick in (
        lambda s, r, i: int(s.node.hint),
        lambda s, r, i: int(r.lower),
        lambda s, r, i: min(max(int(r.lower), _PRIMES[i % len(_PRIMES)]), int(r.upper)),
    ):
        point = {}
        for i, (name, sym) in enumerate(symbols.items()):
            rng = sym.node.shape_env.var_to_range[sym.node.expr]
            point[name] = pick(sym, rng, i)
        points.append(point)
    return points


_PRIMES = (11, 13, 17, 19, 23, 29, 31, 37)


# Operands (schema names) that an op's eager kernel requires to share one dtype, not promoting
# them, while its fake kernel does not check: a mixed node would verify and then fail at run
# time ("expected m1 and m2 to have the same dtype"). tests/test_capture_errors.py checks every
# entry against the eager kernel.
SAME_DTYPE_OPERANDS: dict[str, tuple[str, ...]] = {
    "aten.mm.default": ("self", "mat2"),
    "aten.bmm.default": ("self", "mat2"),
    "aten.addmm.default": ("self", "mat1", "mat2"),
    "aten.convolution.default": ("input", "weight"),
    "aten.convolution_backward.default": ("grad_output", "input", "weight"),
    "aten.index_put.default": ("self", "values"),
    "aten.nll_loss_forward.default": ("self", "weight"),
    "aten.nll_loss_backward.default": ("grad_output", "self", "weight", "total_weight"),
    "aten._softmax_backward_data.default": ("grad_output", "output"),
    "aten._log_softmax_backward_data.default": ("grad_output", "output"),
    "aten.native_layer_norm_backward.default": ("grad_out", "input"),
    "aten.native_batch_norm_backward.default": ("grad_out", "input"),
    "aten.avg_pool2d_backward.default": ("grad_output", "self"),
    "portable.attention.default": ("q", "k", "v"),
    "portable.attention_backward.default": ("q", "k", "v"),
}
# SDPA takes a bool mask, a float32 one, or one in the query's dtype
_MASKED = ("portable.attention.default", "portable.attention_backward.default")
_ONE_DTYPE_FIX = (
    "use one dtype for these operands: cast the inputs to the weights' dtype (x.to(torch.float32)) "
    "or the model to the inputs' (model.to(torch.float16))"
)


def _check_dtypes(
    node: torch.fx.Node,
    entry: OpDef,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
) -> None:
    """The node's first tensor input has a dtype the op declares; the operands of
    `SAME_DTYPE_OPERANDS` share one; an attention mask has one SDPA takes. `args` and
    `kwargs` are the node's fake (or example) values."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is not None and not entry.accepts(first.dtype):
        _fail(
            f"{entry.name} does not take {first.dtype} (declared dtypes: {entry.dtypes})",
            node,
            fix="cast the input to a supported dtype",
        )
    names = SAME_DTYPE_OPERANDS.get(entry.name, ())
    if not names:
        return
    operands = dict(zip((a.name for a in entry.overload._schema.arguments), args, strict=False))
    operands.update(kwargs or {})
    present = [(n, operands[n]) for n in names if isinstance(operands.get(n), torch.Tensor)]
    if len({t.dtype for _, t in present}) > 1:
        got = ", ".join(f"{n} is {t.dtype}" for n, t in present)
        _fail(
            f"{entry.name} needs one dtype for {', '.join(names)} (it does not promote them): {got}",
            node,
            fix=_ONE_DTYPE_FIX,
            op=entry.name,
        )
    mask = operands.get("mask") if entry.name in _MASKED else None
    allowed = (torch.bool, torch.float32, present[0][1].dtype) if present else ()
    if isinstance(mask, torch.Tensor) and mask.dtype not in allowed:
        _fail(
            f"{entry.name}'s mask is {mask.dtype}; it must be bool, float32 or the query's dtype "
            f"({present[0][1].dtype})",
            node,
            fix="cast the mask: mask.to(q.dtype), or pass a bool mask",
            op=entry.name,
        )


def _to_spec(value: object) -> TensorSpec | tuple[Any, ...] | None:
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (tuple, list)):
        return tuple(_to_spec(v) for v in value)
    return None


def _fmt(meta: object) -> str:
    if isinstance(meta, tuple):
        return "(" + ", ".join(_fmt(m) for m in meta) + ")"
    return str(meta)
