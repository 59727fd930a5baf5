"""Repeated layers: an abstract capture of a deep stack traces five layers and repeats one.

Tracing costs torch about two seconds per transformer layer (export, AOT autograd's joint
graph, the optimizer's trace), so an 80-layer model would take minutes. Its layers are one
module class with one parameter layout, and the training step (or inference) program of 80 such
layers is that of 5 with the middle layer's nodes repeated. So an abstract capture (no weight
values: nothing runs) of a model whose largest `nn.ModuleList` holds more than `CAPTURED`
identical layers (`find_stack`) traces the model with its first `CAPTURED` layers (`truncated`),
and `repeat_layers` rebuilds the graph of all of them:

    captured   0  1  2  3               4        (2 is the template: its neighbours are layers too)
    program    0  1  2  3' ... (L-3)'  L-2  L-1     c': a copy of 2; L-2, L-1: captured 3, 4

A node belongs to layer k if its source module is under `<stack>.k` (a parameter, buffer or
optimizer-state input if its target is; an op with no model source, such as an optimizer
update's, if all its layer inputs are in k; a value computed from values outside the stack
only, such as the rotary tables' `unsqueeze`, to the one layer that reads it, else to none).
A copy of a template node reads the copy of each input from its own layer, the previous copy's
counterpart of an input from the previous layer, the next copy's counterpart of an input from
the next layer, and other values as they are; a list that gathers all layers (the gradient
norms' `stack`, the graph's outputs) gets the copies' values after each run of the template's,
and its node's fake value is derived again. Copies come after each run of the template's nodes
where the trace takes the layers in ascending order (forward, optimizer, gradient accumulation)
and before it where it takes them in descending order (the backward: layer 3's twin of the run
comes first), so the order is the one a full trace gives. Node names are renumbered in graph
order; inputs and outputs are named as a full capture names them
(`model.layers.7.mlp.up_proj.weight`).

The repetition is checked before it is used: layers 1, 2 and 3 must have the same nodes (op,
spec, literal arguments, arguments relative to their layer), no value may skip a layer, only
lists that gather all layers may read the middle ones, and a parameter's optimizer group must
not depend on its layer. Otherwise, or when dropout draws random streams (each layer its own),
`repeat_layers` returns None and capture traces the whole model.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import re
import typing
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import Node

from ..ir.program import Program
from ..ir.signature import InputKind, InputSpec, OutputSpec, Signature, TensorSpec
from ..ir.source import SourceLoc
from ..torch_compat import lazy_graph_module
from .abstract import abstract_weight

__all__ = ["CAPTURED", "Stack", "find_stack", "repeat_layers", "truncated"]

CAPTURED = (
    5  # layers traced: the first, three middle ones (the template and its neighbours), the last
)
TEMPLATE = 2
_UNOWNED = ("optimizer.",)  # source modules that are not the model's (the optimizer's update)


@dataclasses.dataclass(frozen=True)
class Stack:
    """A model's repeated layers: the ModuleList at `path` with `count` identical layers."""

    path: str
    count: int
    module: torch.nn.ModuleList


def find_stack(model: torch.nn.Module) -> Stack | None:
    """The largest ModuleList of more than CAPTURED layers of one class, parameter and
    buffer layout (names, shapes, dtypes, requires_grad) and mode; None if there is none."""
    best: Stack | None = None
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) <= CAPTURED:
            continue
        if best is not None and len(module) <= best.count:
            continue
        layouts = {_layout(layer) for layer in module}
        keys = [str(k) for k in module._modules]
        if len(layouts) == 1 and keys == [str(i) for i in range(len(module))]:
            best = Stack(path, len(module), module)
    return best


def _layout(layer: torch.nn.Module) -> tuple:
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()
    )
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    modes = tuple(m.training for m in layer.modules())
    return (type(layer), params, buffers, modes)


@contextlib.contextmanager
def truncated(stack: Stack) -> Iterator[None]:
    """Within: the stack holds its first CAPTURED layers only."""
    modules = stack.module._modules
    stack.module._modules = collections.OrderedDict(list(modules.items())[:CAPTURED])
    try:
        yield
    finally:
        stack.module._modules = modules


# --------------------------------------------------------------------------- attribution


