"""A minimal protobuf wire-format reader and writer, for the few edits the neuron backend makes to
the serialized HloModuleProto jaxlib produces (no generated proto classes ship with jaxlib).

A message is a sequence of fields, each `key = number << 3 | wire type` and a payload: a varint
(0), 8 bytes (1), a length-prefixed byte string (2: strings, sub-messages, packed repeated
scalars) or 4 bytes (5). Edits keep every other field's bytes as they were, so the output is a
deterministic function of the input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

__all__ = ["Field", "drop_field", "encode_field", "encode_varint", "fields", "packed_varints"]


@dataclasses.dataclass(frozen=True)
class Field:
    number: int
    wire: int  # 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32
    raw: bytes  # the whole field as serialized: key and payload
    value: int | bytes  # the varint's value, or the payload bytes


def fields(message: bytes) -> list[Field]:
    """The top-level fields of `message`, in order (ValueError for malformed bytes)."""
    out, i = [], 0
    while i < len(message):
        start = i
        key, i = _varint(message, i)
        wire = key & 7
        value: int | bytes
        if wire == 0:
            value, i = _varint(message, i)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = message[i : i + size], i + size
        elif wire == 2:
            size, i = _varint(message, i)
            value, i = message[i : i + size], i + size
        else:
            raise ValueError(f"unexpected protobuf wire type {wire} at byte {start}")
        if i > len(message):
            raise ValueError("truncated protobuf message")
        out.append(Field(key >> 3, wire, message[start:i], value))
    return out


def drop_field(message: bytes, number: int) -> bytes:
    """`message` without its top-level fields numbered `number`."""
    return b"".join(f.raw for f in fields(message) if f.number != number)


def packed_varints(payload: bytes) -> list[int]:
    """The values of a packed repeated varint field's payload (int64 values as signed)."""
    values, i = [], 0
    while i < len(payload):
        value, i = _varint(payload, i)
        values.append(value - (1 << 64) if value >= 1 << 63 else value)
    return values


def encode_varint(value: int) -> bytes:
    """`value` as a varint (negative int64 values in two's complement, 10 bytes)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_field(number: int, payload: bytes | Iterable[int]) -> bytes:
    """A length-delimited field: `payload` bytes, or integers written as a packed varint list."""
    data = payload if isinstance(payload, bytes) else b"".join(map(encode_varint, payload))
    return encode_varint(number << 3 | 2) + encode_varint(len(data)) + data


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated protobuf varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
