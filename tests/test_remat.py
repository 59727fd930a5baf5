"""The `remat` pass: every policy keeps the step's numbers bit for bit (cpu, xla, an eager loop
under torch.utils.checkpoint), lowers saved activations as each policy says, leaves valid IR
that archives, partitions and lowers (neuron's estimate, cuda's graphs) with the copies in place;
and the memory model it reports with (portable.ir.liveness) equals storages measured while the
cpu backend's graph runs."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import portable
from portable.errors import PassError
from portable.ir.liveness import liveness
from portable.optim import Optimizer, to_torch
from portable.passes import PassManager, get_pass, parse_pass
from portable.passes.remat import OUTSIDE, step_parts
from portable.testing.memory import measure_memory
from tests.spmd_cases import plan_for, training_program
from tests.support import load_spec

FULL = os.environ.get("PORTABLE_SLOW") == "full"
POLICIES = ("none", "selective", "save-matmuls", "full")
STEPS = 3
# the MLP has no repeated module list: its two Linear layers are named as the layers. Their
# backward reads only their weights' transposes (views of parameters, kept) and the batch, and
# the GELU between them is outside both: nothing of the MLP is recomputed.
LAYERS = {"mlp": r"fc\d", "gpt": None, "llama": None}


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Tiny(torch.nn.Module):
    """tests/golden/passes/remat/*.in.txt were printed from `captured("tiny")`."""

    def __init__(self, width: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _tiny(width: int, depth: int, batch: int):
    torch.manual_seed(0)
    data = [torch.randn(batch, width), torch.randn(batch, width)]
    program = portable.capture(
        Tiny(width, depth),
        tuple(data),
        loss_fn=lambda m, x, y: F.mse_loss(m(x), y),
        optimizer=portable.optim.SGD(lr=0.1),
    )
    return program, [*(program.weights[i.target] for i in program.signature.state_inputs), *data]


@functools.cache
def captured(stem: str):
    """(program, flat inputs, batch) of a training step, captured once per process: an
    example's, `tiny` (2 x 4 wide, the goldens' model) or `wide-batch` (activations dominate)."""
    if stem == "tiny":
        program, flat = _tiny(4, 2, 2)
    elif stem == "wide-batch":
        program, flat = _tiny(8, 4, 1024)
    else:
        program, flat = training_program(load_spec(stem))
    return program, flat, flat[len(program.signature.state_inputs) :]


def remat(program, policy, layers=None):
    """`program` after remat, and the report."""
    result = get_pass("remat", policy=policy, layers=layers).apply(program)
    return result.program, result.report


def steps(program, batch, backend="cpu", n=STEPS):
    """Losses of `n` steps and the final state."""
    exe = portable.compile(program, backend)
    results = [exe(*batch) for _ in range(n)]
    return [r.loss for r in results], results[-1].state


def assert_same_bits(a, b):
    (la, sa), (lb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("stem", list(LAYERS))
def test_every_policy_is_bit_identical_to_none_on_cpu(stem):
    program, _, batch = captured(stem)
    want = steps(program, batch)
    for policy in POLICIES[1:]:
        out, report = remat(program, policy, LAYERS[stem])
        assert report.changed == (stem != "mlp") == (report.counts["recomputed"] > 0), policy
        assert report.counts["layers"] == 2
        assert_same_bits(steps(out, batch), want)


def test_the_pass_leaves_valid_ir_and_its_input_untouched():
    """PassManager(verify_each=True) verifies the result and checks the input is unchanged."""
    program = captured("llama")[0]
    out, (report,) = PassManager([get_pass("remat", policy="full")], verify_each=True).run(program)
    portable.verify(out)
    assert report.changed and out.metadata["passes"][-1] == "remat"


def test_policy_none_and_no_layers_change_nothing():
    program = captured("gpt")[0]
    result = get_pass("remat", policy="none").apply(program)
    out, report = result.program, result.report
    assert out is program and not report.changed and report.counts["saved_bytes_before"] > 0
    mlp = captured("mlp")[0]
    result = get_pass("remat").apply(mlp)  # default layers: no integer module index
    out, report = result.program, result.report
    assert out is mlp and not report.changed
    assert report.notes == [r"no layer: no module path matches (.*\.)?\d+"]


def test_saved_activations_fall_none_selective_full():
    """GPT: none > selective >= full; Llama: selective saves attention's result, save-matmuls
    recomputes it; full saves only each layer's input (its predecessor's output)."""
    saved = {}
    for stem in ("gpt", "llama"):
        program = captured(stem)[0]
        for policy in POLICIES:
            _, report = remat(program, policy)
            saved[stem, policy] = report.counts.get(
                "saved_bytes_after", report.counts["saved_bytes_before"]
            )
    assert saved["gpt", "none"] > saved["gpt", "selective"] >= saved["gpt", "full"]
    assert saved["llama", "none"] > saved["llama", "selective"] > saved["llama", "save-matmuls"]
    assert saved["llama", "save-matmuls"] > saved["llama", "full"]


def test_full_keeps_only_layer_inputs_and_reports_per_layer():
    program = captured("gpt")[0]
    _, report = remat(program, "full")
    before = {k: b for k, (b, _) in report.record["saved_bytes"].items()}
    after = {k: a for k, (_, a) in report.record["saved_bytes"].items()}
    assert list(before) == ["blocks.0", "blocks.1", OUTSIDE]
    # each block's output is the next block's (or ln_f's) input: batch 2 x 16 tokens x 64 floats;
    # blocks.0 also made the -inf scalar both blocks' masking reads (capture shares it)
    assert after["blocks.1"] == 2 * 16 * 64 * 4
    assert after["blocks.0"] == 2 * 16 * 64 * 4 + 4
    assert after[OUTSIDE] == before[OUTSIDE]  # embeddings, ln_f, lm_head, loss: not layers
    assert sum(before.values()) == report.counts["saved_bytes_before"]
    assert sum(after.values()) == report.counts["saved_bytes_after"]
    assert report.notes[0].startswith("blocks.0: saved 136.2 KiB -> 8.0 KiB")
    (table,) = report.tables
    assert table.header == ("layer", "saved before", "saved after") and len(table.rows) == 3


def test_copies_sit_before_their_first_reader_in_the_backward():
    program = captured("gpt")[0]
    out, report = remat(program, "full")
    nodes = list(out.graph.nodes)
    position = {n: k for k, n in enumerate(nodes)}
    original = {n.name for n in program.graph.nodes}
    copies = {n for n in nodes if n.name not in original}
    assert len(copies) == report.counts["recomputed"]
    for node in copies:
        assert node.meta["phase"] == "backward" and node.meta["micro_batch"] == 0
        first = min(position[u] for u in node.users)
        # nothing runs between a copy and its first reader but other copies
        assert all(b in copies for b in nodes[position[node] + 1 : first]), node.name
    forward = [(n.name, n.target) for n in nodes if n.meta.get("phase") == "forward"]
    assert forward == [
        (n.name, n.target) for n in program.graph.nodes if n.meta.get("phase") == "forward"
    ]


def test_eager_torch_utils_checkpoint_gives_the_same_losses():
    """An eager loop with every block under torch.utils.checkpoint (use_reentrant=False) and
    torch.optim.AdamW: the same losses as the remat'ed program, and as the loop without it."""
    spec = load_spec("gpt")
    torch.manual_seed(0)
    model = spec.build()  # training_program's seed: the weights `captured` holds
    program, _, batch = captured("gpt")

    def eager(wrap: bool):
        m = copy.deepcopy(model)
        if wrap:
            for block in m.blocks:
                block.forward = lambda *a, f=block.forward: checkpoint(f, *a, use_reentrant=False)
        opt = Optimizer.from_dict(program.metadata["optimizer"])
        torch_opt = to_torch(opt, [p for p in m.parameters() if p.requires_grad])
        losses = []
        for _ in range(STEPS):
            torch_opt.zero_grad()
            loss = F.cross_entropy(m(batch[0]).flatten(0, 1), batch[1].flatten())
            loss.backward()
            torch_opt.step()
            losses.append(loss.detach())
        return losses

    checkpointed = eager(True)
    assert all(torch.equal(a, b) for a, b in zip(checkpointed, eager(False), strict=True))
    got, _ = steps(remat(program, "full")[0], batch)
    for g, w in zip(got, checkpointed, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


SMALL_AND_FULL = ["tiny", "gpt"] if FULL else ["tiny"]


@pytest.mark.slow
@pytest.mark.parametrize("stem", SMALL_AND_FULL)
def test_xla_runs_the_remated_step_bit_identically(stem):
    pytest.importorskip("jax")
    program, _, batch = captured(stem)
    assert_same_bits(steps(remat(program, "full")[0], batch, "xla"), steps(program, batch, "xla"))


@pytest.mark.slow
@pytest.mark.parametrize("stem", SMALL_AND_FULL)
def test_composes_with_spmd_partition_dp2(stem):
    """Plan dp=2 on the program, remat, then spmd-partition: the per-rank program keeps the
    copies and runs (2 XLA host devices, one process) bit-identically to the partition of the
    program without remat."""
    pytest.importorskip("jax")
    from portable.backends.xla.spmd import run_spmd

    program, flat, _ = captured(stem)
    planned = program.replace(plan=plan_for(stem, "dp"))
    out, report = remat(planned, "full")
    partition = get_pass("spmd-partition")
    per_rank = partition.apply(out).program
    baseline = partition.apply(planned).program
    portable.verify(per_rank)
    assert per_rank.is_per_rank and per_rank.spmd.mesh.size == 2

    def ops(program):
        return sum(n.op == "call_function" for n in program.graph.nodes)

    assert ops(per_rank) - ops(baseline) == report.counts["recomputed"]
    got, want = run_spmd(per_rank, flat, steps=2), run_spmd(baseline, flat, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(got.losses, want.losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got.outputs, want.outputs, strict=True))


def test_archive_round_trip_keeps_copies_and_phases(tmp_path):
    program, _, batch = captured("llama")
    out, _ = remat(program, "selective")
    loaded = portable.load(out.save(tmp_path / "llama.portable"))
    assert loaded.text() == out.text() and loaded.content_hash == out.content_hash
    phases = [(n.name, n.meta.get("phase")) for n in out.graph.nodes]
    assert [(n.name, n.meta.get("phase")) for n in loaded.graph.nodes] == phases
    assert_same_bits(steps(loaded, batch), steps(out, batch))


def test_static_liveness_equals_measured_storages():
    """portable.ir.liveness's bytes live before and while each node runs equal the storages
    alive when the cpu backend's graph runs (weakref finalizers), node by node."""
    program, flat, _ = captured("gpt")
    for p in (program, remat(program, "full")[0]):
        static = liveness(p.graph)
        measured = measure_memory(p, flat)
        assert [static.live_before(k) for k in range(len(static.nodes))] == list(
            measured.live_before
        )
        assert [static.live_during(k) for k in range(len(static.nodes))] == list(
            measured.live_during
        )
        assert static.peak_bytes == measured.peak_bytes > 0


def test_peak_memory_falls_with_full():
    """4 layers x 8 wide on a batch of 1024: activations dominate the step's memory."""
    program = captured("wide-batch")[0]
    full = remat(program, "full")[0]
    assert liveness(full.graph).peak_bytes < 0.7 * liveness(program.graph).peak_bytes


def test_neuron_memory_estimate_is_lower_with_full():
    pytest.importorskip("jax")
    from portable.backends import get_backend
    from portable.backends.base import Target

    program = captured("wide-batch")[0]
    backend = get_backend("neuron")
    none, full = (
        backend.lower(p, Target.parse("neuron")).payload.programs[0].memory
        for p in (program, remat(program, "full")[0])
    )
    assert full.activations_bytes < 0.8 * none.activations_bytes
    # the copies are in the HLO: it holds more intermediates in all
    assert full.intermediates_bytes > none.intermediates_bytes


def test_cuda_graphs_keep_the_copies_in_program_order():
    """cuda lowers node for node in place: the export graph and each arch's kernel graph hold
    every op of the remat'ed program, copies included, in its order (nothing reschedules or
    merges them before torch.compile, whose inference path does not CSE the FX graph)."""
    pytest.importorskip("triton")
    from portable.backends import get_backend
    from portable.backends.base import Target

    out, _ = remat(captured("gpt")[0], "full")
    payload = get_backend("cuda").lower(out, Target.parse("cuda:sm_90")).payload

    def ops(graph):
        return [
            (n.meta.get("phase"), n.meta.get("tensor"))
            for n in graph.nodes
            if n.op == "call_function"
        ]

    want = ops(out.graph)
    assert ops(payload.export_gm.graph) == want
    assert ops(payload.kernel_gms["sm_90"].graph) == want


def test_a_random_op_is_refused_with_its_module():
    program = captured("tiny")[0].replace()  # a copy: the test edits it
    tanh = next(n for n in program.graph.nodes if n.target is torch.ops.aten.tanh.default)
    tanh.target = torch.ops.aten.bernoulli.default  # a seeded random op in layers.0
    with pytest.raises(PassError) as err:
        get_pass("remat", policy="full").apply(program)
    text = str(err.value)
    assert "draws random numbers" in text and "aten.bernoulli.default" in text
    assert "module `layers.0`" in text and "counter-based" in text


def test_values_are_recomputed_for_their_own_micro_batch_only():
    """With gradient accumulation each micro-batch has its forward and backward: a backward op
    of micro-batch 0 never recomputes a forward value tagged with another micro-batch."""
    program = captured("tiny")[0].replace()
    _, alone = remat(program, "full")
    for node in program.graph.nodes:
        if node.meta.get("phase") == "forward" and node.meta["source"].module.startswith(
            "layers.0"
        ):
            node.meta["micro_batch"] = 1  # as if layers.0's forward belonged to micro-batch 1
    out, report = remat(program, "full")
    assert 0 < report.counts["recomputed"] < alone.counts["recomputed"]
    names = {n.name for n in program.graph.nodes}
    copied = {n.meta["source"].module for n in out.graph.nodes if n.name not in names}
    assert copied and all(m.startswith("layers.1") for m in copied)


def test_options_and_program_kinds():
    assert parse_pass("remat").spec() == "remat"
    assert parse_pass("remat{policy=save-matmuls}").options() == {
        "policy": "save-matmuls",
        "layers": None,
    }
    by_regex = get_pass("remat", layers=r"layers\.\d+")
    assert parse_pass(by_regex.spec()) == by_regex
    assert parse_pass(r"remat{layers=layers\.\d+}") == by_regex  # a bare value keeps its \
    with pytest.raises(PassError, match="no policy 'some'"):
        get_pass("remat", policy="some")
    with pytest.raises(PassError, match="not a regular expression"):
        get_pass("remat", layers="(")
    spec = load_spec("mlp")
    inference = portable.capture_spec(spec)
    result = get_pass("remat").apply(inference)
    assert result.program is inference and not result.report.changed


def test_layers_option_picks_the_layers():
    program = captured("tiny")[0]
    _, default = remat(program, "full")
    _, whole = remat(program, "full", layers="layers")  # the module list as one layer
    assert default.counts["layers"] == 2 and whole.counts["layers"] == 1
    # by default layers.0 keeps its output (layers.1's input) and no longer its tanh; as one
    # layer the list keeps only its output (the loss's backward reads it): 2 x 4 floats each
    assert default.record["saved_bytes"]["layers.0"] == [2 * 32, 32]
    assert whole.record["saved_bytes"]["layers"] == [4 * 32, 32]
    parts = step_parts(program, "layers")
    assert {parts.layer[n] for n in parts.layer if parts.is_forward(n)} == {"layers", None}


@pytest.mark.slow
def test_benchmark_runs_in_its_smallest_form(tmp_path):
    """benchmarks/remat_memory.py on a 1-layer GPT of 16 tokens: every policy bit-identical
    to none, measured storages equal to the static walk, its block written."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "remat_memory.py"
    spec = importlib.util.spec_from_file_location("_bench_remat_memory", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    doc, out = tmp_path / "perf.md", tmp_path / "remat.json"
    args = "--layers 1 --width 32 --heads 2 --seq 16 --repeat 1".split()
    assert bench.main([*args, "--json", str(out), "--write", str(doc)]) == 0
    for rows in json.loads(out.read_text())["variants"].values():
        assert all(r["identical"] for r in rows.values())
        assert all(r["activations"] == r["activations_static"] for r in rows.values())
        assert rows["full"]["activations"] < rows["none"]["activations"]
    assert bench.MARK in doc.read_text() and "| written out | full |" in doc.read_text()
