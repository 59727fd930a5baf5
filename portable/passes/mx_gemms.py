"""Which GEMMs of a program belong to which linear layer, and which GEMM of the layer each is.

The MX training recipe (shared/reference/mx.md) quantizes the three GEMMs of every linear layer
`Y = X W^T` (W: [N, K], X: [M, K]):

    forward       Y  = X  @ W^T    contraction K     operands x, w
    input_grad    dX = dY @ W      contraction N     operands dy, w
    weight_grad   dW = dY^T @ X    contraction M     operands dy, x

In a captured graph each is its own 2-D `aten.mm` / `aten.addmm` node. They are found by
structure, with `meta["source"]` (the module path) naming the layer and breaking ties:

- a *forward* GEMM computes the loss (it is an ancestor of the loss output; every GEMM of an
  inference program is one) and exactly one operand is, through views, a 2-D parameter W;
- an *input_grad* GEMM is a backward GEMM with an operand that is, through views, the weight W
  of a layer;
- a *weight_grad* GEMM is a backward GEMM without a parameter operand whose result has W's shape
  (or its transpose), one operand being the layer's forward input X and the other the dY that its
  input_grad GEMM uses (through views). The first layer has no input_grad (its input needs no
  gradient): its X alone identifies it.

Backward nodes carry the module path of the forward op they differentiate only best effort (a
MoE's expert weight gradients may say `moe.router`), hence structure first, source for ties.
Attention batched matmuls (`bmm`, `portable::attention`), embeddings and norms are not mm/addmm
and never match.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from typing import Any

import torch
from torch.fx import Node

from portable.ir.program import Program, ProgramKind
from portable.ir.signature import InputKind, OutputKind
from portable.ir.source import source_of
from portable.opset import bind
from portable.opset.table import CAST, IDENTITY, PERMUTE, RESHAPE, ops_with

__all__ = [
    "CONTRACTION",
    "GEMMS",
    "Gemm",
    "Layer",
    "LinearGemms",
    "boundary_layers",
    "find_linear_gemms",
]

aten = torch.ops.aten

GEMMS = ("forward", "input_grad", "weight_grad")
# the contraction dim of each GEMM, in the recipe's names (X: [M, K], W: [N, K])
CONTRACTION = {"forward": "K", "input_grad": "N", "weight_grad": "M"}

_GEMM_OPS = frozenset({aten.mm.default, aten.addmm.default})
# ops whose result holds the same data as their input (what "through views" looks through)
_SAME_DATA = ops_with(PERMUTE, RESHAPE, IDENTITY, CAST)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM of a linear layer: the mm/addmm `node`, its `role` (one of GEMMS) and the
    recipe's names of its (lhs, rhs) operands (`x`, `w` or `dy`)."""

    node: Node
    role: str
    labels: tuple[str, str]

    @property
    def operand_names(self) -> tuple[str, str]:
        """The schema names of (lhs, rhs) (addmm's `self` is the bias)."""
        return gemm_operands(self.node)

    def operand(self, side: int) -> Node:
        """The lhs (`side` 0) or rhs (1) operand node."""
        return bind(self.node).node(self.operand_names[side])

    @property
    def contraction_size(self) -> int | str:
        """The length of the contraction dim (lhs dim 1), a symbol name if dynamic."""
        return self.operand(0).meta["tensor"].shape[1]


@dataclasses.dataclass
class Layer:
    """A linear layer: its module path, its weight (a parameter placeholder; `weight_name` is its
    state name, e.g. `fc1.weight`) and its GEMMs."""

    module: str
    weight: Node
    weight_name: str
    gemms: list[Gemm] = dataclasses.field(default_factory=list)
    # roots (see `_root`) of the forward input X and of the output gradient dY
    x_roots: set[Node] = dataclasses.field(default_factory=set)
    dy_roots: set[Node] = dataclasses.field(default_factory=set)

    def roles(self) -> list[str]:
        return [r for r in GEMMS if any(g.role == r for g in self.gemms)]


