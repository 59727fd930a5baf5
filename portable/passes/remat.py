"""`remat`: activation checkpointing as a graph transformation.

A training step is one graph: forward, backward, optimizer update. A forward value the backward
reads stays live from where the forward makes it to where the backward reads it: those are the
saved activations. `remat{policy=...}` makes the backward recompute, from the values a policy
saves, every other forward value of a layer that the backward reads:

    policy        saved inside a layer (besides its inputs and parameters)
    none          everything (no change)
    full          nothing: torch.utils.checkpoint around every layer
    selective     matmul results (mm, addmm, bmm) and portable::attention results; norms,
                  pointwise ops, softmax and reshapes are recomputed (torchtitan's op-level AC)
    save-matmuls  mm, addmm and bmm results only; attention is recomputed as well

**Layers** are found from each forward op's module path (`node.meta["source"].module`): an op
belongs to the layer named by the shortest prefix of its path, at a `.`, that `layers` (a
regex) matches in full. The default, `(.*\\.)?\\d+`, stops at the first integer component, so
the layers are the entries of the model's repeated module list (`blocks.0`, `blocks.1`;
`model.layers.3` in Hugging Face models). Ops outside every layer (embeddings, the final norm,
the LM head, the loss) are saved as torch.utils.checkpoint leaves them; a value a layer reads
from outside itself (the previous layer's output, a shared constant) is one of its inputs and
stays saved.

**Rewrite**: a backward op of a layer (its module path, which capture copies from the forward
op it differentiates) that reads an unsaved forward value `v` of the same layer and micro-batch
reads a recomputed copy of `v` instead: the same op on the same arguments, whose own unsaved
inputs of that layer are recomputed likewise (one copy per value, shared by its readers). Each
copy is placed right before its first reader, so a recomputed value lives only from there to its
last reader; copies are tagged `phase=backward` with their forward op's micro-batch. A backward
op outside the layer (the final norm's, reading the last block's output) reads the value as
saved, as an autograd node outside a torch.utils.checkpoint region does. A view of values that
stay saved (a weight's transpose, a saved matmul result's reshape) stays saved too: it holds no
memory of its own. The forward itself is unchanged. Where a backward op's module path is off,
less is recomputed, never wrongly.

**Numerics**: a copy runs the same op on the same inputs (the same values, in the same layouts),
so the program computes bit-identical results (tests/test_remat.py, against the program without
the pass and against an eager loop with torch.utils.checkpoint). A value whose op is not a pure
function of its inputs cannot be recomputed: a seeded random op (`Tag.nondeterministic_seeded`:
dropout's mask, `rand`) or an op that writes into an argument is refused with a PassError (a
counter-based random op that takes its seed and counter as graph inputs is pure and recomputes
exactly). Collective results (and their waits) are always saved: recomputing them would repeat
the communication.

**Report**: counts `recomputed` (ops copied into the backward), `layers`, `saved_bytes_before` /
`saved_bytes_after` (bytes of forward buffers some backward op reads, summed over micro-batches)
and `peak_bytes_before` / `peak_bytes_after` (the step's peak of live intermediates); a note and
a table row per layer with its saved bytes before and after. Bytes follow
`portable.ir.liveness`, the cpu backend's memory model (views allocate nothing, values die after
their last reader); a buffer sized by a dynamic dim counts 0 bytes, and a note says how many.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Iterable, Mapping

import torch
import torch.fx
from torch.fx import Node

from portable.capture.training import MICRO_BATCH, PHASE
from portable.errors import PassError
from portable.ir.liveness import Liveness, aliased_inputs, liveness
from portable.ir.program import Program, ProgramKind
from portable.ir.rewriter import Rewriter
from portable.ir.signature import OutputKind
from portable.ir.source import source_of
from portable.limits import format_bytes
from portable.opset import op_name, ops_with
from portable.opset.table import COLLECTIVE, MATMUL

from .base import Pass, PassReport, PassResult, ReportTable

__all__ = ["POLICIES", "Remat", "StepParts", "saved_bytes_by_layer", "step_parts"]

POLICIES = ("none", "full", "selective", "save-matmuls")
DEFAULT_LAYERS = r"(.*\.)?\d+"
OUTSIDE = "<outside layers>"  # the report's row for saved values of ops in no layer

_portable = torch.ops.portable
_ATTENTION = frozenset({_portable.attention.default})
_ALWAYS_SAVED = ops_with(COLLECTIVE) | {_portable.wait.default}


def _saved_ops(policy: str) -> frozenset:
    """The ops whose results a policy saves inside a layer."""
    if policy == "selective":
        return ops_with(MATMUL) | _ATTENTION | _ALWAYS_SAVED
    if policy == "save-matmuls":
        return ops_with(MATMUL) | _ALWAYS_SAVED
    return _ALWAYS_SAVED  # full


@dataclasses.dataclass(frozen=True)
class StepParts:
    """A training step's structure: each call node's phase ("forward", "backward" or
    "optimizer"), micro-batch (None for the optimizer) and layer (None outside every layer and
    for the optimizer; a backward op's is the one of the module it differentiates)."""

    phase: Mapping[Node, str]
    micro_batch: Mapping[Node, int | None]
    layer: Mapping[Node, str | None]

    def is_forward(self, node: Node) -> bool:
        return self.phase.get(node) == "forward"


def step_parts(program: Program, layers: str | None = None) -> StepParts:
    """The phases (`node.meta["phase"]`; for untagged nodes, as capture tags them: forward when
    the loss depends on it, else backward) and layers (module docstring) of `program`."""
    pattern = re.compile(layers if layers is not None else DEFAULT_LAYERS)
    forward = _loss_ancestors(program)
    phase: dict[Node, str] = {}
    micro: dict[Node, int | None] = {}
    layer: dict[Node, str | None] = {}
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        phase[node] = node.meta.get(PHASE) or ("forward" if node in forward else "backward")
        micro[node] = node.meta.get(MICRO_BATCH, 0 if phase[node] != "optimizer" else None)
        layer[node] = _layer_of(node, pattern) if phase[node] != "optimizer" else None
    return StepParts(phase, micro, layer)


def _loss_ancestors(program: Program) -> set[Node]:
    outputs = program.graph.output_node().args[0]
    assert isinstance(outputs, tuple | list)
    stack = [
        v
        for spec, v in zip(program.signature.outputs, outputs, strict=True)
        if spec.kind is OutputKind.LOSS and isinstance(v, Node)
    ]
    seen: set[Node] = set()
    while stack:
        node = stack.pop()
        if node not in seen and node.op == "call_function":
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _layer_of(node: Node, pattern: re.Pattern[str]) -> str | None:
    """The shortest `.`-prefix of the node's module path that `pattern` matches in full."""
    source = source_of(node)
    module = source.module if source is not None else None
    if not module or module == "<root>":
        return None
    parts = module.split(".")
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if pattern.fullmatch(prefix):
            return prefix
    return None


def saved_bytes_by_layer(
    program: Program, parts: StepParts, live: Liveness | None = None
) -> dict[str, int]:
    """Bytes of the buffers forward ops make that a backward or optimizer op reads, by the
    producing op's layer (`OUTSIDE` for ops in none), in graph order of first appearance.
    `live`: the program's liveness, when the caller has it."""
    out: dict[str, int] = {}
    for buffer in (live or liveness(program.graph)).buffers:
        owner = buffer.owner
        if not parts.is_forward(owner):
            continue
        if any(r.op == "call_function" and not parts.is_forward(r) for r in buffer.readers):
            key = parts.layer.get(owner) or OUTSIDE
            out[key] = out.get(key, 0) + buffer.nbytes
    return out


class _Recompute:
    """The copies one rewrite makes: `request(v, reader)` notes that `reader` needs `v`
    recomputed (and, transitively, the unsaved values of its layer `v` is computed from);
    `place()` creates each copy once, before the earliest reader that needs it."""

    def __init__(self, graph: torch.fx.Graph, parts: StepParts, saved_ops: frozenset) -> None:
        self.graph = graph
        self.parts = parts
        self.saved_ops = saved_ops
        self.position = {n: k for k, n in enumerate(graph.nodes)}
        self.needed: dict[Node, Node] = {}  # forward value -> its earliest reader so far

    def recomputable(self, value: object, layer: str | None, micro: int | None) -> bool:
        """Whether `value` is a forward value of `layer` (micro-batch `micro`) the policy does
        not save. A view of values that stay saved (a parameter's transpose, a saved matmul's
        reshape) stays too: it holds no memory of its own, and recomputing it costs an op."""
        if not isinstance(value, Node) or not self.parts.is_forward(value) or layer is None:
            return False
        if self.parts.layer.get(value) != layer or self.parts.micro_batch.get(value) != micro:
            return False
        producer = _producer(value)
        if producer.target in self.saved_ops:
            return False
        bases = aliased_inputs(producer)
        if bases is None:
            return True
        return any(self.recomputable(b, layer, micro) for b in bases)

    def request(self, value: Node, reader: Node) -> None:
        """`reader` (a backward op, or a copy placed before it) needs a copy of `value`: note
        the earliest reader of `value` and of every input it recomputes from."""
        layer, micro = self.parts.layer[value], self.parts.micro_batch[value]
        stack = [value]
        while stack:
            node = stack.pop()
            earliest = self.needed.get(node)
            if earliest is not None and self.position[earliest] <= self.position[reader]:
                continue
            _check_pure(node)
            self.needed[node] = reader
            stack.extend(a for a in node.all_input_nodes if self.recomputable(a, layer, micro))

    def place(self) -> dict[Node, Node]:
        """Create every requested copy, in forward order, right before its earliest reader;
        returns value -> copy."""
        copies: dict[Node, Node] = {}
        rewriter = Rewriter(self.graph)
        for node in sorted(self.needed, key=self.position.__getitem__):
            layer, micro = self.parts.layer[node], self.parts.micro_batch[node]

            def read(a: Node, layer: str | None = layer, micro: int | None = micro) -> Node:
                # an input of its own layer is recomputed too; any other is read as saved
                return copies[a] if self.recomputable(a, layer, micro) else a

            args = torch.fx.node.map_arg(node.args, read)
            kwargs = torch.fx.node.map_arg(node.kwargs, read)
            copy = rewriter.call(
                node.target,
                args,
                kwargs,
                like=node,
                tensor=node.meta.get("tensor"),
                fake="none",  # the same value as the forward's: its fake value is reused
                before=self.needed[node],
            )
            for key in ("val", MICRO_BATCH):
                if key in node.meta:
                    copy.meta[key] = node.meta[key]
            copy.meta[PHASE] = "backward"
            copies[node] = copy
        return copies


def _producer(value: Node) -> Node:
    """The op node that computes `value`: itself, or the multi-result op it picks from."""
    whole = value.args[0] if value.target is operator.getitem else value
    return whole if isinstance(whole, Node) else value


def _check_pure(node: Node) -> None:
    """PassError unless `node`'s op is a pure function of its inputs (module docstring)."""
    target = node.target
    tags = getattr(target, "tags", ())
    schema = getattr(target, "_schema", None)
    writes = schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )
    if torch.Tag.nondeterministic_seeded not in tags and not writes:
        return
    source = source_of(node)
    why = "draws random numbers" if not writes else "writes into an argument"
    raise PassError(
        f"remat would recompute {node.name}, which {why}: a copy would not reproduce its value",
        pass_name="remat",
        op=op_name(target),
        module=source.module if source else None,
        source=source.location() if source else None,
        fix="use a counter-based random op whose seed and counter are graph inputs (a pure "
        "function, recomputed exactly), choose layers without it (remat{layers=...}), or "
        "policy=none",
    )


