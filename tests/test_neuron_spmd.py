"""Neuron per-rank HLO (backends/neuron/collectives.py): explicit replica groups of global ranks in
NxD order, ONE HLO for every rank (a program that needs its rank's coordinate takes the NxD rank as
an int32 input, `rank_id`), the manifest's rank map, and the validator's group and rank-input
checks. The written HLO itself is executed as a replicated program (num_replicas = 4) on 4 XLA
CPU devices, each replica given its own rank id, and must reproduce the single-device result.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import portable
from portable.ir.plan import Mesh
from portable.ir.sharding import Sharding, coords_of, shard, unshard
from portable.ir.spmd import SpmdLayout, TensorLayout

pytest.importorskip("jax")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_xla_spmd import tp_mlp_program  # noqa: E402

from portable.backends.neuron.collectives import RankLayout  # noqa: E402
from portable.backends.neuron.hlo import parse_hlo_text  # noqa: E402
from portable.backends.neuron.validate import validate  # noqa: E402
from portable.ir.plan import Plan  # noqa: E402
from portable.parallel import column_parallel, row_parallel  # noqa: E402
from tests.spmd_cases import (  # noqa: E402
    assert_updated_close,
    noise_elements,
    plan_for,
    reference,
    training_program,
)

ops = torch.ops.portable


def run_replicated(
    proto: bytes, per_rank_args: list[list[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """Execute a serialized HloModuleProto as a replicated program on len(per_rank_args) XLA CPU
    devices (replica r on device r gets per_rank_args[r]); the outputs of each replica."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.lib import xla_client as xc

    n = len(per_rank_args)
    devices = jax.devices("cpu")[:n]
    options = xc.CompileOptions()
    options.num_replicas = n
    options.num_partitions = 1
    options.device_assignment = xc.DeviceAssignment.create(np.arange(n).reshape(n, 1))
    stablehlo = xc._xla.mlir.hlo_to_stablehlo(proto)
    with jax.enable_x64(True):
        exe = devices[0].client.compile_and_load(stablehlo, xc.DeviceList(tuple(devices)), options)
        # one jax.Array per parameter spanning the devices; the "replicated" sharding is only the
        # container: each device holds its own rank's value
        replicated = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices), ("r",)), jax.sharding.PartitionSpec()
        )
        args = []
        for k in range(len(per_rank_args[0])):
            shards = [
                jax.device_put(jnp.from_dlpack(per_rank_args[r][k].contiguous()), devices[r])
                for r in range(n)
            ]
            args.append(
                jax.make_array_from_single_device_arrays(shards[0].shape, replicated, shards)
            )
        outs = exe.execute_sharded(args).disassemble_into_single_device_arrays()
    return [[torch.from_dlpack(outs[k][r]).clone() for k in range(len(outs))] for r in range(n)]


def _groups(text: str, opcode: str) -> list[str]:
    return re.findall(rf"= \S+ {opcode}\(.*?replica_groups=(\{{[\d,{{}}]*\}})", text)


def test_rank_layout_is_nxd_order_and_unknown_axes_are_refused():
    layout = RankLayout.of(Mesh({"tp": 2, "dp": 2}))  # declared minor-first: NxD still puts TP last
    assert layout.order == ("dp", "tp")
    assert layout.groups("tp") == [[0, 1], [2, 3]] and layout.groups("dp") == [[0, 2], [1, 3]]
    assert [layout.nxd_of_portable(r) for r in range(4)] == [0, 2, 1, 3]
    layout = RankLayout.of(Mesh({"pp": 2, "fsdp": 2, "cp": 2, "mp": 2}))
    assert layout.groups("mp")[0] == [0, 1] and layout.groups("pp")[0] == [0, 8]
    with pytest.raises(portable.PlanError, match="'ep' has no NxD role") as info:
        RankLayout.of(Mesh({"ep": 2}))
    assert "fix: rename the axis" in str(info.value)