@dataclasses.dataclass(frozen=True)
class LinearGemms:
    """`layers` in graph order of their first forward GEMM; `unmatched`: backward mm/addmm nodes
    attributed to no layer (they stay high precision); `other`: forward mm/addmm nodes without a
    parameter operand (not linear layers). `first` / `last`: the layers at the model's boundary
    (`boundary_layers`)."""

    layers: list[Layer]
    unmatched: list[Node]
    other: list[Node]
    first: list[Layer] = dataclasses.field(default_factory=list)
    last: list[Layer] = dataclasses.field(default_factory=list)


def gemm_operands(node: Node) -> tuple[str, str]:
    """The schema names of an mm/addmm's (lhs, rhs) operands."""
    return ("mat1", "mat2") if node.target is aten.addmm.default else ("self", "mat2")


def find_linear_gemms(program: Program) -> LinearGemms:
    """Every linear layer of `program` with its GEMMs (see the module docstring)."""
    names = _parameter_names(program)
    params = {n for n in program.graph.nodes if n.op == "placeholder" and n.name in names}
    gemms = [n for n in program.graph.nodes if n.op == "call_function" and n.target in _GEMM_OPS]
    forward = _forward_nodes(program)
    layers: dict[str, Layer] = {}
    other, backward = [], []
    for node in gemms:
        if node not in forward:
            backward.append(node)
            continue
        weight = _weight_operand(node, params)
        if weight is None:
            other.append(node)
            continue
        index, w = weight
        name = _target(program, w)
        module = _module(node, name)
        layer = layers.setdefault(module, Layer(module, w, name))
        if layer.weight is not w:  # two weights under one path: key the second by its weight
            module = f"{module}[{name}]"
            layer = layers.setdefault(module, Layer(module, w, name))
        layer.gemms.append(Gemm(node, "forward", _labels(index, "w", "x")))
        layer.x_roots.add(_root(bind(node)[gemm_operands(node)[1 - index]]))
    ordered = list(layers.values())
    unmatched = _assign_backward(backward, ordered, params)
    position = {n: i for i, n in enumerate(program.graph.nodes)}
    for layer in ordered:
        layer.gemms.sort(key=lambda g: position[g.node])
    first, last = boundary_layers(program, ordered)
    return LinearGemms(ordered, unmatched, other, first, last)


# ---- the first and last layers -------------------------------------------------------------


def boundary_layers(program: Program, layers: list[Layer]) -> tuple[list[Layer], list[Layer]]:
    """(first, last). The first layers read the model's first activations: no other linear
    layer's forward GEMM is upstream of their forward GEMMs' inputs (in a transformer, every
    projection of block 0's attention, which all read the embedding's norm). The last layers
    write its last: no other layer's forward GEMM reads what they compute (the LM head, or
    every head of a model with several).

    Upstream sets are bitsets over the layers, propagated once in graph order."""
    bit = {g.node: 1 << i for i, layer in enumerate(layers) for g in layer.gemms
           if g.role == "forward"}  # fmt: skip
    upstream: dict[Node, int] = {}  # node -> layers whose forward GEMMs it depends on
    reads = [0] * len(layers)  # per layer: the other layers its forward GEMMs read from
    for node in program.graph.nodes:
        inputs = 0
        for value in node.all_input_nodes:
            inputs |= upstream[value]
        if node in bit:
            i = bit[node].bit_length() - 1
            reads[i] |= inputs & ~bit[node]
            inputs |= bit[node]
        upstream[node] = inputs
    read_by_any = 0
    for r in reads:
        read_by_any |= r
    first = [layer for i, layer in enumerate(layers) if not reads[i]]
    last = [layer for i, layer in enumerate(layers) if not read_by_any >> i & 1]
    return first, last


# ---- backward GEMMs ------------------------------------------------------------------------


def _assign_backward(backward: list[Node], layers: list[Layer], params: set[Node]) -> list[Node]:
    """Attribute input_grad GEMMs first (they reveal each layer's dY), then weight_grad GEMMs.
    Returns the GEMMs attributed to no layer."""
    rest = []
    for node in backward:
        weight = _weight_operand(node, params)
        if weight is None:
            rest.append(node)
            continue
        index, w = weight
        layer = _pick(node, [layer for layer in layers if layer.weight is w])
        if layer is None:
            rest.append(node)
            continue
        layer.gemms.append(Gemm(node, "input_grad", _labels(index, "w", "dy")))
        layer.dy_roots.add(_root(bind(node)[gemm_operands(node)[1 - index]]))
    unmatched = []
    for node in rest:
        match = _weight_grad(node, layers)
        if match is None:
            unmatched.append(node)
        else:
            layer, labels = match
            layer.gemms.append(Gemm(node, "weight_grad", labels))
    return unmatched


