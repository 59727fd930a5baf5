"""The `mx-quantize` pass: which layers and GEMMs it quantizes, on the examples and Hugging Face
Llama, with `keep_first_last`, `include` and `exclude`, and the GEMMs it reports instead because
their contraction is not a multiple of the block size. Expected layers and GEMMs come from the
models' own `nn.Linear` modules and the recipe's contraction dims, not from the pass."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import portable
from portable.ir.source import source_of
from portable.passes import parse_pass
from tests.support.mx_pass import DQ, GEMMS, Q, aten, calls, captured, dequantized, run_pass

TOKENS = {"mlp": 8, "gpt": 32, "llama": 32}  # rows of the flattened activations (M)
# keep_first_last keeps every linear that reads the model's first activation (block 0's
# attention projections all read the norm of the embedding) and every one that writes its last
BOUNDARY = {
    "mlp": {"fc1", "fc2"},
    "gpt": {"blocks.0.attn.qkv", "lm_head"},
    "llama": {"blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj", "lm_head"},
}
NO_INPUT_GRAD = {"mlp": {"fc1"}}  # linears whose input is the batch: no input_grad GEMM


def expected_gemms(spec, stem: str, training: bool, chosen) -> dict[str, list[str]]:
    """Per chosen nn.Linear: the recipe's GEMMs whose contraction dim (K = in_features,
    N = out_features, M = tokens) is a multiple of the block size 32."""
    linears = {n: m for n, m in spec.build().named_modules() if isinstance(m, nn.Linear)}
    expected = {}
    for name in chosen(list(linears)):
        m = linears[name]
        sizes = {"forward": m.in_features}
        if training and name not in NO_INPUT_GRAD.get(stem, ()):
            sizes["input_grad"] = m.out_features
        if training:
            sizes["weight_grad"] = TOKENS[stem]
        roles = [g for g in GEMMS if g in sizes and sizes[g] % 32 == 0]
        if roles:
            expected[name] = roles
    return expected


@pytest.mark.parametrize("keep_first_last", [True, False], ids=["keep", "all"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "train_step"])
@pytest.mark.parametrize("stem", ["mlp", "gpt", "llama"])
def test_example_layers_and_gemms(example_spec, stem, training, keep_first_last):
    program, spec = captured(example_spec, stem, training)
    kept = BOUNDARY[stem] if keep_first_last else set()
    chosen = lambda names: [n for n in names if n not in kept]  # noqa: E731
    expected = expected_gemms(spec, stem, training, chosen)
    flag = "true" if keep_first_last else "false"
    out, report = run_pass(program, f"mx-quantize{{keep_first_last={flag}}}")
    record = out.metadata.get("mx_quantize")
    got = {layer["module"]: layer["gemms"] for layer in record["layers"]} if record else {}
    assert list(got.items()) == list(expected.items())  # same layers, in graph order
    counts = {g: sum(g in roles for roles in expected.values()) for g in GEMMS}
    assert report.counts == {"layers": len(expected), **counts}
    assert report.changed == bool(expected)
    n_gemms = sum(counts.values())
    assert len(calls(out, Q)) == len(calls(out, DQ)) == 2 * n_gemms
    # GEMMs of chosen layers have both operands dequantized, the others none
    quantized = []
    for node in calls(out, aten.mm.default) + calls(out, aten.addmm.default):
        dqs = [dequantized(a) for a in node.args[-2:]]
        assert all(dqs) or not any(dqs), node.format_node()
        if all(dqs):
            assert source_of(node).module in expected, node.format_node()
            quantized.append(node)
    assert len(quantized) == n_gemms
    # attention, embeddings, norms and (with keep_first_last) the LM head stay high precision
    for node in out.graph.nodes:
        if node.op == "call_function" and node.target not in (aten.mm.default, aten.addmm.default):
            if node.target not in (aten.t.default, operator.getitem, Q, DQ):
                assert not any(n.target in (DQ, Q) for n in node.all_input_nodes), (
                    node.format_node()
                )
    if keep_first_last:
        first = {n for n in BOUNDARY[stem] if n != ("fc2" if stem == "mlp" else "lm_head")}
        assert _kept(report) == {"first": first, "last": BOUNDARY[stem] - first}
    if training and stem in ("gpt", "llama"):
        assert all(roles == list(GEMMS) for roles in got.values())  # 3 GEMMs per linear
    assert out.signature == program.signature


def _kept(report) -> dict[str, set[str]]:
    """Modules kept by keep_first_last, from the report's notes: {"first": ..., "last": ...}."""
    kept = {}
    for note in report.notes:
        for which in ("first", "last"):
            if note.startswith(f"kept in high precision, {which} linear layers"):
                kept[which] = set(note.split(": ", 1)[1].split(", "))
    return kept