class _Layers:
    """Which captured layer each node belongs to (None: outside the stack), and its index among
    its layer's nodes in graph order."""

    def __init__(self, program: Program, path: str) -> None:
        self.path = path
        targets = {i.name: i.target for i in program.signature.inputs}
        by_target = re.compile(rf"(?:^|\.){re.escape(path)}\.(\d+)\.")
        by_module = re.compile(rf"^{re.escape(path)}\.(\d+)(?:\.|$)")
        self.of: dict[Node, int | None] = {}
        self.nodes: dict[int, list[Node]] = collections.defaultdict(list)
        for node in program.graph.nodes:
            self.of[node] = self._layer(node, targets, by_target, by_module)
        self._share_invariants(program.graph)
        for node, layer in self.of.items():
            if layer is not None:
                self.nodes[layer].append(node)
        self.index = {n: k for nodes in self.nodes.values() for k, n in enumerate(nodes)}

    def _share_invariants(self, graph: torch.fx.Graph) -> None:
        """A value computed from values outside the stack only (the rotary tables'
        `unsqueeze`) belongs to the layer that reads it, whatever its source says (capture
        copies sources from the first match); read by several layers (or none), it is outside."""
        invariant = set()
        for node in graph.nodes:
            if node.op == "call_function" and all(
                self.of[a] is None or a in invariant for a in node.all_input_nodes
            ):
                invariant.add(node)
        for node in reversed(list(graph.nodes)):
            if node in invariant:
                readers = {self.of[u] for u in node.users}
                self.of[node] = readers.pop() if len(readers) == 1 else None

    def _layer(
        self,
        node: Node,
        targets: dict[str, str | None],
        by_target: re.Pattern[str],
        by_module: re.Pattern[str],
    ) -> int | None:
        if node.op == "placeholder":
            match = by_target.search(targets.get(node.name) or "")
            return int(match.group(1)) if match else None
        if node.op != "call_function":
            return None
        source = node.meta.get("source")
        module = source.module if isinstance(source, SourceLoc) else None
        if module is not None and not module.startswith(_UNOWNED):
            match = by_module.match(module)
            return int(match.group(1)) if match else None
        # no model source (an optimizer update): the one layer its inputs belong to
        layers = {self.of[a] for a in node.all_input_nodes} - {None}
        return layers.pop() if len(layers) == 1 else None


# --------------------------------------------------------------------------- the check


def _relative(layers: _Layers, node: Node, arg: Node) -> tuple:
    """An argument as seen from its reader: (layer offset, index in its layer), or the node."""
    layer, own = layers.of[arg], layers.of[node]
    if layer is None or own is None:
        return ("outside", arg)
    return (layer - own, layers.index[arg])


def _shape_of(layers: _Layers, node: Node, offsets: tuple[int, ...]) -> list:
    """What two corresponding nodes must share: op, target, spec, literal arguments and the
    arguments at these layer offsets, relative to their layer."""
    out: list[Any] = [node.op, node.target if node.op == "call_function" else None]
    out.append(node.meta.get("tensor"))

    def visit(value: Any) -> Any:
        if isinstance(value, Node):
            rel = _relative(layers, node, value)
            if rel[0] == "outside":
                return rel
            return rel if rel[0] in offsets else ("elsewhere",)
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(visit(v) for v in value))
        if isinstance(value, dict):
            return tuple((k, visit(v)) for k, v in sorted(value.items()))
        return ("literal", repr(value))

    out.append(visit(node.args))
    out.append(visit(node.kwargs))
    return out


def _periodic(layers: _Layers) -> bool:
    """The template and its neighbours alike (op, spec, literal arguments, arguments relative
    to their layer, and what they read from a middle neighbour: layer 1 from 2 and 2 from 3, as
    3 from 2 and 2 from 1; the first and last layers may differ);
    no value skips a layer; values outside the stack read the middle layers only as members of a
    list."""
    n = [layers.nodes.get(k, []) for k in range(CAPTURED)]
    if not n[TEMPLATE] or not len(n[TEMPLATE - 1]) == len(n[TEMPLATE]) == len(n[TEMPLATE + 1]):
        return False
    pairs = ((TEMPLATE - 1, (0, 1)), (TEMPLATE + 1, (-1, 0)))
    for other, offsets in pairs:
        for a, b in zip(n[other], n[TEMPLATE], strict=True):
            if _shape_of(layers, a, offsets) != _shape_of(layers, b, offsets):
                return False
    for node, layer in layers.of.items():
        for arg in node.all_input_nodes:
            read = layers.of[arg]
            if layer is not None and read is not None and abs(read - layer) > 1:
                return False
        if layer is None and not _reads_middle_only_in_lists(layers, node):
            return False
    return True


