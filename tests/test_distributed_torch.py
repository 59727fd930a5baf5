"""Per-rank programs on torch.distributed: real processes with gloo on the CPU.

- the collective runtime against a direct computation, every op, dims 0/1/-1, every reduce op,
  on a dp=2 x tp=2 mesh (4 processes: both axes, non-contiguous groups);
- a hand-built per-rank program (every collective kind) through `launch` vs one device;
- refusals: `portable run` checks the world size and the plan's axes before anything starts; the
  worker checks the world size torchrun gives before it reads data;
- acceptance: GPT and Llama training steps, partitioned by spmd-partition for DP=2, TP=2,
  DP x TP = 2 x 2 and FSDP=2, give the single-device loss and state after 5 steps (1e-5).
  CI runs GPT DP=2 (through `portable run`) and Llama TP=2; PORTABLE_SLOW=full runs the matrix.

Run as a script under torchrun, this file is the collectives check's per-rank body.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FULL = os.environ.get("PORTABLE_SLOW") == "full"
STEPS = 5  # tests/spmd_cases.STEPS (imported lazily: torchrun runs this file as a script)
PLAN_NAMES = ("dp", "tp", "dp_tp", "fsdp")
TOL = 1e-5
MESH = {"dp": 2, "tp": 2}


# --------------------------------------------------------------------------- collectives


def _value(rank: int) -> torch.Tensor:
    """Rank `rank`'s input: distinct per rank and element, exact in float32."""
    return torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8) + 1000.0 * rank


def _expected(op: str, args: tuple, group: list[int], me: int) -> torch.Tensor:
    """What collective `op` gives rank `me` of `group`, computed from every member's input."""
    xs = [_value(r) for r in group]
    i = group.index(me)
    stack = torch.stack(xs)
    reduce = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0), "min": stack.amin(0)}
    if op == "all_reduce":
        return reduce[args[0]]
    if op == "all_gather":
        return torch.cat(xs, dim=args[0])
    if op == "reduce_scatter":
        return reduce[args[0]].chunk(len(group), dim=args[1])[i]
    if op == "all_to_all":
        split, concat = args
        return torch.cat([x.chunk(len(group), dim=split)[i] for x in xs], dim=concat)
    if op == "local_shard":
        return xs[i].chunk(len(group), dim=args[0])[i]
    raise AssertionError(op)


CASES = (
    [("all_reduce", (r,)) for r in ("sum", "avg", "max", "min")]
    + [("all_gather", (d,)) for d in (0, 1, -1)]
    + [("reduce_scatter", (r, d)) for r in ("sum", "avg") for d in (0, 1, -1)]
    + [("all_to_all", (s, c)) for s, c in ((0, 1), (1, 0), (-1, 0), (1, -1), (0, 0))]
    + [("local_shard", (d,)) for d in (0, 1, -1)]
)


