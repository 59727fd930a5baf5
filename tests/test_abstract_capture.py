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
from portable import Mesh, Plan
from portable.capture import layers
from portable.errors import AbstractProgramError
from portable.ir.program import Program
from portable.passes.spmd_partition import partition
from tests.spmd_cases import hf_plan_for

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


# --------------------------------------------------------------------------- capture


def test_meta_llama_captures_inference_and_training_as_the_real_model_does(hf_model):
    meta, real = _meta_and_real(lambda: hf_model("llama"))
    idx, targets = _batch()
    _assert_same_program(portable.capture(meta, (idx,)), portable.capture(real, (idx,)))
    recipe = {"precision": Precision(compute="bfloat16"), "remat": "selective"}
    abstract = _train(meta, (idx, targets), **recipe)
    _assert_same_program(abstract, _train(real, (idx, targets), **recipe))
    assert abstract.kind.value == "training_step"
    # the model is left as it was: still on meta, no fake tensor left behind
    assert all(p.is_meta for p in meta.parameters())
    assert all(b.is_meta for b in meta.buffers())


def test_meta_example_inputs_capture_too(hf_model):
    with torch.device("meta"):
        model = hf_model("llama")
    idx = torch.empty(4, 16, dtype=torch.int64, device="meta")
    program = _train(model, (idx, idx))
    assert program.abstract
    assert [i.spec.shape for i in program.signature.user_inputs] == [(4, 16), (4, 16)]


@pytest.mark.parametrize("plan", ["dp_tp", "fsdp"])
def test_partitioned_abstract_program_has_the_real_per_rank_shapes(hf_model, plan):
    meta, real = _meta_and_real(lambda: hf_model("llama"))
    batch = _batch()
    chosen = hf_plan_for("llama", plan)
    per_rank = {}
    for name, model in (("abstract", meta), ("real", real)):
        program = _train(model, batch, precision=Precision(compute="bfloat16"), remat="full")
        per_rank[name], _ = partition(program.replace(plan=chosen))
    _assert_same_program(per_rank["abstract"], per_rank["real"])
    assert per_rank["abstract"].spmd == per_rank["real"].spmd
    portable.verify(per_rank["abstract"])


def test_running_an_abstract_program_is_refused_with_the_fix(hf_model):
    with torch.device("meta"):
        model = hf_model("llama")
    idx, _ = _batch()
    program = portable.capture(model, (idx,))
    with pytest.raises(AbstractProgramError) as info:
        portable.compile(program, backend="cpu")
    message = str(info.value)
    assert "is abstract" in message and "model.embed_tokens.weight" in message
    assert "to_empty(device='cpu')" in message and "load_state_dict" in message


def test_a_plain_mesh_of_one_still_partitions_an_abstract_gpt():
    from examples.gpt import GPT

    with torch.device("meta"):
        model = GPT()
    idx, targets = _batch((2, 16))
    program = _train(model, (idx, targets))
    per_rank, _ = partition(program.replace(plan=Plan(Mesh({"dp": 2}), batch_axes=("dp",))))
    assert per_rank.abstract
    assert [i.spec.shape for i in per_rank.signature.user_inputs] == [(1, 16), (1, 16)]


def test_saving_an_abstract_program_is_refused(tmp_path):
    from examples.gpt import GPT

    with torch.device("meta"):
        model = GPT()
    program = portable.capture(model, (_batch((2, 16))[0],))
    with pytest.raises(AbstractProgramError, match=r"saving needs weight values"):
        program.save(tmp_path / "gpt.portable")
    assert not (tmp_path / "gpt.portable").exists()
    assert len(program.content_hash) == 64  # hashed from shapes and dtypes


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


def test_a_deep_stack_is_traced_in_part_and_repeated_into_the_full_trace(hf_model, monkeypatch):
    """Six Llama layers: five traced, the middle one repeated; the program equals the trace of
    all six node for node (op, spec, module path, phase, arguments), with the same signature."""
    with torch.device("meta"):
        model = hf_model("llama", num_hidden_layers=6)
    batch = _batch()
    recipe = {
        "precision": Precision(compute="bfloat16"),
        "remat": "selective",
        "clip_grad_norm": 1.0,
    }
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


def test_layers_that_differ_are_traced_whole():
    """A stack whose layers differ in their parameters is not a repeated stack."""
    stack = torch.nn.ModuleList(torch.nn.Linear(4, 4 if k else 8) for k in range(7))
    assert layers.find_stack(torch.nn.Sequential(stack)) is None
    same = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(7))
    found = layers.find_stack(torch.nn.Sequential(same))
    assert found is not None and (found.path, found.count) == ("0", 7)
