"""Abstract capture (issue 19, item 1): a model built on the `meta` device captures into a program
with every value's shape and dtype and no weight values; passes that need no values run on it,
and what needs values refuses with AbstractProgramError.

The reference for every abstract program is the same model captured with real weights: the two
programs must agree node by node (names, targets, `meta["tensor"]`), before and after
spmd-partition, so a plan's per-rank shapes read off an abstract 70B program are the ones the
materialized model would get.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import portable
from portable import Plan
from portable.capture import layers
from portable.errors import AbstractProgramError
from portable.ir.program import Program
from portable.passes import get_pass
from portable.passes.mx_quantize import mx_error_report
from portable.passes.spmd_partition import partition
from portable.testing import check_parity
from tests.spmd_cases import hf_plan_for, plan_for

Precision = portable.Precision


def lm_loss(model, idx, targets):
    out = model(idx)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batch(shape=(4, 16), vocab=128):
    torch.manual_seed(0)
    return tuple(torch.randint(0, vocab, shape) for _ in range(2))


def _specs(program: Program) -> list[tuple[str, str, object]]:
    """(name, target, meta["tensor"]) of every node: what two captures must agree on."""
    return [(n.name, str(n.target), n.meta.get("tensor")) for n in program.graph.nodes]


def _assert_same_program(abstract: Program, real: Program) -> None:
    assert abstract.abstract and not real.abstract
    assert _specs(abstract) == _specs(real)
    assert abstract.signature == real.signature
    for key, weight in real.weights.items():
        assert abstract.weights[key].shape == weight.shape, key
        assert abstract.weights[key].dtype == weight.dtype, key


def _meta_and_real(build):
    with torch.device("meta"):
        meta = build()
    torch.manual_seed(0)
    return meta, build()


def _train(model, batch, **recipe):
    recipe.setdefault("optimizer", portable.optim.AdamW(lr=1e-3))
    return portable.capture(model, batch, loss_fn=lm_loss, **recipe)


RECIPE = {"precision": Precision(compute="bfloat16"), "remat": "selective"}
_CAPTURED: dict[tuple[str, str], dict[str, Program]] = {}


def _captured(hf_model, family: str, kind: str) -> dict[str, Program]:
    """{"abstract": ..., "real": ...}: the `kind` ("inference", "step") program of a small model
    built on meta and on the CPU, captured once per test session."""
    if (family, kind) not in _CAPTURED:
        if family == "examples.llama":
            from examples.llama import Llama

            models = _meta_and_real(Llama)
        else:
            models = _meta_and_real(lambda: hf_model(family))
        batch = _batch()
        _CAPTURED[family, kind] = {
            name: portable.capture(model, batch[:1])
            if kind == "inference"
            else _train(model, batch, **RECIPE)
            for name, model in zip(("abstract", "real"), models, strict=True)
        }
    return _CAPTURED[family, kind]


def _per_rank(hf_model, family: str, plan: Plan) -> dict[str, Program]:
    programs = _captured(hf_model, family, "step")
    return {name: partition(p.replace(plan=plan))[0] for name, p in programs.items()}


# --------------------------------------------------------------------------- capture


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_a_meta_model_captures_inference_as_the_real_model_does(hf_model, family):
    programs = _captured(hf_model, family, "inference")
    _assert_same_program(programs["abstract"], programs["real"])


def test_a_meta_llama_captures_a_training_step_as_the_real_model_does(hf_model):
    programs = _captured(hf_model, "llama", "step")
    _assert_same_program(programs["abstract"], programs["real"])
    assert programs["abstract"].kind.value == "training_step"
    assert programs["abstract"].metadata["recipe"] == programs["real"].metadata["recipe"]


def test_capture_leaves_the_meta_model_as_it_was(hf_model):
    with torch.device("meta"):
        model = hf_model("llama")
    before = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    portable.capture(model, _batch()[:1])
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert after.keys() == before.keys() and all(after[n] is t for n, t in before.items())
    assert all(t.is_meta for t in after.values())


def test_meta_example_inputs_capture_too(hf_model):
    with torch.device("meta"):
        model = hf_model("llama")
    idx = torch.empty(4, 16, dtype=torch.int64, device="meta")
    program = portable.capture(model, (idx,))
    assert program.abstract
    assert program.signature.user_inputs[0].spec.shape == (4, 16)


# --------------------------------------------------------------------------- passes


@pytest.mark.parametrize("plan", ["dp_tp", "fsdp", "dp_tp_sp"])
def test_partitioned_abstract_llama_has_the_real_per_rank_shapes(hf_model, plan):
    per_rank = _per_rank(hf_model, "llama", hf_plan_for("llama", plan))
    _assert_same_program(per_rank["abstract"], per_rank["real"])
    assert per_rank["abstract"].spmd == per_rank["real"].spmd
    portable.verify(per_rank["abstract"])


def test_partitioned_abstract_example_llama_has_the_real_per_rank_shapes(hf_model):
    per_rank = _per_rank(hf_model, "examples.llama", plan_for("llama", "dp_tp"))
    _assert_same_program(per_rank["abstract"], per_rank["real"])


def test_remat_comm_overlap_and_the_neuron_lowering_run_on_an_abstract_program(hf_model):
    step = _captured(hf_model, "llama", "step")["abstract"]
    full = get_pass("remat", policy="full").apply(step)
    assert full.program.abstract and full.report.counts["recomputed"] > 0
    per_rank = _per_rank(hf_model, "llama", hf_plan_for("llama", "dp_tp"))["abstract"]
    overlapped = get_pass("comm-overlap", bucket_mb=1.0).apply(per_rank).program
    assert overlapped.abstract
    written = portable.lower(overlapped, "neuron:trn3")
    assert written.lowered.program is overlapped and written.lowered.texts


# --------------------------------------------------------------------------- what needs values


def test_what_needs_weight_values_refuses_an_abstract_program_with_the_fix(hf_model, tmp_path):
    program = _captured(hf_model, "llama", "inference")["abstract"]
    with pytest.raises(AbstractProgramError) as info:
        portable.compile(program, backend="cpu")
    message = str(info.value)
    assert "running on cpu needs weight values" in message and "is abstract" in message
    assert "model.embed_tokens.weight" in message
    assert "to_empty(device='cpu')" in message and "load_state_dict" in message
    for target, what in (("onnx", "lowering to onnx"), ("cuda:sm_90", "writing cuda's")):
        with pytest.raises(AbstractProgramError, match=what):
            portable.lower(program, target, tmp_path / target.replace(":", "_"))
    with pytest.raises(AbstractProgramError, match=r"saving needs weight values"):
        program.save(tmp_path / "llama.portable")
    assert not (tmp_path / "llama.portable").exists()
    assert len(program.content_hash) == 64  # hashed from shapes and dtypes
    quantized = get_pass("mx-quantize").apply(program).program
    assert quantized.abstract and quantized.metadata["mx_quantize"]["layers"]
    with pytest.raises(AbstractProgramError, match="mx-quantize's error report"):
        mx_error_report(quantized, _batch()[:1])
    with torch.device("meta"):
        model = hf_model("llama")
    with pytest.raises(AbstractProgramError, match="running on cpu"):
        check_parity(model, _batch()[:1], backends=["cpu"])


def test_a_materialized_model_captures_with_values_again(hf_model):
    """The documented fix: to_empty + load_state_dict gives a program that runs."""
    with torch.device("meta"):
        model = hf_model("llama")
    torch.manual_seed(0)
    state = hf_model("llama").state_dict()
    model.to_empty(device="cpu")
    model.load_state_dict(state)
    model.model.rotary_emb.__init__(model.config)  # non-persistent buffers are computed, not loaded
    program = portable.capture(model, _batch()[:1])
    assert not program.abstract
    assert portable.compile(program)(_batch()[0]).shape == (4, 16, 128)


# --------------------------------------------------------------------------- repeated layers


def _form(program: Program) -> list[tuple]:
    """Every node as (op, target, spec, source module, phase, arguments by position): two
    programs with equal forms are the same graph up to node names."""
    nodes = list(program.graph.nodes)
    position = {n: k for k, n in enumerate(nodes)}

    def arg(value):
        if isinstance(value, torch.fx.Node):
            return ("node", position[value])
        if isinstance(value, (list, tuple)):
            return tuple(arg(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, arg(v)) for k, v in value.items())
        return value

    return [
        (
            n.op,
            None if n.op == "placeholder" else str(n.target),
            n.meta.get("tensor"),
            getattr(n.meta.get("source"), "module", None),
            n.meta.get("phase"),
            arg(n.args),
            arg(n.kwargs),
        )
        for n in nodes
    ]


def _traced_whole(monkeypatch, capture):
    """`capture()` with every layer traced (no repetition)."""
    import sys

    with monkeypatch.context() as patch:
        patch.setattr(sys.modules["portable.capture"], "find_stack", lambda model: None)
        return capture()


@pytest.mark.parametrize(
    "recipe",
    [
        {"precision": Precision(compute="bfloat16"), "remat": "selective", "clip_grad_norm": 1.0},
        {"precision": Precision(compute="float16"), "remat": "full", "accumulate": 2},
    ],
    ids=["bf16-selective-clip", "fp16-full-accumulate"],
)
def test_a_deep_stack_is_traced_in_part_and_repeated_into_the_full_trace(
    hf_model, monkeypatch, recipe
):
    """Six Llama layers: five traced, the middle one repeated; the program equals the trace of
    all six node for node (op, spec, module path, phase, arguments), with the same signature:
    with clipping (the norms' stack gathers every layer), loss scaling and micro-batches (the
    gradients accumulate in ascending layer order, the backward runs descending)."""
    with torch.device("meta"):
        model = hf_model("llama", num_hidden_layers=6)
    batch = _batch()
    repeated = _train(model, batch, **recipe)
    assert repeated.metadata["repeated_layers"] == {
        "stack": "model.layers",
        "layers": 6,
        "traced": layers.CAPTURED,
        "template": layers.TEMPLATE,
    }
    whole = _traced_whole(monkeypatch, lambda: _train(model, batch, **recipe))
    assert "repeated_layers" not in whole.metadata
    assert _form(repeated) == _form(whole)
    assert repeated.signature == whole.signature
    assert sorted(repeated.weights) == sorted(whole.weights)
    sources = {getattr(n.meta.get("source"), "module", None) for n in repeated.graph.nodes}
    assert "model.layers.5.mlp.down_proj" in sources


def test_repeated_inference_of_the_gpt_example_equals_its_full_trace(monkeypatch):
    from examples.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=7))
    idx = _batch((2, 16))[0]
    repeated = portable.capture(model, (idx,))
    assert repeated.metadata["repeated_layers"]["layers"] == 7
    whole = _traced_whole(monkeypatch, lambda: portable.capture(model, (idx,)))
    assert _form(repeated) == _form(whole)


class _Stacked(torch.nn.Module):
    """Seven linear layers; returns every layer's output stacked (a list of all layers), or the
    last plus the third one's (a value outside the stack reading a middle layer)."""

    def __init__(self, skip: bool) -> None:
        super().__init__()
        self.skip = skip
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(7)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return x + outs[2] if self.skip else torch.stack(outs)