def _collectives_rank(out: Path) -> None:
    """Per-rank body: issue every case on both axes, all in flight before any wait, and record
    the largest difference from the direct computation."""
    import torch.distributed as dist

    from portable.distributed import TorchCollectives
    from portable.ir.plan import Mesh
    from portable.ir.sharding import group_of
    from portable.opset.collectives import collective_runtime

    dist.init_process_group("gloo")
    mesh = Mesh(MESH)
    rank = dist.get_rank()
    ops = torch.ops.portable
    x = _value(rank)
    results = {}
    with collective_runtime(TorchCollectives(mesh)):
        pending = []
        for axis in mesh.names:
            for op, args in CASES:
                value = getattr(ops, op)(x, *args, axis, mesh.axis_size(axis))
                pending.append((axis, op, args, value))
        for axis, op, args, value in pending:
            got = value if op == "local_shard" else ops.wait(value)
            want = _expected(op, args, group_of(mesh, axis, rank), rank)
            key = f"{op}{list(args)}@{axis}"
            same = got.shape == want.shape
            results[key] = float((got - want).abs().max()) if same else f"shape {list(got.shape)}"
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _torchrun(nproc: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    from portable.distributed.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_collectives_match_a_direct_computation(tmp_path):
    proc = _torchrun(4, __file__, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 2 * len(CASES)
        bad = {k: v for k, v in results.items() if v != 0.0}
        assert not bad, f"rank {rank}: {bad}"


# --------------------------------------------------------------------------- hand-built program


class _Ref(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, bias=False)
        self.fc2 = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * 2


class _PerRank(torch.nn.Module):
    """_Ref on tp=2 with every collective kind: fc1 column-parallel, its output gathered and
    re-split, fc2 row-parallel, the partial sum reduce-scattered over rows, swapped back with
    all_to_all, gathered, and averaged (identical copies: avg is the identity)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8, bias=False)
        self.fc2 = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        ops = torch.ops.portable
        h = torch.relu(self.fc1(x))  # [4, 8]: columns of this rank
        h = ops.wait(ops.all_gather(h, -1, "tp", 2))  # [4, 16]
        h = ops.local_shard(h, 1, "tp", 2)  # [4, 8] again
        y = self.fc2(h)  # [4, 8] partial sum
        y = ops.wait(ops.reduce_scatter(y, "sum", 0, "tp", 2))  # [2, 8] rows of this rank
        y = ops.wait(ops.all_to_all(y, 1, 0, "tp", 2))  # [4, 4]: columns of this rank
        y = ops.wait(ops.all_gather(y, 1, "tp", 2))  # [4, 8]
        return ops.wait(ops.all_reduce(y * 2, "avg", "tp", 2))


def _hand_built():
    import portable
    from portable.ir.plan import Mesh, Plan
    from portable.ir.sharding import Sharding
    from portable.ir.spmd import SpmdLayout

    torch.manual_seed(0)
    ref, x = _Ref(), torch.randn(4, 8)
    program = portable.capture(_PerRank(), (torch.randn(4, 8),))
    mesh = Mesh({"tp": 2})
    program.plan = Plan(mesh)
    layouts = {"p_fc1_weight": ((("tp",), ()), [16, 8]), "p_fc2_weight": (((), ("tp",)), [8, 16])}
    inputs = {name: Sharding(dims).to_json() for name, (dims, _) in layouts.items()}
    inputs["x"] = Sharding.replicated(2).to_json()
    shapes = {name: shape for name, (_, shape) in layouts.items()} | {"x": [4, 8]}
    (out,) = [o.name for o in program.signature.outputs]
    program.spmd = SpmdLayout.from_json(
        {
            "mesh": mesh.to_json(),
            "inputs": inputs,
            "outputs": {out: Sharding.replicated(2).to_json()},
            "global_shapes": {"inputs": shapes, "outputs": {out: [4, 8]}},
            "collectives": [],
        }
    )
    program.weights = {"fc1.weight": ref.fc1.weight.detach(), "fc2.weight": ref.fc2.weight.detach()}
    return program, ref, x, out


def test_hand_built_per_rank_program_matches_one_device(tmp_path):
    import safetensors.torch

    from portable.distributed.launch import launch, prepare

    program, ref, x, out = _hand_built()
    run_dir = prepare(program, {"x": x}, tmp_path / "run")
    results = launch(run_dir, 2, tmp_path / "out")
    assert results["world_size"] == 2 and results["kind"] == "inference"
    got = safetensors.torch.load_file(tmp_path / "out" / "outputs.safetensors")[out]
    with torch.no_grad():
        torch.testing.assert_close(got, ref(x), atol=TOL, rtol=TOL)


def test_worker_checks_the_world_size_before_reading_data(tmp_path):
    from portable.distributed.launch import launch, prepare
    from portable.errors import PlanError

    program, _, x, _ = _hand_built()
    run_dir = prepare(program, {"x": x}, tmp_path / "run")
    (run_dir / "inputs.safetensors").write_bytes(b"not read")  # would fail if it were read
    with pytest.raises(PlanError) as info:
        launch(run_dir, 3, tmp_path / "out")
    message = str(info.value)
    assert "torchrun (WORLD_SIZE) starts 3 processes but the plan's mesh (tp=2) has 2" in message
    assert "--nproc 2" in message
    assert not (tmp_path / "out").exists()


def test_torchrun_entry_point(tmp_path):
    """`torchrun -m portable.distributed.worker --program DIR --out OUT` is a supported entry."""
    import safetensors.torch

    from portable.distributed.launch import prepare

    program, ref, x, out = _hand_built()
    run_dir = prepare(program, {"x": x}, tmp_path / "run")
    args = ["-m", "portable.distributed.worker", "--program", str(run_dir)]
    proc = _torchrun(2, *args, "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["format"] == "portable-run-output" and results["backend"] == "gloo"
    got = safetensors.torch.load_file(tmp_path / "out" / "outputs.safetensors")[out]
    with torch.no_grad():
        torch.testing.assert_close(got, ref(x), atol=TOL, rtol=TOL)


# --------------------------------------------------------------------------- refusals


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if `portable run` gets as far as capturing or starting a process."""
    import portable.cli.run as cli_run
    import portable.distributed.launch as launch_mod

    def refuse(*args, **kwargs):
        raise AssertionError("must not be reached")

    monkeypatch.setattr(launch_mod, "launch", refuse)
    monkeypatch.setattr(cli_run, "_program", refuse)


def _run_cli(args: list[str], capsys) -> tuple[int, str]:
    from portable.cli.app import main

    code = main(["run", *args])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def _gpt_spec() -> str:
    return f"{Path(__file__).resolve().parents[1] / 'examples' / 'gpt.py'}:GPT"


def test_run_refuses_a_world_size_that_is_not_the_mesh(tmp_path, capsys, no_launch):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"mesh": {"dp": 2, "tp": 2}, "batch_axes": ["dp"]}))
    code, text = _run_cli([_gpt_spec(), "--nproc", "2", "--plan", str(plan)], capsys)
    assert code == 3
    assert "portable run --nproc starts 2 processes but the plan's mesh (dp=2 x tp=2) has 4" in text
    assert "--nproc 4" in text


