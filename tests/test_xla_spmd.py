"""XLA multi-device execution of per-rank programs (backends/xla/spmd.py).

A hand-built per-rank program (a tensor- and data-parallel MLP whose forward calls every portable
collective) runs on 4 XLA CPU devices under shard_map and must give what its global computation
gives in torch; once the spmd-partition pass exists, the GPT and Llama examples trained for five
steps under DP, TP, DP x TP and FSDP plans must match the single-device cpu run (loss of every
step and every parameter, within 1e-5).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import portable
from portable.ir.plan import Mesh, Plan
from portable.ir.sharding import Sharding, shard

pytest.importorskip("jax")

from portable.backends.xla.spmd import run_spmd  # noqa: E402
from portable.ir.spmd import SpmdLayout, TensorLayout  # noqa: E402
from portable.passes.spmd_partition import partition  # noqa: E402
from tests.spmd_cases import (  # noqa: E402
    PLAN_NAMES,
    STEPS,
    assert_matches,
    plan_for,
    reference,
    training_program,
)

ops = torch.ops.portable
MESH = {"dp": 2, "tp": 2}
B, D, H = 6, 6, 16  # global batch, model width, hidden width


class _TpMlpRank(torch.nn.Module):
    """One rank of y = relu(x @ W1^T) @ W2^T with W1 split by rows (column-parallel) and W2 by
    columns (row-parallel) over tp, x split by batch over dp; extra outputs exercise the other
    collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.zeros(H // 2, D))
        self.w2 = torch.nn.Parameter(torch.zeros(D, H // 2))

    def forward(self, x):
        partial = torch.relu(x @ self.w1.t()) @ self.w2.t()  # partial sum over tp
        y = ops.wait(ops.all_reduce(partial, "sum", "tp", 2))  # [B/dp, D]
        gathered = ops.wait(ops.all_gather(y, 0, "dp", 2))  # [B, D], replicated
        scattered = ops.wait(ops.reduce_scatter(partial, "sum", 1, "tp", 2))  # [B/dp, D/tp]
        sliced = ops.wait(ops.local_shard(y, 1, "tp", 2))  # [B/dp, D/tp]
        swapped = ops.wait(ops.all_to_all(y, 1, 0, "dp", 2))  # [B, D/dp]
        biggest = ops.wait(ops.all_reduce(partial, "max", "tp", 2))
        mean = ops.wait(ops.all_reduce(y, "avg", "dp", 2))  # [B/dp, D], replicated over dp
        return y, gathered, scattered, sliced, swapped, biggest, mean


def _spec(*dims) -> Sharding:
    return Sharding(tuple(tuple(d) for d in dims))


def _layouts(specs, shardings: dict, mesh: Mesh) -> tuple[TensorLayout, ...]:
    """Each signature value's layout: its sharding, and the global shape it gives the local one."""
    return tuple(
        TensorLayout(s.name, shardings[s.name], shardings[s.name].global_shape(s.spec.shape, mesh))
        for s in specs
    )


def tp_mlp_program() -> tuple[portable.Program, list[torch.Tensor], list[torch.Tensor]]:
    """(per-rank program, global inputs in signature order, expected global outputs)."""
    torch.manual_seed(0)
    w1, w2, x = torch.randn(H, D), torch.randn(D, H), torch.randn(B, D)
    program = portable.capture(_TpMlpRank(), (torch.zeros(B // 2, D),), name="tp_mlp")
    mesh = Mesh(MESH)
    inputs = {"p_w1": _spec(["tp"], []), "p_w2": _spec([], ["tp"]), "x": _spec(["dp"], [])}
    outputs = {
        "0": _spec(["dp"], []),
        "1": _spec([], []),
        "2": _spec(["dp"], ["tp"]),
        "3": _spec(["dp"], ["tp"]),
        "4": _spec([], ["dp"]),
        "5": _spec(["dp"], []),  # max of partial sums: not a global quantity, checked per rank
        "6": _spec([], []),
    }
    program.plan = Plan(mesh)
    program.weights = {"w1": w1, "w2": w2}
    sig = program.signature
    program.spmd = SpmdLayout(
        mesh, _layouts(sig.inputs, inputs, mesh), _layouts(sig.outputs, outputs, mesh)
    )
    assert [t.global_shape for t in program.spmd.inputs] == [(H, D), (D, H), (B, D)]
    y = torch.relu(x @ w1.t()) @ w2.t()
    halves = [
        torch.relu(x @ w1[k * 8 : k * 8 + 8].t()) @ w2[:, k * 8 : k * 8 + 8].t() for k in (0, 1)
    ]
    expected = [y, y, y, y, y, torch.maximum(*halves), y.reshape(2, 3, D).mean(0)]
    return program, [w1, w2, x], expected


def test_per_rank_program_runs_on_four_devices_with_every_collective():
    program, inputs, expected = tp_mlp_program()
    assert program.is_per_rank
    outputs = run_spmd(program, inputs).outputs
    assert [tuple(o.shape) for o in outputs][:5] == [(B, D)] * 5
    for k in range(5):
        torch.testing.assert_close(outputs[k], expected[k], rtol=1e-5, atol=1e-5)
    # max over tp of the partial sums, per dp shard: the expected max is global, rows agree
    torch.testing.assert_close(outputs[5], expected[5], rtol=1e-5, atol=1e-5)
    # avg over dp of the two batch halves, replicated
    torch.testing.assert_close(outputs[6], expected[6], rtol=1e-5, atol=1e-5)


def test_compile_takes_and_returns_global_values():
    program, inputs, expected = tp_mlp_program()
    exe = portable.compile(program, backend="xla")
    out = exe(inputs[2])
    torch.testing.assert_close(out[0], expected[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(portable.InputError, match=r"float32\[6x6\]"):
        exe(torch.zeros(B // 2, D))  # a local shape is refused: the executable is global


def test_local_values_are_shards_of_the_global_ones():
    # the device of rank r holds shard(global, sharding, mesh, r): check through local_shard's
    # output (3), which is this rank's tp chunk of y
    program, inputs, expected = tp_mlp_program()
    out = run_spmd(program, inputs).outputs[3]
    mesh = Mesh(MESH)
    sharding = program.spmd.output("3").sharding
    for rank in range(mesh.size):
        torch.testing.assert_close(
            shard(out, sharding, mesh, rank), shard(expected[3], sharding, mesh, rank)
        )


def test_not_enough_devices_and_bad_metadata_are_explained():
    program, inputs, _ = tp_mlp_program()
    x = program.spmd.input("x")
    partial = dataclasses.replace(x, sharding=Sharding((("dp",), ()), (("tp", "sum"),)))
    program.spmd = dataclasses.replace(program.spmd, inputs=(*program.spmd.inputs[:2], partial))
    with pytest.raises(portable.PlanError, match="partial") as info:
        run_spmd(program, inputs)
    assert "fix:" in str(info.value)


# --------------------------------------------------------------------------- examples, real pass

_SINGLE_DEVICE: dict = {}


def _single_device(example_spec, stem: str):
    """(training step, its global flat inputs, its single-device cpu run), once per example:
    the capture is seeded, so every plan partitions the same program (copied by `replace`)."""
    if stem not in _SINGLE_DEVICE:
        program, flat = training_program(example_spec(stem))
        _SINGLE_DEVICE[stem] = program, flat, reference(program, flat)
    return _SINGLE_DEVICE[stem]


@pytest.mark.parametrize("plan", PLAN_NAMES)
@pytest.mark.parametrize("stem", ["gpt", "llama"])
def test_example_training_matches_single_device(stem, plan, example_spec):
    """The examples' own training step (AdamW), partitioned by the plans of tests/spmd_cases.py
    (head-parallel attention for Llama), five steps on 2 or 4 XLA host devices."""
    program, flat, want = _single_device(example_spec, stem)
    per_rank, _ = partition(program.replace(plan=plan_for(stem, plan)))
    assert per_rank.is_per_rank
    result = run_spmd(per_rank, flat, steps=STEPS)
    outputs = {o.name: v for o, v in zip(per_rank.signature.outputs, result.outputs, strict=True)}
    assert_matches(stem, want, result.losses, outputs)


@pytest.mark.parametrize(("stem", "plan"), [("llama", "dp_tp_vocab"), ("llama", "dp_tp_sp")])
def test_vocab_and_sequence_parallel_match_single_device(stem, plan, example_spec):
    program, flat, want = _single_device(example_spec, stem)
    per_rank, report = partition(program.replace(plan=plan_for(stem, plan)))
    result = run_spmd(per_rank, flat, steps=STEPS)
    outputs = {o.name: v for o, v in zip(per_rank.signature.outputs, result.outputs, strict=True)}
    assert_matches(stem, want, result.losses, outputs)
