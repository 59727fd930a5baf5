"""Replica groups in both HloInstructionProto fields (backends/neuron/proto_groups.py): the written
graph.hlo, decoded from its bytes, carries each grouped collective's groups in the deprecated
`replica_groups` (49) and in `collective_device_list` (87), the same groups; collective-permute
keeps its source_target_pairs and gets no groups; the rewrite is deterministic and idempotent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import portable

pytest.importorskip("jax")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_xla_spmd import tp_mlp_program  # noqa: E402

from portable.backends.neuron.proto_groups import (  # noqa: E402
    collective_groups,
    fill_replica_groups,
)
from portable.backends.neuron.wire import encode_field, encode_varint, fields  # noqa: E402

_PERMUTE = """
func.func public @main(%x: tensor<4xf32>) -> tensor<4xf32> {
  %0 = "stablehlo.collective_permute"(%x) {
    source_target_pairs = dense<[[0, 1], [1, 2], [2, 3], [3, 0]]> : tensor<4x2xi64>
  } : (tensor<4xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}
"""


def _proto_of(stablehlo: str) -> bytes:
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        module = ir.Module.parse(stablehlo)
        bytecode = mlir.module_to_bytecode(module)
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(
        bytecode, use_tuple_args=False, return_tuple=True
    )
    return computation.as_serialized_hlo_module_proto()


def test_the_written_graph_hlo_has_the_groups_in_both_fields(tmp_path):
    program, _, _ = tp_mlp_program()  # all-reduce, all-gather, reduce-scatter, all-to-all
    portable.lower(program, "neuron", tmp_path)
    (hlo,) = tmp_path.glob("programs/*/model/graph.hlo")
    found = collective_groups(hlo.read_bytes())
    assert {c.opcode for c in found} == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all"}
    for c in found:
        assert c.replica_groups == c.device_list, c
        assert sorted(map(sorted, c.replica_groups)) in ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    # the groups the manifest lists are the ones in the proto, in emission order
    record = portable.lower(program, "neuron").payload.programs[0]
    assert [c.replica_groups for c in found] == [e["replica_groups"] for e in record.collectives]


def test_the_rewrite_is_deterministic_idempotent_and_read_back_by_xla():
    from portable.backends.neuron.hlo import proto_to_text

    program, _, _ = tp_mlp_program()
    first = portable.lower(program, "neuron").payload.programs[0].hlo
    again = portable.lower(program, "neuron").payload.programs[0].hlo
    assert first == again and fill_replica_groups(first) == first
    text = proto_to_text(first)  # XLA parses the rewritten bytes
    assert "replica_groups={{0,1},{2,3}}" in text


def test_jaxlib_writes_only_the_new_field_and_the_rewrite_adds_the_old_one():
    program, _, _ = tp_mlp_program()
    record = portable.lower(program, "neuron").payload.programs[0]
    # strip field 49 again: what jaxlib produced before the rewrite
    stripped = _strip_old_field(record.hlo)
    assert all(not c.replica_groups and c.device_list for c in collective_groups(stripped))
    assert fill_replica_groups(stripped) == record.hlo


def test_collective_permute_keeps_its_pairs_and_gets_no_groups():
    proto = _proto_of(_PERMUTE)
    (permute,) = collective_groups(proto)
    assert permute.opcode == "collective-permute"
    assert permute.source_target_pairs == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert fill_replica_groups(proto) == proto  # nothing to fill: pairs are one field in both


def test_the_iota_form_of_the_new_field_is_expanded():
    # groups {{0,2},{1,3}} as XLA's iota list: iota(4).reshape(2, 2).transpose(1, 0).reshape(2, 2)
    iota = (
        encode_varint(1 << 3)
        + encode_varint(2)  # num_replica_groups
        + encode_varint(2 << 3)
        + encode_varint(2)  # num_devices_per_group
        + encode_field(3, [2, 2])  # iota_reshape_dims
        + encode_field(4, [1, 0])  # iota_transpose_perm
    )
    ins = (
        encode_field(1, b"ar")
        + encode_field(2, b"all-reduce")
        + encode_field(87, encode_field(2, iota))
    )
    module = encode_field(3, encode_field(2, ins))
    filled = fill_replica_groups(module)
    (c,) = collective_groups(filled)
    assert c.device_list == c.replica_groups == [[0, 2], [1, 3]]
    (computation,) = fields(filled)
    assert computation.number == 3


def _strip_old_field(proto: bytes) -> bytes:
    from portable.backends.neuron.proto_groups import _map_field
    from portable.backends.neuron.wire import drop_field

    def ins(b: bytes) -> bytes:
        return drop_field(b, 49)

    return _map_field(proto, 3, lambda comp: _map_field(comp, 2, ins))