@pytest.mark.parametrize("skip", [False, True], ids=["stack-of-all", "reads-a-middle-layer"])
def test_repetition_gathers_lists_and_refuses_what_does_not_repeat(monkeypatch, skip):
    with torch.device("meta"):
        model = _Stacked(skip)
    x = torch.randn(2, 8)
    program = portable.capture(model, (x,))
    assert ("repeated_layers" in program.metadata) is not skip
    whole = _traced_whole(monkeypatch, lambda: portable.capture(model, (x,)))
    assert _form(program) == _form(whole)
    assert program.signature.outputs[0].spec.shape == ((2, 8) if skip else (7, 2, 8))


def test_layers_that_differ_are_traced_whole():
    """A stack whose layers differ in their parameters is not a repeated stack."""
    stack = torch.nn.ModuleList(torch.nn.Linear(4, 4 if k else 8) for k in range(7))
    assert layers.find_stack(torch.nn.Sequential(stack)) is None
    same = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(7))
    found = layers.find_stack(torch.nn.Sequential(same))
    assert found is not None and (found.path, found.count) == ("0", 7)


# --------------------------------------------------------------------------- the benchmark


def test_the_abstract_capture_benchmark_runs_its_smoke_case(monkeypatch):
    """benchmarks/abstract_capture.py --smoke: a 7-layer Llama from meta, captured (repeated
    layers), partitioned dp=2 x tp=2; the table and the goal check render."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "abstract_capture.py"
    spec = importlib.util.spec_from_file_location("_bench_abstract_capture", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    row = bench.measure(bench.CASES["smoke"])
    assert row["abstract"] and row["repeated_layers"]["layers"] == 7
    assert row["capture"]["wall_s"] > 0 and row["partition"]["cpu_s"] > 0
    assert row["per_rank_nodes"] > row["nodes"] > 0 and row["peak_rss_bytes"] > 0
    assert "| smoke (7 layers, width 64) |" in bench.table([row])
    seventy = {**row, "model": "Llama-3-70B", "peak_rss_bytes": 5 << 30}
    assert bench.goal(seventy).startswith("MISSED")
