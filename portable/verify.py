"""The IR verifier: every node against the opset and the program invariants.

Checks, per node: the op is in the opset; its arguments are graph values or plain data (no Python
callables or closures); its shape and dtype are recorded and static (ints, or declared symbolic
dims); its recorded result equals the op's shape rule applied to its recorded inputs (evaluated
with the op's fake kernel); its input dtypes are ones the op declares. Per program: placeholders
match the signature, the output tuple matches the signature, every state input has a weight of the
recorded shape and dtype.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from .errors import VerifyError
from .ir.program import Program
from .ir.signature import TensorSpec
from .ir.source import source_of
from .opset import lookup, op_name

__all__ = ["verify"]

_NOT_IN_OPSET = (
    "rewrite that line with supported ops (`portable ops` lists them), or ask for the op to be "
    "added to the opset"
)
_RANDOM = (
    "random ops cannot be compared across backends: set dropout p=0 (or model.eval()) for capture"
)
_HINTS = {
    "aten.native_dropout.default": _RANDOM,
    "aten.bernoulli.p": _RANDOM,
    "aten.bernoulli.default": _RANDOM,
    "aten.rand.default": _RANDOM,
    "aten.randn.default": _RANDOM,
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
):
    src = source_of(node) if node is not None else None
    raise VerifyError(
        what,
        op=op
        or (op_name(node.target) if node is not None and node.op == "call_function" else None),
        module=src.module if src else None,
        source=src.location() if src else None,
        fix=fix,
    )


def _check_arg(node: torch.fx.Node, value) -> None:
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


def _specs(meta) -> list[TensorSpec]:
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
            if isinstance(dim, str) and not _free_symbols(dim) <= symbols:
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
    # a per-rank program (spmd-partition) keeps the global weights; runtimes shard them
    global_shapes = program.metadata.get("spmd", {}).get("global_shapes", {}).get("inputs", {})
    for spec in sig.state_inputs:
        weight = program.weights.get(spec.target)
        if weight is None:
            _fail(
                f"state input {spec.name} ({spec.target}) has no weight",
                fix="re-capture the program",
            )
        expected = spec.spec
        if spec.name in global_shapes:
            expected = TensorSpec(tuple(global_shapes[spec.name]), spec.spec.dtype)
        if TensorSpec.of(weight) != expected:
            _fail(f"weight {spec.target} is {TensorSpec.of(weight)}, signature says {expected}")
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
    if check_shapes and not symbols:
        _check_shape_rules(program)


def _check_shape_rules(program: Program) -> None:
    """Re-derive each node's shape and dtype with the op's fake kernel from recorded inputs."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    env: dict[torch.fx.Node, object] = {}

    def fake(spec: TensorSpec):
        with mode:
            return torch.empty(spec.shape, dtype=spec.dtype)

    def load(value):
        return torch.fx.node.map_arg(value, lambda n: env[n])

    for node in program.graph.nodes:
        if node.op == "placeholder":
            env[node] = fake(node.meta["tensor"])
        elif node.op == "call_function":
            args, kwargs = load(node.args), load(node.kwargs)
            if node.target is operator.getitem:
                env[node] = args[0][args[1]]
                continue
            entry = lookup(node.target)
            _check_dtypes(node, entry, args, kwargs)
            try:
                with mode:
                    result = node.target(*args, **kwargs)
            except Exception as exc:
                _fail(f"the shape rule of {entry.name} rejects node {node.name}: {exc}", node)
            recorded = node.meta["tensor"]
            derived = _to_spec(result)
            if derived != recorded:
                _fail(
                    f"node {node.name} records {_fmt(recorded)} but {entry.name}'s shape rule "
                    f"gives {_fmt(derived)}",
                    node,
                    fix="a pass changed this node without updating meta['tensor']",
                )
            env[node] = result


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


def _check_dtypes(node, entry, args, kwargs=None) -> None:
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


def _to_spec(value):
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (tuple, list)):
        return tuple(_to_spec(v) for v in value)
    return None


def _fmt(meta) -> str:
    if isinstance(meta, tuple):
        return "(" + ", ".join(_fmt(m) for m in meta) + ")"
    return str(meta)