def rematerialize(graph: torch.fx.Graph, parts: StepParts, policy: str) -> int:
    """Rewrite `graph` in place (module docstring); returns the number of copies made."""
    plan = _Recompute(graph, parts, _saved_ops(policy))
    redirects: list[tuple[Node, Node]] = []  # (reader, forward value it reads)
    for reader in graph.nodes:
        layer = parts.layer.get(reader)
        if reader.op != "call_function" or parts.is_forward(reader) or layer is None:
            continue
        micro = parts.micro_batch.get(reader)
        for value in dict.fromkeys(reader.all_input_nodes):
            if plan.recomputable(value, layer, micro):
                plan.request(value, reader)
                redirects.append((reader, value))
    copies = plan.place()
    for reader, value in redirects:
        reader.replace_input_with(value, copies[value])
    return len(copies)


@dataclasses.dataclass(frozen=True)
class Remat(Pass):
    """Recompute forward values in the backward instead of saving them (module docstring).

    Options: `policy` (none, full, selective, save-matmuls), `layers` (regex of a layer's
    module path; default: the entries of the repeated module list)."""

    name = "remat"
    policy: str = "full"
    layers: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.policy not in POLICIES:
            raise PassError(
                f"remat has no policy {self.policy!r}",
                pass_name=self.name,
                fix=f"use one of: {', '.join(POLICIES)}",
            )
        if self.layers is not None:
            try:
                re.compile(self.layers)
            except re.error as exc:
                raise PassError(
                    f"layers={self.layers!r} of remat is not a regular expression: {exc}",
                    pass_name=self.name,
                    fix=r'write a Python regex matched against module paths, e.g. "blocks\.\d+"',
                ) from None

    def apply(self, program: Program) -> PassResult:
        if program.kind is not ProgramKind.TRAINING_STEP:
            note = "not a training step: there is no backward to recompute in"
            return PassResult(program, self.report(False, {"recomputed": 0}, [note]))
        parts = step_parts(program, self.layers)
        before = _Memory.of(program, parts)
        layers = list(dict.fromkeys(v for v in parts.layer.values() if v is not None))
        if self.policy == "none" or not layers:
            why = "policy=none" if layers else f"no layer: no module path matches {self._pattern()}"
            counts = {"recomputed": 0, "layers": len(layers), **before.counts("before")}
            return PassResult(program, self.report(False, counts, [why]))
        out = program.replace()
        made = rematerialize(out.graph, step_parts(out, self.layers), self.policy)
        if not made:
            out = program  # nothing a layer's backward reads is recomputable: no change
        else:
            out.graph_module.recompile()
        after = _Memory.of(out, step_parts(out, self.layers))
        return PassResult(out, self._report(made, layers, before, after))

    def _pattern(self) -> str:
        return self.layers if self.layers is not None else DEFAULT_LAYERS

    def _report(self, made: int, layers: list[str], before: _Memory, after: _Memory) -> PassReport:
        counts = {
            "recomputed": made,
            "layers": len(layers),
            **before.counts("before"),
            **after.counts("after"),
        }
        b, a = before.saved, after.saved
        rows = [
            (key, format_bytes(b.get(key, 0)), format_bytes(a.get(key, 0)))
            for key in _row_order(layers, b, a)
        ]
        notes = [f"{key}: saved {sb} -> {sa}" for key, sb, sa in rows]
        if after.unsized:
            notes.append(f"{after.unsized} buffers have dynamic sizes: counted as 0 bytes")
        report = self.report(made > 0, counts, notes)
        table = ReportTable(("layer", "saved before", "saved after"), tuple(rows))
        record = {"saved_bytes": {k: [b.get(k, 0), a.get(k, 0)] for k, *_ in rows}}
        return dataclasses.replace(report, tables=(table,), record=record)


@dataclasses.dataclass(frozen=True)
class _Memory:
    """A program's saved bytes by layer, its peak, and how many buffers have no static size."""

    saved: dict[str, int]
    peak: int
    unsized: int

    @staticmethod
    def of(program: Program, parts: StepParts) -> _Memory:
        live = liveness(program.graph)
        return _Memory(saved_bytes_by_layer(program, parts, live), live.peak_bytes, live.unsized)

    def counts(self, when: str) -> dict[str, int]:
        return {f"saved_bytes_{when}": sum(self.saved.values()), f"peak_bytes_{when}": self.peak}


def _row_order(layers: Iterable[str], *saved: dict[str, int]) -> list[str]:
    """The layers in graph order, then any other row (`OUTSIDE`)."""
    keys = list(dict.fromkeys(layers))
    return keys + sorted({k for s in saved for k in s} - set(keys))
