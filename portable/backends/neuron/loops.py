"""While-loop trip counts: neuronx-cc compiles `while` only when its bound is static."""

from __future__ import annotations

from .hlo import Computation, HloModule, Instruction

__all__ = ["constant_trip_count"]


def constant_trip_count(module: HloModule, ins: Instruction) -> bool:
    """True if the loop's bound is static: XLA's known_trip_count, or the counted-loop pattern
    `i = constant; while (i < constant) { ...; i = i + constant }`."""
    config = ins.attrs.get("backend_config", "")
    if "known_trip_count" in config:
        return True
    cond = module.computation(ins.called("condition") or "")
    body = module.computation(ins.called("body") or "")
    outer = module.computation(ins.computation)
    if cond is None or body is None or outer is None:
        return False
    index = _counter_index(cond)
    if index is None:
        return False
    init = outer.by_name().get(ins.operands[0]) if ins.operands else None
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return False
    if outer.by_name().get(init.operands[index], init).opcode != "constant":
        return False
    step = _tuple_element(body, body.root, index)
    if step is None or step.opcode != "add":
        return False
    kinds = sorted(_operand_kind(body, step, k) for k in range(2))
    return kinds == ["constant", f"counter{index}"]


def _counter_index(cond: Computation) -> int | None:
    root = cond.root
    if root.opcode != "compare" or len(root.operands) != 2:
        return None
    kinds = [_operand_kind(cond, root, k) for k in range(2)]
    counters = [k for k in kinds if k.startswith("counter")]
    if len(counters) == 1 and "constant" in kinds:
        return int(counters[0].removeprefix("counter"))
    return None


def _operand_kind(comp: Computation, ins: Instruction, k: int) -> str:
    """ "constant", "counter<i>" (element i of the loop state) or "other"."""
    operand = comp.by_name().get(ins.operands[k])
    if operand is None:
        return "other"
    if operand.opcode == "constant":
        return "constant"
    if operand.opcode == "get-tuple-element":
        source = comp.by_name().get(operand.operands[0])
        if source is not None and source.opcode == "parameter":
            return f"counter{operand.attrs.get('index', '?')}"
    return "other"


def _tuple_element(comp: Computation, tup: Instruction, index: int) -> Instruction | None:
    if tup.opcode != "tuple" or index >= len(tup.operands):
        return None
    return comp.by_name().get(tup.operands[index])
