"""What the offline validator reports: findings with a severity, a place and a fix.

A finding names the HLO instruction, the portable node it came from (via the instruction's
metadata op_name `jit(fn)/<node>/...`), the node's module path and the user's source line, and
says what to do. Errors stop the lowering (`NeuronValidationError` lists every finding); warnings
are written into the manifest.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import re
from collections.abc import Iterable, Sequence
from typing import Any, TypedDict

import torch.fx

from portable.errors import BackendError
from portable.ir.program import Program
from portable.ir.source import source_of

from .collectives import RANK_INPUT
from .hlo import HloModule, Instruction

__all__ = ["Finding", "Locator", "NeuronValidationError", "Place", "Severity", "merge"]


class Severity(enum.StrEnum):
    ERROR = "error"
    WARNING = "warning"


@dataclasses.dataclass(frozen=True)
class Finding:
    severity: Severity
    code: str  # stable identifier, e.g. "dtype-f64", "conditional"
    what: str  # one sentence
    fix: str
    instruction: str | None = None  # HLO instruction name
    opcode: str | None = None
    node: str | None = None  # portable graph node
    module: str | None = None  # the node's module path, e.g. "blocks.0.attn"
    source: str | None = None  # the user's `file:line  code`
    ncc: str | None = None  # the neuronx-cc error code this pre-empts, when known
    count: int = 1  # instructions folded into this finding (same code and node)

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def render(self) -> str:
        lines = [f"{self.severity.value}[{self.code}] {self.what}"]
        where = []
        if self.instruction:
            where.append(f"HLO `{self.instruction}`" + (f" ({self.opcode})" if self.opcode else ""))
        if self.node:
            where.append(f"node `{self.node}`")
        if self.module:
            where.append(f"module `{self.module}`")
        if self.count > 1:
            where.append(f"and {self.count - 1} more like it")
        if where:
            lines.append("  in " + ", ".join(where))
        if self.source:
            lines.append(f"  at {self.source}")
        if self.ncc:
            lines.append(f"  neuronx-cc would fail with {self.ncc}")
        lines.append(f"  fix: {self.fix}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["severity"] = self.severity.value
        return {k: v for k, v in data.items() if v is not None}


class NeuronValidationError(BackendError):
    """The lowered program would not compile (or not run correctly) on the Neuron target."""

    def __init__(self, findings: list[Finding], *, program: str, target: str) -> None:
        self.findings = list(findings)
        errors = [f for f in findings if f.severity is Severity.ERROR]
        codes = ", ".join(sorted({f.code for f in errors}))
        super().__init__(
            f"{program} cannot be compiled for {target}: {len(errors)} error(s) ({codes})",
            details="\n".join(f.render() for f in findings),
            fix="apply each finding's fix and lower again; `portable lower --target cpu` or "
            "`xla` run this program meanwhile",
        )


_CALLING_ATTRS = (
    "to_apply",
    "calls",
    "condition",
    "body",
    "true_computation",
    "false_computation",
    "branch_computations",
    "select",
    "scatter",
)


_USER_DEPTH = 3  # how many users deep an instruction without metadata is located


class Place(TypedDict, total=False):
    """Where a finding is (`Finding`'s fields of the same names): the HLO instruction, and the
    node, module path and user's line it was lowered from, where known."""

    instruction: str
    opcode: str
    node: str | None
    module: str | None
    source: str | None


@dataclasses.dataclass(frozen=True)
class Locator:
    """Maps an HLO instruction to its portable node, module path and the user's source line.

    Instructions inside called computations (JAX's nested jits become `call`s, reductions have
    regions) carry op_names relative to their computation: they are located through the
    instruction that calls the computation."""

    nodes: dict[str, torch.fx.Node]
    parameters: tuple[tuple[str, str | None], ...]  # per HLO parameter: (placeholder, weight)
    callers: dict[str, Instruction]  # computation name -> an instruction calling it
    users: dict[tuple[str, str], Instruction]  # (computation, name) -> its first user
    entry: str
    prefix: str  # first op_name component of the traced function, e.g. "jit(fn)"

    @staticmethod
    def of(
        module: HloModule,
        program: Program | None = None,
        kept: Sequence[int] | None = None,
        rank_input: bool = False,
    ) -> Locator:
        """`kept`: the signature inputs that are HLO parameters; `rank_input`: the int32 rank
        input follows them."""
        callers: dict[str, Instruction] = {}
        users: dict[tuple[str, str], Instruction] = {}
        names = {c.name for c in module.computations}
        for ins in module.instructions():
            for operand in ins.operands:
                users.setdefault((ins.computation, operand), ins)
            for key in _CALLING_ATTRS:
                for called in re.findall(r"[\w.\-]+", ins.attrs.get(key, "")):
                    if called in names:
                        callers.setdefault(called, ins)
        prefixes = collections.Counter(
            i.op_name.split("/")[0]
            for i in module.entry.instructions
            if i.op_name and "/" in i.op_name
        )
        prefix = prefixes.most_common(1)[0][0] if prefixes else "jit(fn)"
        if program is None:
            return Locator({}, (), callers, users, module.entry.name, prefix)
        nodes = {n.name: n for n in program.graph.nodes if n.op == "call_function"}
        inputs = program.signature.inputs
        kept = range(len(inputs)) if kept is None else kept
        parameters = tuple((inputs[k].name, inputs[k].target) for k in kept)
        if rank_input:
            parameters += ((RANK_INPUT, None),)
        return Locator(nodes, parameters, callers, users, module.entry.name, prefix)

    def place(self, ins: Instruction) -> Place:
        """`instruction`, `opcode`, `node`, `module`, `source` of a finding about `ins`."""
        place: Place = {"instruction": ins.name, "opcode": ins.opcode}
        number = ins.parameter_number if ins.computation == self.entry else None
        if number is not None and number < len(self.parameters):
            place["node"], place["module"] = self.parameters[number]
            return place
        node = self.node_of(ins)
        if node is not None:
            src = source_of(node)
            place["node"] = node.name
            place["module"] = src.module if src else None
            place["source"] = src.location() if src else None
        return place

    def node_of(self, ins: Instruction) -> torch.fx.Node | None:
        """The node of `ins`'s op_name; else of its first users' (constants carry no
        metadata); else, inside a called computation, of the instruction calling it."""
        seen: set[str] = set()
        current: Instruction | None = ins
        while current is not None and current.computation not in seen:
            user: Instruction | None = current
            for _ in range(_USER_DEPTH):
                node = self.named_node(user) if user is not None else None
                if node is not None:
                    return node
                user = self.users.get((user.computation, user.name)) if user else None
            seen.add(current.computation)
            current = self.callers.get(current.computation)
        return None

    def named_node(self, ins: Instruction) -> torch.fx.Node | None:
        """The node `ins`'s own op_name names (None for an instruction without one)."""
        # op_name = "jit(fn)/<node name>/<primitive>" (nested scopes add components); inside a
        # nested jit's computation it is relative ("add") and names no node
        parts = (ins.op_name or "").split("/")
        if parts[0] == self.prefix:
            for part in parts[1:]:
                if part in self.nodes:
                    return self.nodes[part]
        return None


def merge(findings: Iterable[Finding]) -> list[Finding]:
    """Fold findings with the same severity, code, node and source into one with a count.

    Without a node, findings are kept per instruction."""
    merged: dict[tuple, Finding] = {}
    for f in findings:
        key = (f.severity, f.code, f.node, f.source) if f.node else (id(f),)
        if key in merged:
            first = merged[key]
            merged[key] = dataclasses.replace(first, count=first.count + f.count)
        else:
            merged[key] = f
    order = {Severity.ERROR: 0, Severity.WARNING: 1}
    return sorted(merged.values(), key=lambda f: order[f.severity])