def _reads_middle_only_in_lists(layers: _Layers, node: Node) -> bool:
    middle = set(range(1, CAPTURED - 1))
    for arg in (*node.args, *node.kwargs.values()):
        if isinstance(arg, Node) and layers.of[arg] in middle:
            return False
    return True


def _expand(values: Any, layer_of: Callable[[Any], int | None], copies: range) -> list:
    """(value, copy) for a list gathering all layers: each run of template members followed by
    its copies, run by run, in copy order."""
    out: list[tuple[Any, int | None]] = []
    run: list[Any] = []
    end = object()
    for value in [*values, end]:
        if value is not end and layer_of(value) == TEMPLATE:
            run.append(value)
            continue
        out += [(v, c) for c in (None, *copies) for v in run]
        run = []
        if value is not end:
            out.append((value, None))
    return out


# --------------------------------------------------------------------------- the rebuild


@dataclasses.dataclass
class _Renamer:
    """Layer `old` -> layer `new` in targets, input names and module paths."""

    path: str

    def target(self, text: str | None, old: int | None, new: int | None) -> str | None:
        if text is None or old is None or new is None or old == new:
            return text
        return re.sub(rf"(^|\.){re.escape(self.path)}\.{old}\.", rf"\g<1>{self.path}.{new}.", text)

    def name(self, text: str, old: int | None, new: int | None) -> str:
        if old is None or new is None or old == new:
            return text
        flat = re.sub(r"[^A-Za-z0-9_]", "_", self.path)
        return re.sub(rf"(^|_){re.escape(flat)}_{old}_", rf"\g<1>{flat}_{new}_", text)

    def module(self, text: str | None, old: int | None, new: int | None) -> str | None:
        if text is None or old is None or new is None or old == new:
            return text
        return re.sub(rf"^{re.escape(self.path)}\.{old}(?=\.|$)", f"{self.path}.{new}", text)