def test_run_refuses_an_unknown_axis(tmp_path, capsys, no_launch):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"mesh": {"dp": 2}, "batch_axes": ["tp"]}))
    code, text = _run_cli([_gpt_spec(), "--nproc", "2", "--plan", str(plan)], capsys)
    assert code == 3
    assert "unknown mesh axis 'tp'" in text and "use one of the mesh's axes: dp" in text


def test_run_refuses_a_plan_attribute_that_is_not_a_plan(tmp_path, capsys, no_launch):
    module = tmp_path / "plans.py"
    module.write_text("NOT_A_PLAN = 3\n")
    code, text = _run_cli([_gpt_spec(), "--nproc", "2", "--plan", f"{module}:NOT_A_PLAN"], capsys)
    assert code == 3 and "is a int, not a Plan" in text


# --------------------------------------------------------------------------- acceptance


_REFERENCE: dict[str, tuple] = {}


def _reference(example_spec, stem: str):
    """The single-device training step, its flat inputs and its results after STEPS steps."""
    from tests.spmd_cases import reference, training_program

    if stem not in _REFERENCE:
        program, flat = training_program(example_spec(stem))
        _REFERENCE[stem] = (program, flat, reference(program, flat, STEPS))
    return _REFERENCE[stem]


def _as_outputs(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The runner's final state keyed like the program's outputs (`<weight>.updated`)."""
    return {f"{key}.updated": value for key, value in state.items()}


ACCEPTANCE = [(m, p) for m in ("gpt", "llama") for p in PLAN_NAMES] if FULL else [("llama", "tp")]


@pytest.mark.slow
@pytest.mark.parametrize(("stem", "plan"), ACCEPTANCE)
def test_partitioned_training_matches_one_device(tmp_path, example_spec, stem, plan):
    from portable.passes.spmd_partition import partition
    from tests.spmd_cases import assert_matches, plan_for, run_on_gloo

    program, flat, want = _reference(example_spec, stem)
    per_rank, _ = partition(program.replace(plan=plan_for(stem, plan)))
    losses, outputs = run_on_gloo(program, flat, per_rank, tmp_path)
    assert_matches(stem, want, losses, outputs)


@pytest.mark.slow
def test_portable_run_cli_trains_gpt_on_two_processes(tmp_path, capsys, example_spec):
    """`portable run SPEC --nproc 2 --plan dp.json --steps 5 --out DIR`, end to end."""
    import safetensors.torch

    from tests.spmd_cases import assert_matches, plan_for

    plan = tmp_path / "dp.json"
    plan.write_text(json.dumps(plan_for("gpt", "dp").to_json()))
    out = tmp_path / "out"
    args = [_gpt_spec(), *f"--nproc 2 --steps {STEPS} --plan {plan} --out {out}".split()]
    code, text = _run_cli(args, capsys)
    assert code == 0, text
    results = json.loads((out / "results.json").read_text())
    assert "step  loss" in text and f"{STEPS}     {results['losses'][-1]:.6f}" in text
    # builds and batches of a @portable spec are seeded: the CLI trained the reference's program
    _, _, want = _reference(example_spec, "gpt")
    state = safetensors.torch.load_file(out / "state.safetensors")
    losses = [torch.tensor(v) for v in results["losses"]]
    assert_matches("gpt", want, losses, _as_outputs(state))


if __name__ == "__main__":  # the per-rank body of test_collectives_match_a_direct_computation
    _collectives_rank(Path(sys.argv[1]))