def _weight_grad(node: Node, layers: list[Layer]) -> tuple[Layer, tuple[str, str]] | None:
    """The layer whose dW = dY^T X (or dW^T = X^T dY) `node` computes, with the operand labels."""
    lhs, rhs = gemm_operands(node)
    roots = (_root(bind(node)[lhs]), _root(bind(node)[rhs]))
    shape = tuple(node.meta["tensor"].shape)
    full, partial = [], []
    for layer in layers:
        w_shape = tuple(layer.weight.meta["tensor"].shape)
        if shape not in (w_shape, w_shape[::-1]):
            continue
        for x_side in (1, 0):  # dY^T @ X (autograd's form) first
            if roots[x_side] not in layer.x_roots:
                continue
            labels = ("dy", "x") if x_side == 1 else ("x", "dy")
            if roots[1 - x_side] in layer.dy_roots:
                full.append((layer, labels))
            elif not layer.dy_roots:  # the first layer: no input_grad GEMM names its dY
                partial.append((layer, labels))
            break
    candidates = full or partial
    chosen = _pick(node, [c[0] for c in candidates])
    return next((c for c in candidates if c[0] is chosen), None)


def _pick(node: Node, layers: list[Layer]) -> Layer | None:
    """The one candidate, or the one named by the node's source module, or None."""
    if len(layers) == 1:
        return layers[0]
    src = source_of(node)
    named = [layer for layer in layers if src is not None and layer.module == src.module]
    return named[0] if len(named) == 1 else None


# ---- helpers -------------------------------------------------------------------------------


def _parameter_names(program: Program) -> set[str]:
    return {i.name for i in program.signature.inputs_of(InputKind.PARAMETER)}


def _target(program: Program, placeholder: Node) -> str:
    spec = next(i for i in program.signature.inputs if i.name == placeholder.name)
    return spec.target or placeholder.name


def _module(node: Node, weight_name: str) -> str:
    """The GEMM's module path from its source; else the weight's owner (`fc1.weight` -> `fc1`)."""
    src = source_of(node)
    if src is not None and src.module:
        return src.module
    return weight_name.rpartition(".")[0] or "<root>"


def _forward_nodes(program: Program) -> set[Node]:
    """The nodes the loss depends on (training step), or every node (inference)."""
    nodes = set(program.graph.nodes)
    if program.kind is not ProgramKind.TRAINING_STEP:
        return nodes
    (outputs,) = program.graph.output_node().args
    assert isinstance(outputs, (tuple, list))  # one flat sequence of values (the verifier's rule)
    kinds = [o.kind for o in program.signature.outputs]
    losses = [v for v, k in zip(outputs, kinds, strict=True) if k is OutputKind.LOSS]
    return _ancestors(v for v in losses if isinstance(v, Node))


def _ancestors(start: Iterable[Node]) -> set[Node]:
    seen: set[Node] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _root(value: Any) -> Node:
    """The node whose data `value` (a node) is, looking through views, transposes and copies."""
    while value.op == "call_function" and value.target in _SAME_DATA:
        value = bind(value).self  # every op in _SAME_DATA transforms its `self`
    return typing.cast(Node, value)


def _weight_operand(node: Node, params: set[Node]) -> tuple[int, Node] | None:
    """(0 for lhs / 1 for rhs, the parameter) when exactly one operand is a 2-D parameter."""
    found = []
    for k, name in enumerate(gemm_operands(node)):
        root = _root(bind(node)[name])
        if root in params and len(root.meta["tensor"].shape) == 2:
            found.append((k, root))
    return found[0] if len(found) == 1 else None


def _labels(w_side: int, w: str, other: str) -> tuple[str, str]:
    return (w, other) if w_side == 0 else (other, w)
