"""The `comm-overlap` pass on per-rank programs: golden text, buckets, wait placement, FSDP
prefetch under a memory cap, the cost model, and numerics (XLA multi-device and
torch.distributed runs before and after the pass are bit-identical).

Regenerate the golden files with `PORTABLE_UPDATE_GOLDEN=1 pytest tests/test_comm_overlap.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import portable
from portable.passes import get_pass
from portable.passes.comm_overlap import CommOverlap
from portable.passes.spmd_partition import partition
from portable.verify import verify
from tests.spmd_cases import plan_for, training_program
from tests.support import golden

GOLDEN = Path(__file__).parent / "golden"
ops = torch.ops.portable
COLLECTIVES = (ops.all_reduce.default, ops.all_gather.default, ops.reduce_scatter.default)


def per_rank(example_spec, stem: str, plan: str):
    program, flat = training_program(example_spec(stem))
    out, _ = partition(program.replace(plan=plan_for(stem, plan)))
    return out, flat


def check_golden(name: str, text: str) -> None:
    golden.check_golden(GOLDEN / name, text)


def apply(program, **options):
    result = CommOverlap(**options).apply(program)
    verify(result.program)
    old = {n.name for n in program.graph.nodes}
    for node in result.program.graph.nodes:
        if node.op == "call_function" and node.name not in old:  # the nodes the pass made
            assert "tensor" in node.meta and "source" in node.meta, node.name
    return result


def calls(program, target):
    return [n for n in program.graph.nodes if n.target is target]


def test_golden_mlp_dp(example_spec):
    before, _ = per_rank(example_spec, "mlp", "dp")
    result = apply(before)
    check_golden("comm_overlap_mlp_dp.before.txt", before.text())
    check_golden("comm_overlap_mlp_dp.after.txt", result.program.text())
    assert result.report.counts["buckets"] == 1 and result.report.counts["bucketed"] == 3
    assert any(
        n.startswith("bucket 0: all_reduce(sum) over dp, 3 tensors") for n in result.report.notes
    )


def test_no_collectives_is_a_no_op(example_spec):
    program, _ = training_program(example_spec("mlp"))
    result = get_pass("comm-overlap").apply(program)
    assert result.program is program and not result.report.changed


def test_small_buckets_and_waits_before_first_use(example_spec):
    program, _ = per_rank(example_spec, "gpt", "dp")
    one = apply(program)
    small = apply(program, bucket_mb=0.05)
    assert small.report.counts["buckets"] > one.report.counts["buckets"]
    for bucket in small.program.metadata["comm_overlap"]["buckets"]:
        assert bucket["bytes"] <= 0.05 * 2**20 or len(bucket["tensors"]) == 1
    nodes = list(small.program.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    for wait in calls(small.program, ops.wait.default):
        first = min(index[u] for u in wait.users)
        assert index[wait] == first - 1, wait.name  # right before its first use
        (coll,) = wait.args
        # issued right after its last input (through the bucket's packing ops)
        assert all(index[x] < index[coll] for x in coll.all_input_nodes)
    remaining = {n.name for n in small.program.graph.nodes}
    assert {c.node for c in small.program.spmd.collectives} <= remaining


def test_fsdp_prefetch_moves_gathers_earlier_within_the_cap(example_spec):
    program, _ = per_rank(example_spec, "gpt", "fsdp")
    params = {i.name for i in program.signature.inputs if i.kind.value == "parameter"}

    def gathers(p):
        """param gather -> (compute ops before its issue, bytes, compute ops before first use)."""
        out, seen, issued = {}, 0, {}
        for n in p.graph.nodes:
            if n.target is ops.all_gather.default and n.args[0].name in params:
                issued[n] = seen
            elif n.op == "call_function" and n.target is not ops.wait.default:
                for a in n.all_input_nodes:
                    if a.target is ops.wait.default and a.args[0] in issued:
                        c = a.args[0]
                        out.setdefault(c.args[0].name, (issued[c], a.meta["tensor"], seen))
                seen += 1
        return out

    before = gathers(program)
    cap_mb = 40_000 / 2**20  # about the embedding (32 KiB) and a few small gathers
    result = apply(program, memory_cap_mb=cap_mb)
    after = gathers(result.program)
    assert result.report.counts["prefetched"] > 0
    earlier = [k for k in after if after[k][0] < before[k][0]]
    assert len(earlier) >= 5
    # bytes gathered but not yet used never exceed the cap; a gather larger than the cap on
    # its own is issued right before its use (no compute in between)
    events = []
    cap = cap_mb * 2**20
    for issue, spec, use in after.values():
        nbytes = torch.Size(spec.shape).numel() * spec.dtype.itemsize
        if nbytes > cap:
            assert issue == use
        else:
            events.append((issue, use, nbytes))
    assert events
    for t in range(max(u for _, u, _ in events) + 1):
        assert sum(b for i, u, b in events if i <= t <= u) <= cap
    # a larger cap prefetches at least as much
    assert apply(program).report.counts["prefetched"] >= result.report.counts["prefetched"]


@pytest.mark.parametrize(("stem", "plan"), [("mlp", "dp"), ("gpt", "dp"), ("gpt", "fsdp")])
def test_exposed_communication_estimate_drops(example_spec, stem, plan):
    program, _ = per_rank(example_spec, stem, plan)
    counts = apply(program, bucket_mb=0.05).report.counts
    assert counts["exposed-ns-after"] < counts["exposed-ns-before"]


def test_reduce_scatter_buckets_keep_each_ranks_shard():
    """Bucketed reduce-scatters along dims 0 and 1 on a 1-rank group equal the originals, and
    the packed layout gives rank i chunk i of every member (checked by hand on 2 ranks)."""

    class Grads(torch.nn.Module):
        def forward(self, a, b):
            ra = ops.wait(ops.reduce_scatter(a * 2, "sum", 1, "dp", 1))
            rb = ops.wait(ops.reduce_scatter(b + 1, "sum", 0, "dp", 1))
            return ra.sum() + rb.sum(), ra, rb

    inputs = (torch.randn(4, 6), torch.randn(6, 3))
    program = portable.capture(Grads(), inputs)
    result = apply(program)
    assert result.report.counts["bucketed"] == 2
    want = portable.compile(program)(*inputs)
    got = portable.compile(result.program)(*inputs)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    # the packing for 2 ranks, by hand: chunk i of each member lands in row i
    a, b = torch.arange(24.0).reshape(4, 6), torch.arange(18.0).reshape(6, 3)
    packed = torch.cat([a.movedim(1, 0).reshape(2, -1), b.reshape(2, -1)], 1)
    row1 = packed[1]
    assert torch.equal(row1[:12].view(3, 4).permute(1, 0), a.chunk(2, 1)[1])
    assert torch.equal(row1[12:].view(3, 3), b.chunk(2, 0)[1])


def _xla_outputs(program, flat):
    pytest.importorskip("jax")
    from portable.backends.xla.spmd import run_spmd

    return run_spmd(program, flat, steps=2).outputs


def test_numerics_xla_multi_device_identical(example_spec):
    program, flat = per_rank(example_spec, "gpt", "fsdp")
    after = apply(program, bucket_mb=0.01, memory_cap_mb=0.02).program
    for w, g in zip(_xla_outputs(program, flat), _xla_outputs(after, flat), strict=True):
        assert torch.equal(w, g)


def test_numerics_torch_distributed_identical(example_spec, tmp_path):
    """2 gloo processes, 3 steps, before and after the pass: losses and state bit-identical."""
    import safetensors.torch

    from portable.distributed.launch import launch, prepare

    program, flat = per_rank(example_spec, "mlp", "dp")
    after = apply(program, bucket_mb=0.001).program
    sig = program.signature
    users = {
        i.name: v for i, v in zip(sig.inputs, flat, strict=True) if i.kind.value == "user_input"
    }
    state = {
        i.name: v for i, v in zip(sig.inputs, flat, strict=True) if i.kind.value != "user_input"
    }
    results = []
    for name, p in (("before", program), ("after", after)):
        run = prepare(p, users, tmp_path / name, state=state, steps=3)
        doc = launch(run, 2, tmp_path / f"{name}.out", backend="gloo", timeout_s=300)
        final = safetensors.torch.load_file(tmp_path / f"{name}.out" / "state.safetensors")
        results.append((doc["losses"], final))
    (la, sa), (lb, sb) = results
    assert la == lb
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
