"""Per-core HBM estimate of one program, against the target's budget.

    state        = weights (parameters) + buffers + constants + optimizer state   (signature kinds
                   of the inputs that are HLO parameters)
    inputs       = user inputs (the batch)
    gradients    = parameter bytes for a training step (one gradient per parameter), else 0
    activations  = peak of live intermediate bytes over the HLO entry computation run in the
                   program's order (each instruction at the place of the graph node its op_name
                   names, after its operands; the printed post-order would compute the whole
                   forward first, undoing a `remat` pass's placement of recomputed ops): each
                   result is allocated where it is defined and freed after its last use;
                   parameters (counted above), tuples, get-tuple-element, bitcast and reshape
                   (views) allocate nothing, and results written into donated inputs (aliased
                   outputs) reuse those inputs' bytes
    total        = state + inputs + gradients + activations

The activation peak ignores fusion and the compiler's own rematerialization, which only lower
it, and the compiler's scheduling and common-subexpression elimination (which may merge a
recomputed op with its forward twin again); it includes the gradient temporaries that
`gradients` counts again: the total is a conservative estimate, not a measurement (the real
figure comes from the compiler and the device). `intermediates_bytes` (the sum of every
intermediate result) is reported as the loose upper bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from portable.ir.program import Program, ProgramKind
from portable.ir.signature import InputKind, TensorSpec

from .findings import Locator
from .hlo import HloModule, Instruction
from .targets import NeuronTarget

__all__ = ["MemoryEstimate", "estimate_memory", "spec_bytes"]

# results that name (part of) an existing buffer instead of allocating one
_VIEWS = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "reshape"})

METHOD = (
    "state and inputs from the signature; gradients = parameter bytes (training); activations = "
    "peak live intermediate bytes with HLO instructions in the program's node order, without "
    "fusion, the compiler's rematerialization or scheduling; "
    "conservative (gradient temporaries are counted in both)"
)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    buffers_bytes: int
    constants_bytes: int
    optimizer_state_bytes: int
    inputs_bytes: int
    gradients_bytes: int
    activations_bytes: int
    intermediates_bytes: int
    budget_bytes: int
    budget_basis: str

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.buffers_bytes
            + self.constants_bytes
            + self.optimizer_state_bytes
            + self.inputs_bytes
            + self.gradients_bytes
            + self.activations_bytes
        )

    @property
    def utilization(self) -> float:
        return self.total_bytes / self.budget_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "total_bytes": self.total_bytes,
            "utilization": round(self.utilization, 6),
            "method": METHOD,
        }


def spec_bytes(spec: TensorSpec) -> int:
    itemsize = spec.dtype.itemsize
    return math.prod(int(d) for d in spec.shape) * itemsize


def estimate_memory(
    program: Program,
    module: HloModule,
    target: NeuronTarget,
    kept: Sequence[int] | None = None,
) -> MemoryEstimate:
    """The per-core HBM estimate of `program` lowered to `module` (see the module docstring).

    `kept`: the signature inputs that are HLO parameters (default all); the others are never
    passed to the device and take no HBM."""
    inputs = program.signature.inputs
    on_device = [inputs[k] for k in (range(len(inputs)) if kept is None else kept)]

    def total(*kinds: InputKind) -> int:
        return sum(spec_bytes(i.spec) for i in on_device if i.kind in kinds)

    weights = total(InputKind.PARAMETER)
    training = program.kind is ProgramKind.TRAINING_STEP
    peak, intermediates = _activation_bytes(module, _in_program_order(module, program, kept))
    return MemoryEstimate(
        weights_bytes=weights,
        buffers_bytes=total(InputKind.BUFFER),
        constants_bytes=total(InputKind.CONSTANT),
        optimizer_state_bytes=total(InputKind.OPTIMIZER_STATE),
        inputs_bytes=total(InputKind.USER_INPUT),
        gradients_bytes=weights if training else 0,
        activations_bytes=peak,
        intermediates_bytes=intermediates,
        budget_bytes=target.hbm_per_core_bytes,
        budget_basis=target.hbm_basis,
    )


def _in_program_order(
    module: HloModule, program: Program, kept: Sequence[int] | None
) -> list[Instruction]:
    """The entry computation's instructions ordered as the program runs their nodes, ties in
    printed order (which is topological). Each instruction whose op_name names a node goes at
    the latest of that node's position and its operands' places; one that names none goes with
    its operands, or (a constant, an iota: no operands) at its first user's place."""
    entry = module.entry.instructions
    locate = Locator.of(module, program, kept)
    position = {node: k for k, node in enumerate(program.graph.nodes)}
    place: dict[str, int] = {}
    leaves = []
    for ins in entry:
        node = None if ins.opcode == "parameter" else locate.named_node(ins)
        if node is None and not ins.operands and ins.opcode != "parameter":
            leaves.append(ins)
            continue
        own = position.get(node, -1) if node is not None else -1
        place[ins.name] = max([own, *(place.get(o, -1) for o in ins.operands)])
    users: dict[str, list[int]] = {}
    for ins in entry:
        for operand in ins.operands:
            users.setdefault(operand, []).append(place.get(ins.name, -1))
    for ins in leaves:
        place[ins.name] = min(users.get(ins.name, [-1]))
    printed = {ins.name: k for k, ins in enumerate(entry)}
    return sorted(entry, key=lambda ins: (place[ins.name], printed[ins.name]))


def _activation_bytes(module: HloModule, entry: Sequence[Instruction]) -> tuple[int, int]:
    """(peak live intermediate bytes, sum of intermediate bytes) of the entry computation's
    instructions `entry`, run in that order."""
    position = {ins.name: k for k, ins in enumerate(entry)}
    donated = _donated_results(module)
    # the buffers each value refers to: itself, or (for views) its operands' buffers
    owners: dict[str, frozenset[str]] = {}
    size: dict[str, int] = {}
    for ins in entry:
        if ins.opcode in _VIEWS:
            owners[ins.name] = frozenset().union(
                *(owners.get(o, frozenset()) for o in ins.operands)
            )
        else:
            owners[ins.name] = frozenset({ins.name})
            size[ins.name] = 0 if ins.name in donated else ins.nbytes
    last_use = {name: position[name] for name in size}
    for ins in entry:
        for operand in ins.operands:
            for buffer in owners.get(operand, ()):
                last_use[buffer] = max(last_use[buffer], position[ins.name])
    for buffer in owners.get(module.entry.root.name, ()):
        last_use[buffer] = len(entry)  # results stay live to the end
    frees: dict[int, list[str]] = {}
    for buffer, k in last_use.items():
        frees.setdefault(k, []).append(buffer)
    live = peak = 0
    for k, ins in enumerate(entry):
        live += size.get(ins.name, 0)
        peak = max(peak, live)
        live -= sum(size[b] for b in frees.get(k, ()))
    return peak, sum(size.values())


def _donated_results(module: HloModule) -> set[str]:
    """Instructions whose value is written into a donated (aliased) input buffer."""
    root = module.entry.root
    if root.opcode != "tuple":
        return set()
    result = set()
    for alias in module.aliases:
        if len(alias.output_index) == 1 and alias.output_index[0] < len(root.operands):
            result.add(root.operands[alias.output_index[0]])
    return result
