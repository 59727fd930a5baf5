"""Neuron topologies (backends/neuron/targets.py): nodes of each Trn generation as target options,
NxD's trn1 TP=4 rank layout, per-node NEURON_RT_VISIBLE_CORES, and the runtime's limits on
replica groups (at most 12 distinct per NEFF; groups across nodes symmetric)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import portable
from portable.backends.neuron.collectives import RankLayout, placement
from portable.backends.neuron.hlo import parse_hlo_text
from portable.backends.neuron.options import NeuronOptions
from portable.backends.neuron.runtime_env import visible_cores
from portable.backends.neuron.targets import TARGETS, resolve_target
from portable.backends.neuron.validate import validate
from portable.errors import BackendError
from portable.ir.plan import Mesh
from portable.ir.sharding import coords_of

sys.path.insert(0, str(Path(__file__).resolve().parent))


# -- topologies as target options --------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, topology, chips, cores, domain_chips",
    [
        ("trn3", None, 16, 64, 64),  # trn3's default: a Gen1 UltraServer server
        ("trn3", "trn3-gen1", 16, 64, 64),  # 4 servers x 16 chips
        ("trn3", "trn3-gen2", 4, 16, 144),  # 36 servers x 4 chips
        ("trn2", None, 16, 64, 16),  # trn2.48xlarge, LNC=2
        ("trn2", "trn2-ultraserver", 16, 64, 64),  # 4 x trn2.48xlarge
        ("trn1", None, 16, 32, 16),  # trn1.32xlarge: 2 cores per chip
    ],
)
def test_each_topology_sets_the_node_size(variant, topology, chips, cores, domain_chips):
    target = resolve_target(variant, topology)
    assert target.name == variant and target.compiler_target == variant  # the compile is the same
    assert target.chips_per_node == chips and target.cores_per_node == cores
    shown = target.topology.to_json(target.cores_per_chip)
    assert shown["chips_per_domain"] == domain_chips and shown["cores_per_node"] == cores


def test_a_topology_of_another_generation_or_unknown_is_refused_with_the_choices():
    with pytest.raises(BackendError, match="'trn3-gen2' is not a neuron:trn2 topology") as info:
        resolve_target("trn2", "trn3-gen2")
    assert "topologies of neuron:trn2: trn2, trn2-ultraserver" in str(info.value)
    with pytest.raises(BackendError, match="topology='gen3' is not one of"):
        NeuronOptions(topology="gen3")
    backend = portable.backends.get_backend("neuron")
    assert backend.parse_options("topology=trn3-gen2").topology == "trn3-gen2"


def test_ranks_fill_chips_then_nodes_of_the_topology():
    gen2 = resolve_target("trn3", "trn3-gen2")
    assert placement(gen2, 15) == {"node": 0, "chip": 3, "core": 3}
    assert placement(gen2, 16) == {"node": 1, "chip": 0, "core": 0}
    assert placement(resolve_target("trn3"), 16) == {"node": 0, "chip": 4, "core": 0}
    assert placement(TARGETS["trn1"], 33) == {"node": 1, "chip": 0, "core": 1}


# -- NxD's trn1 TP=4 layout ----------------------------------------------------------------------


def _nxd_trn1_tp4(world: int, pp: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(TP, DP, PP) groups as neuronx-distributed's parallel_state.initialize_model_parallel
    builds them for tensor_model_parallel_size == 4 (its loops, transcribed)."""
    tp_size, per_stage = 4, world // pp
    dp_groups = []
    for p in range(pp):
        start, end = p * per_stage, (p + 1) * per_stage
        for i in range(tp_size):
            ranks: list[int] = []
            for j in range(start + i * 8, end, 32):
                ranks += range(j, j + 8)
            dp_groups.append(ranks)
    tp_groups = [list(range(i + j, i + 32, 8)) for i in range(0, world, 32) for j in range(8)]
    pp_groups = [list(range(i, world, per_stage)) for i in range(per_stage)]
    return tp_groups, dp_groups, pp_groups


