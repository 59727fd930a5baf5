"""Replica groups in both HloInstructionProto fields, for compilers built against an older proto.

Recent jaxlib (0.10 here) writes a collective's groups only in `collective_device_list` (field 87,
a CollectiveDeviceListProto: explicit `replica_groups` = 1, or `iota_replica_group_list` = 2);
the field they replace, `replica_groups` (49, repeated ReplicaGroup{repeated int64
replica_ids = 1}), is marked deprecated and left empty. A neuronx-cc whose proto predates field
87 skips it as an unknown field and sees a collective without groups. `fill_replica_groups` writes
the same groups into field 49 of every all-reduce, all-gather, reduce-scatter and all-to-all
(and their -start halves) that lacks them; XLA reads field 87 when present, so both readers see
the same groups. collective-permute has no groups: its `source_target_pairs` (52) is the same
field in old and new protos and is left as it is.

Field numbers: xla/service/hlo.proto (HloModuleProto.computations = 3,
HloComputationProto.instructions = 2, HloInstructionProto.opcode = 2) and xla/xla_data.proto.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .wire import Field, encode_field, fields, packed_varints

__all__ = ["GROUPED_OPCODES", "InstructionGroups", "collective_groups", "fill_replica_groups"]

GROUPED_OPCODES = frozenset(
    {
        "all-reduce",
        "all-reduce-start",
        "all-gather",
        "all-gather-start",
        "reduce-scatter",
        "all-to-all",
    }
)
_COMPUTATIONS, _INSTRUCTIONS, _OPCODE, _NAME = 3, 2, 2, 1
_REPLICA_GROUPS, _SOURCE_TARGET_PAIRS, _DEVICE_LIST = 49, 52, 87
_LIST_GROUPS, _LIST_IOTA = 1, 2  # CollectiveDeviceListProto
_REPLICA_IDS = 1  # ReplicaGroup


@dataclasses.dataclass(frozen=True)
class InstructionGroups:
    """What one collective instruction of a serialized module says about its ranks."""

    name: str
    opcode: str
    replica_groups: list[list[int]]  # field 49 (deprecated)
    device_list: list[list[int]]  # field 87, iota form expanded
    source_target_pairs: list[tuple[int, int]]  # field 52 (collective-permute)


def fill_replica_groups(proto: bytes) -> bytes:
    """`proto` (a serialized HloModuleProto) with field 49 filled from field 87 wherever a grouped
    collective has only field 87; every other byte unchanged."""
    return _map_field(proto, _COMPUTATIONS, _fill_computation)


def collective_groups(proto: bytes) -> list[InstructionGroups]:
    """Every collective instruction of `proto` (grouped ones and collective-permute), in order."""
    out = []
    for computation in _sub(fields(proto), _COMPUTATIONS):
        for ins in _sub(fields(computation), _INSTRUCTIONS):
            parts = fields(ins)
            opcode = _text(parts, _OPCODE)
            if opcode in GROUPED_OPCODES or opcode.startswith("collective-permute"):
                out.append(
                    InstructionGroups(
                        _text(parts, _NAME),
                        opcode,
                        [_ids(g) for g in _sub(parts, _REPLICA_GROUPS)],
                        _device_list(parts),
                        [_pair(p) for p in _sub(parts, _SOURCE_TARGET_PAIRS)],
                    )
                )
    return out


def _fill_computation(computation: bytes) -> bytes:
    return _map_field(computation, _INSTRUCTIONS, _fill_instruction)


def _fill_instruction(ins: bytes) -> bytes:
    parts = fields(ins)
    if _text(parts, _OPCODE) not in GROUPED_OPCODES or _sub(parts, _REPLICA_GROUPS):
        return ins
    groups = _device_list(parts)
    if not groups:
        return ins
    filled = b"".join(encode_field(_REPLICA_GROUPS, encode_field(_REPLICA_IDS, g)) for g in groups)
    # in field-number order, as protobuf serializers write them
    at = next((k for k, f in enumerate(parts) if f.number > _REPLICA_GROUPS), len(parts))
    return b"".join(f.raw for f in parts[:at]) + filled + b"".join(f.raw for f in parts[at:])


def _map_field(message: bytes, number: int, edit: Callable[[bytes], bytes]) -> bytes:
    out = []
    for f in fields(message):
        if f.number == number and f.wire == 2:
            assert isinstance(f.value, bytes)
            new = edit(f.value)
            out.append(f.raw if new == f.value else encode_field(number, new))
        else:
            out.append(f.raw)
    return b"".join(out)


def _sub(parts: list[Field], number: int) -> list[bytes]:
    return [f.value for f in parts if f.number == number and isinstance(f.value, bytes)]


def _text(parts: list[Field], number: int) -> str:
    values = _sub(parts, number)
    return values[0].decode() if values else ""


def _ints(parts: list[Field], number: int) -> list[int]:
    """A repeated integer field, packed (wire 2) or not (wire 0)."""
    values: list[int] = []
    for f in parts:
        if f.number == number:
            values += packed_varints(f.value) if isinstance(f.value, bytes) else [f.value]
    return values


def _ids(group: bytes) -> list[int]:
    return _ints(fields(group), _REPLICA_IDS)


def _pair(pair: bytes) -> tuple[int, int]:
    parts = fields(pair)
    source, target = _ints(parts, 1), _ints(parts, 2)
    return (source[0] if source else 0, target[0] if target else 0)


def _device_list(parts: list[Field]) -> list[list[int]]:
    """Field 87's groups: explicit, or its iota form expanded (XLA's IotaReplicaGroupList:
    iota(prod(dims)).reshape(dims).transpose(perm).reshape(groups, per_group))."""
    lists = _sub(parts, _DEVICE_LIST)
    if not lists:
        return []
    inner = fields(lists[0])
    explicit = [_ids(g) for g in _sub(inner, _LIST_GROUPS)]
    iota = _sub(inner, _LIST_IOTA)
    if explicit or not iota:
        return explicit
    import numpy as np

    spec = fields(iota[0])
    count, size = (_ints(spec, 1) or [0])[0], (_ints(spec, 2) or [0])[0]
    dims = _ints(spec, 3) or [count * size]
    perm = _ints(spec, 4) or list(range(len(dims)))
    ids = np.arange(int(np.prod(dims))).reshape(dims).transpose(perm).reshape(count, size)
    return [[int(r) for r in row] for row in ids]