class _Rebuild:
    """The program with `total` layers from a verified capture of CAPTURED (module docstring).
    A final node is a (captured node, copy) pair: copy None for captured nodes, c in
    3..total-2 for the template's copies."""

    def __init__(self, program: Program, layers: _Layers, total: int) -> None:
        self.program = program
        self.layers = layers
        self.total = total
        self.shift = total - CAPTURED  # captured layers after the template move up by this
        self.copies = range(TEMPLATE + 1, TEMPLATE + 1 + self.shift)
        self.rename = _Renamer(layers.path)
        n = layers.nodes
        self.prev = dict(zip(n[TEMPLATE - 1], n[TEMPLATE], strict=True))  # -> template twin
        self.next = dict(zip(n[TEMPLATE + 1], n[TEMPLATE], strict=True))

    def final_layer(self, node: Node, copy: int | None) -> int | None:
        layer = self.layers.of[node]
        if copy is not None:
            return copy
        return layer + self.shift if layer is not None and layer > TEMPLATE else layer

    def resolve(self, arg: Node, reader: Node, copy: int | None) -> tuple[Node, int | None]:
        """The final node an argument of final node (reader, copy) is."""
        own, layer = self.layers.of[reader], self.layers.of[arg]
        if own is None or layer is None:
            return arg, None
        if copy is None:
            if own == TEMPLATE and layer == TEMPLATE + 1 and self.copies:
                return self.next[arg], self.copies[0]
            if own == TEMPLATE + 1 and layer == TEMPLATE and self.copies:
                return arg, self.copies[-1]
            return arg, None
        if layer == own:
            return arg, copy
        if layer == own - 1:  # from the previous layer: its twin in the previous copy
            return self.prev[arg], (copy - 1 if copy - 1 in self.copies else None)
        # from the next layer: its twin in the next copy, or the captured layer after the template
        return (self.next[arg], copy + 1) if copy + 1 in self.copies else (arg, None)

    def order(self) -> list[tuple[Node, int | None]]:
        """Every final node, in a topological order that follows the full trace's."""
        nodes = list(self.program.graph.nodes)
        position = {n: p for p, n in enumerate(nodes)}
        successor = {t: n for n, t in self.next.items()}  # template node -> its layer-3 twin
        keys: dict[tuple[Node, int | None], tuple] = {}
        for p, node in enumerate(nodes):
            keys[(node, None)] = (p, 0, 0)
        for start, end in self._runs(nodes):
            # layers run in descending order here (a backward) if layer 3's twin comes first
            backward = position[successor[nodes[start]]] < start
            for p in range(start, end + 1):
                for c in self.copies:
                    keys[(nodes[p], c)] = (start - 0.5, -c, p) if backward else (end + 0.5, c, p)
        return _topological(keys, self.inputs_of)

    def _runs(self, nodes: list[Node]) -> Iterator[tuple[int, int]]:
        start = None
        for p, node in enumerate([*nodes, None]):
            inside = node is not None and self.layers.of[node] == TEMPLATE
            if inside and start is None:
                start = p
            elif not inside and start is not None:
                yield start, p - 1
                start = None

    def inputs_of(self, item: tuple[Node, int | None]) -> list[tuple[Node, int | None]]:
        node, copy = item
        out = [self.resolve(a, node, copy) for a in node.all_input_nodes]
        if self.layers.of[node] is None:  # a list gathering all layers also reads the copies
            out += [
                (a, c)
                for a in node.all_input_nodes
                if self.layers.of[a] == TEMPLATE
                for c in self.copies
            ]
        return out

    def args(self, value: Any, node: Node, copy: int | None, made: dict) -> Any:
        if isinstance(value, Node):
            return made[self.resolve(value, node, copy)]
        if isinstance(value, (list, tuple)):
            if self.layers.of[node] is None:  # a list gathering all layers: with the copies
                return type(value)(
                    made[(v, c)] if c is not None else self.args(v, node, None, made)
                    for v, c in self.expand(value)
                )
            return type(value)(self.args(v, node, copy, made) for v in value)
        if isinstance(value, dict):
            return {k: self.args(v, node, copy, made) for k, v in value.items()}
        return value

    def expand(self, values: Any) -> list[tuple[Any, int | None]]:
        def layer_of(v: Any) -> int | None:
            return self.layers.of[v] if isinstance(v, Node) else None

        return _expand(values, layer_of, self.copies)

    def build(self) -> Program:
        graph = torch.fx.Graph()
        made: dict[tuple[Node, int | None], Node] = {}
        inputs = {i.name: i for i in self.program.signature.inputs}
        new_inputs: list[InputSpec] = []
        captured: dict[str, str] = {}  # final weight key -> the captured weight it copies
        for node, copy in self.order():
            layer = self.layers.of[node]
            final = self.final_layer(node, copy)
            if node.op == "placeholder":
                new = graph.create_node(
                    "placeholder", node.target, name=self.rename.name(node.name, layer, final)
                )
                spec = inputs[node.name]
                target = self.rename.target(spec.target, layer, final)
                new_inputs.append(dataclasses.replace(spec, name=new.name, target=target))
                if spec.target is not None and target is not None:
                    captured[target] = spec.target
            elif node.op == "output":
                new = graph.output(self.args(node.args[0], node, None, made))
            else:
                new = graph.create_node(
                    node.op,
                    node.target,
                    self.args(node.args, node, copy, made),
                    self.args(node.kwargs, node, copy, made),
                    name=re.sub(r"_\d+$", "", node.name),
                )
            new.meta = self._meta(node, layer, final)
            made[(node, copy)] = new
            if layer is None and node.op == "call_function" and self._gathers(node, new):
                _rederive(new)
        for new in graph.nodes:
            new.meta.pop("rederived", None)
            if new.op == "placeholder":
                new.target = new.name
        return self._program(graph, new_inputs, captured)

    def _gathers(self, node: Node, new: Node) -> bool:
        """Whether `new` reads more values than `node` did (a list with the copies), or a value
        whose shape that changed."""
        return len(new.all_input_nodes) != len(node.all_input_nodes) or any(
            a.meta.get("rederived") for a in new.all_input_nodes
        )

    def _meta(self, node: Node, layer: int | None, final: int | None) -> dict[str, Any]:
        meta = dict(node.meta)
        if layer is None or final is None or layer == final:
            return meta
        source = meta.get("source")
        if isinstance(source, SourceLoc):
            meta["source"] = dataclasses.replace(
                source, module=self.rename.module(source.module, layer, final)
            )
        if "norm_like" in meta:
            meta["norm_like"] = self.rename.name(meta["norm_like"], layer, final)
        return meta

    def _program(
        self, graph: torch.fx.Graph, inputs: list[InputSpec], captured: dict[str, str]
    ) -> Program:
        program = self.program
        # the IR's output node returns one flat tuple of nodes (the verifier holds it to that)
        old_args = typing.cast(tuple[Node, ...], program.graph.output_node().args[0])
        specs = program.signature.outputs
        outputs: list[OutputSpec] = []
        layer_of = [self.layers.of[v] if isinstance(v, Node) else None for v in old_args]
        for k, copy in _expand(range(len(specs)), layer_of.__getitem__, self.copies):
            layer = layer_of[k]
            final = self.final_layer(old_args[k], copy) if layer is not None else None
            outputs.append(self._output(specs[k], layer, final))
        values = typing.cast(tuple[Node, ...], graph.output_node().args[0])
        outputs = [  # a gathering output's spec was derived again (`_rederive`)
            dataclasses.replace(o, spec=v.meta["tensor"]) if v.meta.get("tensor") != o.spec else o
            for o, v in zip(outputs, values, strict=True)
        ]
        weights = {
            key: program.weights[old] if key == old else abstract_weight(program.weights[old])
            for key, old in captured.items()
        }
        metadata = dict(program.metadata)
        metadata["repeated_layers"] = {
            "stack": self.layers.path,
            "layers": self.total,
            "traced": CAPTURED,
            "template": TEMPLATE,
        }
        return dataclasses.replace(
            program,
            graph_module=lazy_graph_module(graph),  # an abstract program never runs
            signature=Signature(tuple(inputs), tuple(outputs)),
            weights=weights,
            metadata=metadata,
        )

    def _output(self, spec: OutputSpec, layer: int | None, final: int | None) -> OutputSpec:
        if layer is None or final is None or layer == final:
            return spec
        name = self.rename.target(spec.name, layer, final) or spec.name
        aliases = self.rename.name(spec.aliases, layer, final) if spec.aliases else None
        target = self.rename.target(spec.target, layer, final)
        return dataclasses.replace(spec, name=name, target=target, aliases=aliases)