@pytest.mark.parametrize("mesh", [{"dp": 16, "tp": 4}, {"pp": 2, "dp": 8, "tp": 4}])
def test_trn1_tp4_groups_are_nxds_non_contiguous_ones(mesh):
    layout = RankLayout.of(Mesh(mesh), TARGETS["trn1"])
    tp, dp, pp = _nxd_trn1_tp4(layout.world_size, mesh.get("pp", 1))
    assert layout.groups("tp") == sorted(tp)
    assert layout.groups("tp")[:2] == [[0, 8, 16, 24], [1, 9, 17, 25]]
    assert layout.groups("dp") == sorted(dp)
    if "pp" in mesh:
        assert layout.groups("pp") == sorted(pp)
    assert "stride 8" in layout.rank_order
    # every TP group stays on one trn1.32xlarge node
    for group in layout.groups("tp"):
        assert len({placement(TARGETS["trn1"], r)["node"] for r in group}) == 1


def test_trn1_tp4_coordinates_round_trip_through_the_rank_formula():
    mesh = Mesh({"pp": 2, "dp": 16, "tp": 4})
    layout = RankLayout.of(mesh, TARGETS["trn1"])
    assert layout.coordinate_formula("tp") == "rank_id / 8 % 4"
    assert layout.coordinate_formula("dp") == "(rank_id / 32 % 2) * 8 + rank_id % 8"
    seen = set()
    for portable_rank in range(mesh.size):
        coords = coords_of(mesh, portable_rank)
        rank = layout.nxd_rank(coords)
        seen.add(rank)
        assert {a: layout.coordinate_of(rank, a) for a in mesh.names} == coords
    assert seen == set(range(mesh.size))


@pytest.mark.parametrize(
    "variant, mesh",
    [("trn2", {"dp": 16, "tp": 4}), ("trn1", {"dp": 2, "tp": 4}), ("trn1", {"dp": 8, "tp": 2})],
)
def test_other_targets_and_partial_trn1_nodes_keep_the_contiguous_order(variant, mesh):
    # NxD's trn1 TP=4 loops assume whole 32-core nodes per stage; elsewhere TP is contiguous
    layout = RankLayout.of(Mesh(mesh), TARGETS[variant])
    assert layout.groups("tp")[0] == list(range(mesh["tp"]))
    assert layout.rank_order.startswith("row-major")


# -- NEURON_RT_VISIBLE_CORES per node ------------------------------------------------------------


def test_visible_cores_are_a_range_of_each_nodes_own_cores():
    env = visible_cores(TARGETS["trn2"], 128)  # two trn2.48xlarge at LNC=2
    assert env["value"] == "0-63"
    assert env["per_node"] == [
        {"node": 0, "ranks": "0-63", "value": "0-63"},
        {"node": 1, "ranks": "64-127", "value": "0-63"},
    ]
    assert "set per node" in env["why"]
    env = visible_cores(resolve_target("trn3", "trn3-gen2"), 24)  # 16 cores per Gen2 server
    assert [e["value"] for e in env["per_node"]] == ["0-15", "0-7"]
    assert "the last node runs 8 ranks" in env["why"]
    assert visible_cores(TARGETS["trn1"], 64)["value"] == "0-31"


def test_the_manifest_records_the_topology_and_per_node_cores(tmp_path):
    from test_xla_spmd import tp_mlp_program

    program, _, _ = tp_mlp_program()
    options = NeuronOptions(topology="trn2-ultraserver")
    portable.lower(program, "neuron:trn2", tmp_path, options)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["target"]["topology"]["name"] == "trn2-ultraserver"
    assert manifest["target"]["topology"]["chips_per_domain"] == 64
    assert manifest["options"]["topology"] == "trn2-ultraserver"
    cores = manifest["runtime_env"]["NEURON_RT_VISIBLE_CORES"]
    assert cores["value"] == "0-3" and cores["per_node"] == [
        {"node": 0, "ranks": "0-3", "value": "0-3"}
    ]
    assert manifest["spmd"]["nodes"] == 1 and manifest["spmd"]["topology"]["cores_per_node"] == 64
    # `portable check` re-validates on the recorded topology
    checked = portable.backends.get_backend("neuron").check(tmp_path)
    assert all(c.errors == 0 for c in checked)