@pytest.mark.hf
@pytest.mark.parametrize("training", [False, True], ids=["inference", "train_step"])
def test_keep_first_last_keeps_every_projection_of_the_first_activation(hf_model, training):
    """Hugging Face Llama: q_proj, k_proj and v_proj of layer 0 all read the first activation
    (the norm of the embedding), so all three stay high precision, not q_proj alone."""
    torch.manual_seed(0)
    model = hf_model("llama")
    ids = torch.randint(0, 128, (2, 16))
    if training:
        loss = lambda m, i, t: F.cross_entropy(m(i).logits.flatten(0, 1), t.flatten())  # noqa: E731
        program = portable.capture(
            model, (ids, ids), loss_fn=loss, optimizer=portable.optim.SGD(lr=0.1)
        )
    else:
        program = portable.capture(model.eval(), (ids,))
    out, report = run_pass(program)
    first = {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}
    assert _kept(report) == {"first": first, "last": {"lm_head"}}
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantized = {layer["module"] for layer in out.metadata["mx_quantize"]["layers"]}
    assert quantized == linears - first - {"lm_head"} and len(quantized) == 11


class TwoInTwoOut(nn.Module):
    """Two inputs, each with its own projection, and two heads on the last hidden state."""

    def __init__(self):
        super().__init__()
        self.a_in, self.b_in = nn.Linear(32, 64), nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.logits, self.value = nn.Linear(64, 32), nn.Linear(64, 32)

    def forward(self, a, b):
        h = F.gelu(self.mid(F.gelu(self.a_in(a)) + F.gelu(self.b_in(b))))
        return self.logits(h), self.value(h)


def test_keep_first_last_keeps_every_input_projection_and_every_head():
    program = portable.capture(TwoInTwoOut().eval(), (torch.randn(32, 32), torch.randn(32, 32)))
    out, report = run_pass(program)
    assert _kept(report) == {"first": {"a_in", "b_in"}, "last": {"logits", "value"}}
    assert [layer["module"] for layer in out.metadata["mx_quantize"]["layers"]] == ["mid"]


def test_mlp_training_skips_gemms_whose_contraction_is_not_a_block_multiple(example_spec):
    """examples/mlp.py trains on 8 rows and has 4 outputs: its weight gradients (M=8) and fc2's
    input gradient (N=4) cannot be blocked by 32 and are reported, not quantized."""
    program, _ = captured(example_spec, "mlp", True)
    _, report = run_pass(program, "mx-quantize{keep_first_last=false}")
    assert report.counts == {"layers": 2, "forward": 2, "input_grad": 0, "weight_grad": 0}
    assert any("fc2 input_grad" in n and "N=4 is not a multiple of 32" in n for n in report.notes)
    assert any("fc1 weight_grad" in n and "M=8" in n for n in report.notes)


@pytest.mark.parametrize(
    ("options", "modules"),
    [
        (
            'include="mlp"',
            ["blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj"],
        ),
        (
            'exclude="attn"',
            ["blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj"],
        ),
        ('include="blocks\\.1",exclude=proj', ["blocks.1.attn.qkv", "blocks.1.mlp.fc"]),
        (
            'include="qkv|head",keep_first_last=false',
            ["blocks.0.attn.qkv", "blocks.1.attn.qkv", "lm_head"],
        ),
    ],
)
def test_include_exclude(example_spec, options, modules):
    program, _ = captured(example_spec, "gpt", True)
    out, report = run_pass(program, f"mx-quantize{{{options}}}")
    layers = out.metadata["mx_quantize"]["layers"]
    assert [layer["module"] for layer in layers] == modules
    assert all(layer["gemms"] == list(GEMMS) for layer in layers)
    assert report.counts["layers"] == len(modules)
    kept = " ".join(report.notes)
    p = parse_pass(f"mx-quantize{{{options}}}")
    if p.include:
        assert f"not matched by include={p.include!r}" in kept
    if p.exclude:
        assert f"matched by exclude={p.exclude!r}" in kept
