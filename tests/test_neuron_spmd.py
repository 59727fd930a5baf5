"""Neuron per-rank HLO (backends/neuron/collectives.py): explicit replica groups of global ranks in
NxD order, one HLO per distinct rank program, the manifest's rank map, and the validator's group
checks. The written HLO itself is executed as a replicated program (num_replicas = 4) on 4 XLA
CPU devices and must reproduce the single-device result.
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

pytest.importorskip("jax")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_xla_spmd import tp_mlp_program  # noqa: E402

from portable.backends.neuron.collectives import RankLayout  # noqa: E402
from portable.backends.neuron.hlo import parse_hlo_text  # noqa: E402
from portable.backends.neuron.validate import validate  # noqa: E402
from portable.ir.plan import Plan  # noqa: E402
from portable.parallel import column_parallel, row_parallel  # noqa: E402
from tests.spmd_cases import reference, training_program  # noqa: E402


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


def test_local_shard_gives_one_program_per_coordinate_with_groups_in_the_manifest(tmp_path):
    program, inputs, expected = tp_mlp_program()
    portable.lower(program, "neuron", tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    spmd = manifest["spmd"]
    assert spmd["world_size"] == 4 and spmd["program_of_rank"] == ["tp_mlp.tp0", "tp_mlp.tp1"] * 2
    assert [r["core"] for r in spmd["ranks"]] == [0, 1, 2, 3]
    first = manifest["programs"][0]
    assert first["ranks"] == [0, 2] and first["specialised_to"] == {"tp": 0}
    by_axis = {c["axis"]: c["replica_groups"] for c in first["replica_groups"]}
    assert by_axis == {"tp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
    text = (tmp_path / "programs" / "tp_mlp.tp0" / "model" / "graph.hlo.txt").read_text()
    assert _groups(text, "all-reduce")[0] == "{{0,1},{2,3}}"
    assert "replica-id" not in text and "partition-id" not in text
    # run each variant's HLO on all 4 replicas; ranks take the outputs of their own variant
    layout = RankLayout.of(Mesh({"dp": 2, "tp": 2}))
    meta = program.metadata["spmd"]
    mesh = Mesh(meta["mesh"])
    names = [s.name for s in program.signature.inputs]
    locals_ = [
        [
            shard(v, Sharding.from_json(meta["inputs"][n]), mesh, r)
            for n, v in zip(names, inputs, strict=True)
        ]
        for r in range(4)
    ]
    per_rank: list = [None] * 4
    for prog in manifest["programs"]:
        proto = (tmp_path / prog["files"]["hlo"]).read_bytes()
        nxd_args = [
            locals_[next(p for p in range(4) if layout.nxd_of_portable(p) == r)] for r in range(4)
        ]
        outs = run_replicated(proto, nxd_args)
        for p in range(4):
            if layout.nxd_of_portable(p) in prog["ranks"]:
                per_rank[p] = outs[layout.nxd_of_portable(p)]
    for k in (0, 2, 3, 4):
        sharding = Sharding.from_json(meta["outputs"][str(k)])
        got = unshard([per_rank[p][k] for p in range(4)], sharding, mesh)
        torch.testing.assert_close(got, expected[k], rtol=1e-5, atol=1e-5)


def test_validator_checks_replica_groups(tmp_path):
    program, _, _ = tp_mlp_program()
    payload = portable.lower(program, "neuron").payload  # NeuronLowered
    record = payload.programs[0]
    layout = RankLayout.of(Mesh({"dp": 2, "tp": 2}))
    bad = record.hlo_text.replace(
        "replica_groups={{0,1},{2,3}}", "replica_groups={{0,1},{1,3,4}}", 1
    )
    findings = validate(parse_hlo_text(bad), payload.target, program=record.program, ranks=layout)
    codes = [f for f in findings if f.code.startswith("replica-groups")]
    text = "\n".join(f.render() for f in codes)
    assert "outside the world of 4" in text and "missing [2]" in text and "repeated [1]" in text
    assert "differ in size" in text
    assert all(f.node == "all_reduce" for f in codes) and "test_xla_spmd.py" in codes[0].source
    wrong_size = record.hlo_text.replace(
        "replica_groups={{0,1},{2,3}}", "replica_groups={{0,1,2,3}}", 1
    )
    findings = validate(
        parse_hlo_text(wrong_size), payload.target, program=record.program, ranks=layout
    )
    assert any("over mesh axis 'tp' (size 2) has groups of 4" in f.what for f in findings)


def test_gpt_dp_tp_per_rank_hlo_reproduces_the_single_device_step(tmp_path, example_spec):
    from portable.passes.spmd_partition import partition

    # GPT's fused qkv needs local_shard under head parallelism (one HLO per tp coordinate, see
    # below); with its MLPs column/row parallel every rank runs the same HLO
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
    portable.lower(per_rank, "neuron", tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["spmd"]["program_of_rank"] == ["GPT.train_step"] * 4  # no local_shard: one HLO
    (prog,) = manifest["programs"]
    text = (tmp_path / prog["files"]["hlo_text"]).read_text()
    groups = set(_groups(text, "all-reduce")) | set(_groups(text, "all-gather"))
    assert groups and groups <= {"{{0,1},{2,3}}", "{{0,2},{1,3}}"}
    assert {c["axis"] for c in prog["replica_groups"]} == {"dp", "tp"}
    # run THAT HLO on 4 replicas: every rank gets its shard of the global state and batch
    meta, mesh = per_rank.metadata["spmd"], Mesh(per_rank.metadata["spmd"]["mesh"])
    values = {s.name: v for s, v in zip(per_rank.signature.inputs, flat, strict=True)}
    used = [inp["name"] for inp in prog["io_spec"]["inputs"]]
    args = [
        [shard(values[n], Sharding.from_json(meta["inputs"][n]), mesh, r) for n in used]
        for r in range(4)  # dp x tp declared in NxD order: portable rank r is NxD rank r
    ]
    outs = run_replicated((tmp_path / prog["files"]["hlo"]).read_bytes(), args)
    want_losses, want_outputs = reference(program, flat, steps=1)
    sig = per_rank.signature
    for k, out in enumerate(sig.outputs):
        got = unshard(
            [outs[r][k] for r in range(4)], Sharding.from_json(meta["outputs"][out.name]), mesh
        )
        torch.testing.assert_close(got, want_outputs[out.name], rtol=1e-5, atol=1e-5, msg=out.name)
    assert coords_of(mesh, 3) == {"dp": 1, "tp": 1}