# -- runtime limits on replica groups ------------------------------------------------------------


def _module(groups: list[str]) -> str:
    """An HLO module with one all-reduce per replica-groups text of `groups`."""
    lines = [
        "HloModule m, entry_computation_layout={(f32[4]{0})->(f32[4]{0})}",
        "",
        "%add (a: f32[], b: f32[]) -> f32[] {",
        "  %a = f32[] parameter(0)",
        "  %b = f32[] parameter(1)",
        "  ROOT %s = f32[] add(f32[] %a, f32[] %b)",
        "}",
        "",
        "ENTRY %main (x: f32[4]) -> (f32[4]) {",
        "  %x = f32[4]{0} parameter(0)",
    ]
    previous = "%x"
    for k, g in enumerate(groups):
        lines.append(
            f"  %ar{k} = f32[4]{{0}} all-reduce(f32[4]{{0}} {previous}), replica_groups={g}, "
            "to_apply=%add"
        )
        previous = f"%ar{k}"
    lines += [f"  ROOT %t = (f32[4]{{0}}) tuple(f32[4]{{0}} {previous})", "}"]
    return "\n".join(lines)


def _codes(text: str, target, code: str) -> list:
    return [f for f in validate(parse_hlo_text(text), target) if f.code == code]


def test_more_than_12_distinct_replica_groups_are_refused_with_the_count_and_the_fix():
    pairs = [f"{{{{0,{k}}}}}" for k in range(1, 14)]  # {{0,1}}, {{0,2}}, ... 13 distinct
    target = TARGETS["trn3"]
    assert _codes(_module(pairs[:12] + pairs[:3]), target, "replica-groups-count") == []
    (finding,) = _codes(_module(pairs), target, "replica-groups-count")
    assert finding.is_error
    assert "13 distinct replica groups" in finding.what and "at most 12 per NEFF" in finding.what
    assert "13 > 12" in finding.what and "fewer distinct plan axes" in finding.fix


def test_a_group_across_nodes_must_have_the_same_ranks_on_each_node():
    gen2 = resolve_target("trn3", "trn3-gen2")  # 16 ranks per node
    uneven = _module(["{{0,8,16},{1,9,17}}"])  # 2 ranks on node 0, 1 on node 1
    (finding,) = _codes(uneven, gen2, "replica-groups-symmetric")
    assert "group [0, 8, 16] spans 2 nodes unevenly (node 0: 2, node 1: 1)" in finding.what
    assert "trn3-gen2: 16 ranks per node" in finding.what and "topology=" in finding.fix
    # the same groups inside one Gen1 server (64 ranks), and an even split across nodes, pass
    assert _codes(uneven, resolve_target("trn3"), "replica-groups-symmetric") == []
    even = _module(["{{0,1,16,17},{2,3,18,19}}"])
    assert _codes(even, gen2, "replica-groups-symmetric") == []


def test_a_trn1_tp4_program_is_lowered_with_nxds_groups_and_rank_formula(tmp_path):
    from portable.ir.plan import Plan
    from portable.passes.spmd_partition import partition
    from tests.spmd_cases import tp_rules, training_program
    from tests.support import load_spec

    program, _ = training_program(load_spec("gpt"))
    plan = Plan(Mesh({"dp": 8, "tp": 4}), rules=tp_rules("gpt"))  # 32 ranks: one trn1.32xlarge
    per_rank, _ = partition(program.replace(plan=plan))
    portable.lower(per_rank, "neuron:trn1", tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (prog,) = manifest["programs"]
    assert prog["rank_input"]["coordinates"] == {"tp": "rank_id / 8"}  # local_shard's chunk
    tp, _, _ = _nxd_trn1_tp4(32, 1)
    groups = {tuple(map(tuple, c["replica_groups"])) for c in prog["replica_groups"]}
    assert groups == {tuple(map(tuple, sorted(tp)))}
    assert manifest["spmd"]["rank_order"].startswith("NxD's trn1 TP=4 layout")
    assert manifest["runtime_env"]["NEURON_RT_VISIBLE_CORES"]["value"] == "0-31"