def _lower(program, tmp_path) -> tuple[dict, dict, str]:
    """(manifest, its one program, that program's HLO text) of the neuron lowering."""
    portable.lower(program, "neuron", tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    (prog,) = manifest["programs"]  # one HLO for every rank
    return manifest, prog, (tmp_path / prog["files"]["hlo_text"]).read_text()


def _rank_args(program, values: dict, used: list[str]) -> list[list[torch.Tensor]]:
    """Per NxD rank: its shard of every used input, then its rank id (int32 scalar). The meshes
    here are declared in NxD order (dp, tp), so portable rank r is NxD rank r."""
    spmd = program.spmd
    mesh = spmd.mesh
    layout = RankLayout.of(mesh)
    assert [layout.nxd_of_portable(r) for r in range(mesh.size)] == list(range(mesh.size))
    return [
        [shard(values[n], spmd.input(n).sharding, mesh, r) for n in used]
        + [torch.tensor(r, dtype=torch.int32)]
        for r in range(mesh.size)
    ]


def _unshard(program, outs: list[list[torch.Tensor]], k: int, name: str) -> torch.Tensor:
    mesh = program.spmd.mesh
    sharding = program.spmd.output(name).sharding
    return unshard([outs[r][k] for r in range(mesh.size)], sharding, mesh)


def test_rank_coordinates_are_computed_from_the_rank_id():
    layout = RankLayout.of(Mesh({"pp": 2, "dp": 3, "tp": 2}))
    formulas = {a: layout.coordinate_formula(a) for a in ("pp", "dp", "tp")}
    assert formulas == {"pp": "rank_id / 6", "dp": "rank_id / 2 % 3", "tp": "rank_id % 2"}
    mesh = layout.mesh
    for rank in range(mesh.size):
        coords = coords_of(mesh, rank)  # declared in NxD order: portable rank == NxD rank
        assert {a: layout.coordinate_of(rank, a) for a in mesh.names} == coords


def test_local_shard_program_is_one_hlo_with_a_rank_input(tmp_path):
    program, inputs, expected = tp_mlp_program()
    manifest, prog, text = _lower(program, tmp_path)
    spmd = manifest["spmd"]
    assert spmd["world_size"] == 4 and spmd["program_of_rank"] == ["tp_mlp"] * 4
    assert spmd["distinct_programs"] == "one HLO for every rank"
    assert [r["core"] for r in spmd["ranks"]] == [0, 1, 2, 3]
    assert [d.name for d in (tmp_path / "programs").iterdir()] == ["tp_mlp"]
    assert prog["ranks"] == [0, 1, 2, 3]
    rank_input = prog["rank_input"]
    assert rank_input["parameter"] == 3 and rank_input["name"] == "rank_id"
    assert rank_input["dtype"] == "int32" and rank_input["coordinates"] == {"tp": "rank_id % 2"}
    last = prog["io_spec"]["inputs"][-1]
    assert (last["index"], last["name"], last["role"]) == (3, "rank_id", "rank")
    assert (last["shape"], last["dtype"], last["hlo_type"]) == ([], "int32", "s32[]")
    assert last["donated_to"] is None and prog["parameters"] == 4
    by_axis = {c["axis"]: c["replica_groups"] for c in prog["replica_groups"]}
    assert by_axis == {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
    assert _groups(text, "all-reduce")[0] == "{{0,1},{2,3}}"
    # the tp coordinate in the graph: rank_id % 2, then a dynamic-slice of the chunk
    assert re.search(r"%rank_id\S* = s32\[\] parameter\(3\)", text)
    assert re.search(r"s32\[\] remainder\(%rank_id", text) and " dynamic-slice(" in text
    assert "replica-id" not in text and "partition-id" not in text
    # run THAT HLO on all 4 replicas, each with its own rank id
    names = [s.name for s in program.signature.inputs]
    args = _rank_args(program, dict(zip(names, inputs, strict=True)), names)
    outs = run_replicated((tmp_path / prog["files"]["hlo"]).read_bytes(), args)
    for k in (0, 2, 3, 4):
        got = _unshard(program, outs, k, str(k))
        torch.testing.assert_close(got, expected[k], rtol=1e-5, atol=1e-5)


class _RankInputs(torch.nn.Module):
    """One rank over dp x tp: a max reduce_scatter over dp (the MAJOR axis: rank_id / 2) and a
    local_shard over tp (the minor one: rank_id % 2)."""

    def forward(self, x):  # x: [4, 6] replicated
        top = ops.wait(ops.reduce_scatter(x * x, "max", 0, "dp", 2))  # [2, 6]
        return ops.wait(ops.local_shard(top, 1, "tp", 2)), ops.wait(
            ops.all_reduce(x, "sum", "dp", 2)
        )


def _rank_inputs_program() -> portable.Program:
    program = portable.capture(_RankInputs(), (torch.zeros(4, 6),), name="rank_inputs")
    replicated = Sharding(((), ()))
    mesh = Mesh({"dp": 2, "tp": 2})
    program.plan = Plan(mesh)
    program.spmd = SpmdLayout(
        mesh,
        (TensorLayout("x", replicated, (4, 6)),),
        (
            TensorLayout("0", Sharding((("dp",), ("tp",))), (4, 6)),
            TensorLayout("1", replicated, (4, 6)),
        ),
    )
    return program


def test_max_reduce_scatter_and_local_shard_take_their_coordinates_from_the_rank(tmp_path):
    program = _rank_inputs_program()
    _, prog, text = _lower(program, tmp_path)
    assert prog["rank_input"]["coordinates"] == {"dp": "rank_id / 2", "tp": "rank_id % 2"}
    assert "reduce-scatter" not in text and text.count(" dynamic-slice(") == 2
    x = torch.randn(4, 6)
    outs = run_replicated(
        (tmp_path / prog["files"]["hlo"]).read_bytes(), _rank_args(program, {"x": x}, ["x"])
    )
    # every rank sees the same x: max over dp of x*x is x*x, sum over dp is 2x
    torch.testing.assert_close(_unshard(program, outs, 0, "0"), x * x)
    torch.testing.assert_close(_unshard(program, outs, 1, "1"), 2 * x)


def test_validator_accepts_the_rank_input_and_refuses_replica_id(tmp_path):
    program, _, _ = tp_mlp_program()
    payload = portable.lower(program, "neuron").payload  # NeuronLowered
    (record,) = payload.programs
    assert record.rank_parameter == 3
    layout = RankLayout.of(Mesh({"dp": 2, "tp": 2}))

    def check(text: str, rank_parameter: int | None = 3):
        found = validate(
            parse_hlo_text(text),
            payload.target,
            program=record.program,
            ranks=layout,
            rank_parameter=rank_parameter,
        )
        return [f for f in found if f.severity.name == "ERROR"]

    assert check(record.hlo_text) == []
    (missing,) = check(record.hlo_text, rank_parameter=None)
    assert missing.code == "parameters" and "4 parameters for 3 signature inputs" in missing.what
    # the rank read with replica-id instead of the parameter: refused, the fix names the input
    with_replica_id = re.sub(
        r"(%rank_id\S*) = s32\[\] parameter\(3\)", r"\1 = u32[] replica-id()", record.hlo_text
    )
    errors = check(with_replica_id, rank_parameter=None)
    (refused,) = [f for f in errors if f.code == "replica-id"]
    assert "pass the rank id as an int32 input" in refused.render()
    wrong_type = re.sub(
        r"(%rank_id\S*) = s32\[\] parameter\(3\)", r"\1 = s64[] parameter(3)", record.hlo_text
    )
    assert [f.code for f in check(wrong_type)] == ["rank-parameter-type"]


def test_portable_check_accepts_the_per_rank_output_lower_just_validated(tmp_path, capsys):
    """`portable lower ARCHIVE -t neuron:trn3` of a per-rank program with a rank input, then
    `portable check` of that output: the rank input and replica groups are checked in the same
    context as when lowering (was: "HLO has 4 parameters for 3 signature inputs", exit 6)."""
    from portable.cli import ExitCode, main

    program, _, _ = tp_mlp_program()
    archive = program.save(tmp_path / "tp_mlp.portable")
    out = tmp_path / "out"
    assert main(["lower", str(archive), "-t", "neuron:trn3", "-o", str(out), "-q"]) == 0
    capsys.readouterr()
    assert main(["check", str(out), "--strict", "--json"]) == ExitCode.OK
    doc = json.loads(capsys.readouterr().out)
    assert (doc["errors"], doc["warnings"]) == (0, 0), doc
    # the rank input is still checked: an HLO whose rank input is not s32[] is refused
    hlo_text = out / "neuron_trn3" / "programs" / "tp_mlp" / "model" / "graph.hlo.txt"
    proto = out / "neuron_trn3" / "programs" / "tp_mlp" / "model" / "graph.hlo"
    from portable.backends.neuron.hlo import proto_from_text

    proto.write_bytes(
        proto_from_text(
            re.sub(
                r"(%rank_id\S*) = s32\[\] parameter\(3\)",
                r"\1 = s64[] parameter(3)",
                hlo_text.read_text(),
            )
        )
    )
    assert main(["check", str(out), "--json"]) == ExitCode.CHECK_FINDINGS
    codes = {
        f["code"] for p in json.loads(capsys.readouterr().out)["programs"] for f in p["findings"]
    }
    assert "rank-parameter-type" in codes


def test_validator_checks_replica_groups(tmp_path):
    program, _, _ = tp_mlp_program()
    payload = portable.lower(program, "neuron").payload  # NeuronLowered
    record = payload.programs[0]
    layout = RankLayout.of(Mesh({"dp": 2, "tp": 2}))

    def check(text: str):
        return validate(
            parse_hlo_text(text),
            payload.target,
            program=record.program,
            ranks=layout,
            rank_parameter=record.rank_parameter,
        )

    bad = record.hlo_text.replace(
        "replica_groups={{0,1},{2,3}}", "replica_groups={{0,1},{1,3,4}}", 1
    )
    codes = [f for f in check(bad) if f.code.startswith("replica-groups")]
    text = "\n".join(f.render() for f in codes)
    assert "outside the world of 4" in text and "missing [2]" in text and "repeated [1]" in text
    assert "differ in size" in text
    assert all(f.node == "all_reduce" for f in codes) and "test_xla_spmd.py" in codes[0].source
    wrong_size = record.hlo_text.replace(
        "replica_groups={{0,1},{2,3}}", "replica_groups={{0,1,2,3}}", 1
    )
    assert any("over mesh axis 'tp' (size 2) has groups of 4" in f.what for f in check(wrong_size))


def _run_gpt_step(per_rank, prog: dict, flat: list, tmp_path) -> list[list[torch.Tensor]]:
    """Run the written HLO on 4 replicas: every rank gets its shard of the global state and
    batch (and its rank id if the program takes one)."""
    values = {s.name: v for s, v in zip(per_rank.signature.inputs, flat, strict=True)}
    used = [i["name"] for i in prog["io_spec"]["inputs"] if i["role"] != "rank"]
    args = _rank_args(per_rank, values, used)
    if prog["rank_input"] is None:
        args = [a[:-1] for a in args]
    return run_replicated((tmp_path / prog["files"]["hlo"]).read_bytes(), args)


def _assert_step_matches(program, per_rank, flat, outs) -> None:
    want_losses, want_outputs = reference(program, flat, steps=1)
    for k, out in enumerate(per_rank.signature.outputs):
        got = _unshard(per_rank, outs, k, out.name)
        want = want_outputs[out.name]
        if out.name.endswith(".updated") and not out.name.startswith("optimizer."):
            noise = noise_elements(want_outputs, out.name, steps=1)  # see tests/spmd_cases.py
            assert_updated_close(got, want, noise, out.name, steps=1)
        else:  # float64 (the lr) comes back float32: the fp64 downcast
            torch.testing.assert_close(
                got, want, rtol=1e-5, atol=1e-5, msg=out.name, check_dtype=False
            )
    torch.testing.assert_close(
        _unshard(per_rank, outs, 0, per_rank.signature.outputs[0].name),
        want_losses[0],
        rtol=1e-5,
        atol=1e-5,
    )


def test_gpt_full_dp_tp_plan_is_one_hlo_with_a_rank_input(tmp_path, example_spec):
    from portable.passes.spmd_partition import partition

    # GPT's fused qkv, column-parallel under the full plan, is sliced per rank with local_shard
    program, flat = training_program(example_spec("gpt"))
    per_rank, _ = partition(program.replace(plan=plan_for("gpt", "dp_tp")))
    assert any(str(n.target) == "portable.local_shard.default" for n in per_rank.graph.nodes)
    manifest, prog, text = _lower(per_rank, tmp_path)
    assert manifest["spmd"]["program_of_rank"] == ["GPT.train_step"] * 4
    assert prog["rank_input"]["coordinates"] == {"tp": "rank_id % 2"}
    assert prog["io_spec"]["inputs"][-1]["role"] == "rank"
    assert "replica-id" not in text and "partition-id" not in text
    outs = _run_gpt_step(per_rank, prog, flat, tmp_path)
    _assert_step_matches(program, per_rank, flat, outs)


def test_gpt_dp_tp_per_rank_hlo_reproduces_the_single_device_step(tmp_path, example_spec):
    from portable.passes.spmd_partition import partition

    # with only its MLPs column/row parallel, GPT needs no coordinate: no rank input
    program, flat = training_program(example_spec("gpt"))
    plan = Plan(
        Mesh({"dp": 2, "tp": 2}),
        rules=[
            *column_parallel(r"blocks\.\d+\.mlp\.fc"),
            *row_parallel(r"blocks\.\d+\.mlp\.proj"),
        ],
        batch_axes=("dp",),
    )
    per_rank, _ = partition(program.replace(plan=plan))
    manifest, prog, text = _lower(per_rank, tmp_path)
    assert manifest["spmd"]["program_of_rank"] == ["GPT.train_step"] * 4
    assert prog["rank_input"] is None
    assert all(i["role"] != "rank" for i in prog["io_spec"]["inputs"])
    groups = set(_groups(text, "all-reduce")) | set(_groups(text, "all-gather"))
    assert groups and groups <= {"{{0,1},{2,3}}", "{{0,2},{1,3}}"}
    assert {c["axis"] for c in prog["replica_groups"]} == {"dp", "tp"}
    outs = _run_gpt_step(per_rank, prog, flat, tmp_path)
    _assert_step_matches(program, per_rank, flat, outs)