def _rederive(node: Node) -> None:
    """Recompute `node`'s fake value and spec from its arguments' (a list that gathers all
    layers is longer now: the norms' `stack`); mark it if they changed."""
    val = node.meta.get("val")
    if not isinstance(val, FakeTensor):
        return

    def fake(value: Any) -> Any:
        return value.meta["val"] if isinstance(value, Node) else value

    args = torch.fx.node.map_aggregate(node.args, fake)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, fake)
    with val.fake_mode:
        new = node.target(*args, **kwargs)  # type: ignore[operator]
    if isinstance(new, torch.Tensor) and TensorSpec.of(new) != node.meta.get("tensor"):
        node.meta["val"], node.meta["tensor"] = new, TensorSpec.of(new)
        node.meta["rederived"] = True


def _topological(
    keys: dict[tuple[Node, int | None], tuple],
    inputs_of: Callable[[tuple[Node, int | None]], list[tuple[Node, int | None]]],
) -> list[tuple[Node, int | None]]:
    """Kahn's order, smallest key first among the ready nodes (the key order where it is a
    topological one)."""
    waiting: dict[tuple, int] = {}
    readers: dict[tuple, list] = collections.defaultdict(list)
    for item in keys:
        deps = set(inputs_of(item))
        waiting[item] = len(deps)
        for dep in deps:
            readers[dep].append(item)
    ready = [(keys[i], id(i[0]), i) for i, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, _, item = heapq.heappop(ready)
        out.append(item)
        for reader in readers[item]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, (keys[reader], id(reader[0]), reader))
    return out


def repeat_layers(
    program: Program, stack: Stack, group_of: Callable[[str], int] | None = None
) -> Program | None:
    """`program` (captured with the stack truncated to CAPTURED layers) with all
    `stack.count` layers, or None when the capture does not repeat (module docstring);
    `group_of` gives a parameter's optimizer group, which must not depend on its layer."""
    if any(i.target in _RNG_TARGETS for i in program.signature.inputs):
        return None  # dropout: each layer draws its own random stream
    layers = _Layers(program, stack.path)
    if not _periodic(layers) or not _same_groups(program, layers, stack.count, group_of):
        return None
    return _Rebuild(program, layers, stack.count).build()


_RNG_TARGETS = ("rng.seed", "rng.offset")


def _same_groups(
    program: Program, layers: _Layers, total: int, group_of: Callable[[str], int] | None
) -> bool:
    """Whether each parameter's optimizer group is its captured counterpart's."""
    if group_of is None:
        return True
    rename = _Renamer(layers.path)
    shift = total - CAPTURED
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    for spec in program.signature.inputs_of(InputKind.PARAMETER):
        layer = layers.of.get(placeholders[spec.name])
        if layer is None or layer < TEMPLATE or spec.target is None:
            continue
        finals = range(TEMPLATE + 1, TEMPLATE + 1 + shift) if layer == TEMPLATE else [layer + shift]
        group = group_of(spec.target)
        if any(group_of(rename.target(spec.target, layer, f) or "") != group for f in finals):
            return False
    return True
