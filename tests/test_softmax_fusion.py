"""`softmax-fusion`: written-out attention -> portable::attention (+ attention_backward in
training steps), softmax(x * c + m) -> portable::scale_mask_softmax."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import portable
from portable.opset import op_name
from portable.passes import PassManager, get_pass, registry

ATTENTION = "portable.attention.default"
BACKWARD = "portable.attention_backward.default"
MASK_GRAD = "portable.attention_backward.mask_grad"  # a trainable mask's backward
SOFTMAX = "aten._softmax.default"
SOFTMAX_BACKWARD = "aten._softmax_backward_data.default"


# Parameters are compared after SGD steps: AdamW turns rounding noise in a gradient that is
# analytically zero (the key bias: softmax ignores a per-row constant) into lr-sized steps.
SGD = portable.optim.SGD(lr=0.1)


def _fuse(program, **options):
    out, (report,) = PassManager([get_pass("softmax-fusion", **options)], verify_each=True).run(
        program
    )
    return out, report


def _ops(program):
    return [op_name(n.target) for n in program.graph.nodes if n.op == "call_function"]


def _check_inference(program, inputs, layers, **counts):
    fused, report = _fuse(program)
    assert report.counts["attention"] + report.counts["already-fused"] == layers
    for key, value in counts.items():
        assert report.counts.get(key, 0) == value, (key, report.counts)
    ops = _ops(fused)
    assert ops.count(ATTENTION) == layers
    want = portable.compile(program)(*inputs)
    got = portable.compile(fused)(*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    return fused, report


def _check_training(program, batch, layers, steps=3):
    fused, report = _fuse(program)
    assert report.counts["attention"] + report.counts["already-fused"] == layers
    assert report.counts["attention-backward"] == report.counts["attention"]
    ops = _ops(fused)
    assert ops.count(ATTENTION) == ops.count(BACKWARD) + ops.count(MASK_GRAD) == layers
    # the probabilities are no longer saved for a softmax backward
    assert (
        ops.count(SOFTMAX_BACKWARD)
        == _ops(program).count(SOFTMAX_BACKWARD) - report.counts["attention"]
    )
    want, got = portable.compile(program), portable.compile(fused)
    for _ in range(steps):
        a, b = want(*batch), got(*batch)
        torch.testing.assert_close(b.loss, a.loss, rtol=0, atol=1e-5)
    for name in program.parameters():
        torch.testing.assert_close(got.state[name], want.state[name], rtol=0, atol=1e-5)
    return fused, report


def test_registered():
    assert registry.get("softmax-fusion").name == "softmax-fusion"
    assert get_pass("softmax-fusion", verbose=True).spec() == "softmax-fusion{verbose=true}"


# ---- examples/ -------------------------------------------------------------------------------

EXAMPLE_LAYERS = {"gpt": 2, "llama": 2, "moe": 0, "mlp": 0, "cnn": 0}


@pytest.mark.parametrize("stem", sorted(EXAMPLE_LAYERS))
def test_examples_inference(stem, example_spec):
    spec = example_spec(stem)
    program = portable.capture_spec(spec)
    _check_inference(program, spec.inputs(), EXAMPLE_LAYERS[stem])


@pytest.mark.parametrize("stem", ["gpt", "llama"])
def test_examples_training(stem, example_spec):
    spec = example_spec(stem)
    program = portable.capture(spec.build(), spec.batch(), loss_fn=spec.loss_fn, optimizer=SGD)
    _check_training(program, spec.batch(), EXAMPLE_LAYERS[stem])


# ---- Hugging Face eager attention ------------------------------------------------------------

HF_LAYERS = {"gpt2": 2, "llama": 2, "bert": 2, "mixtral": 1}
HF_TAGS = {
    "gpt2": {"additive-mask": 2, "scale-mul": 2},
    "llama": {"additive-mask": 2, "gqa-repeat": 2},
    "bert": {"additive-mask": 2},
    "mixtral": {"gqa-repeat": 1, "near-miss": 1},  # the router softmax is not attention
}


def _lm_loss(model, idx, targets):
    return F.cross_entropy(model(idx).logits.flatten(0, 1), targets.flatten())


@pytest.mark.hf
@pytest.mark.parametrize("name", sorted(HF_LAYERS))
def test_hf_inference(name, hf_model):
    torch.manual_seed(0)
    model = hf_model(name, attn_implementation="eager").eval()
    idx = torch.randint(0, 128, (2, 16))
    program = portable.capture(model, (idx,))
    _check_inference(program, (idx,), HF_LAYERS[name], **HF_TAGS[name])


@pytest.mark.hf
@pytest.mark.parametrize("name", sorted(HF_LAYERS))
def test_hf_training(name, hf_model):
    torch.manual_seed(0)
    model = hf_model(name, attn_implementation="eager")
    batch = (torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16)))
    program = portable.capture(model, batch, loss_fn=_lm_loss, optimizer=SGD)
    _check_training(program, batch, HF_LAYERS[name])


# ---- small attention: golden text, near miss, scale-mask-softmax -----------------------------


class Attn(nn.Module):
    """q @ k^T / sqrt(d), causal masked_fill, softmax, @ v, on [B, H, L, D] inputs."""

    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        keep = torch.tril(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool))
        s = s.masked_fill(~keep, float("-inf"))
        return F.softmax(s, dim=-1) @ v


def _qkv():
    torch.manual_seed(0)
    return tuple(torch.randn(1, 2, 4, 8) for _ in range(3))


GOLDEN = """\
  %attention = portable.attention.default(%q, %k, %v, None, True, 0.35355339059327373) : float32[1x2x4x8]  # <root>
  out 0: output = %attention"""


def test_golden_text():
    program = portable.capture(Attn(), _qkv())
    fused, report = _check_inference(program, _qkv(), 1, **{"causal-tril": 1, "scale-div": 1})
    body = [line for line in fused.text().splitlines() if line.startswith(("  %", "  out"))]
    assert "\n".join(body) == GOLDEN  # the mask's full/tril are dead and gone
    assert report.summary() == (
        "softmax-fusion: changed (attention=1, bool-mask=1, scale-div=1, causal-tril=1)"
    )


class MaskBeforeScale(nn.Module):
    def forward(self, q, k, v, m):
        return F.softmax((q @ k.transpose(-2, -1) + m) * 0.5, dim=-1) @ v


def test_near_miss_is_explained():
    m = torch.zeros(4, 4)
    program = portable.capture(MaskBeforeScale(), (*_qkv(), m))
    fused, report = _fuse(program, verbose=True)
    assert report.counts["attention"] == 0 and report.counts["near-miss"] == 1
    (note,) = report.notes
    assert "not fused" in note and "mask added before the scale" in note
    assert _fuse(program)[1].notes == []  # notes only in verbose mode


class ScaleMaskSoftmax(nn.Module):
    def forward(self, x, m):
        return F.softmax(x * 0.125 + m, dim=-1) * 2


def test_standalone_scale_mask_softmax():
    torch.manual_seed(0)
    inputs = (torch.randn(2, 3, 5), torch.randn(3, 5))
    program = portable.capture(ScaleMaskSoftmax(), inputs)
    fused, report = _fuse(program)
    assert report.counts["scale-mask-softmax"] == 1 and report.counts["attention"] == 0
    ops = _ops(fused)
    assert "portable.scale_mask_softmax.default" in ops and SOFTMAX not in ops
    want = portable.compile(program)(*inputs)
    torch.testing.assert_close(portable.compile(fused)(*inputs), want, rtol=0, atol=1e-5)


def test_plain_softmax_is_left_alone():
    class Plain(nn.Module):
        def forward(self, x):
            return F.softmax(x, dim=-1)

    program = portable.capture(Plain(), (torch.randn(2, 5),))
    fused, report = _fuse(program)
    assert fused is not None and not report.changed and report.counts["near-miss"] == 1


# ---- spellings real models use: einsum, torch.where, no scale, several masks, fp32 softmax ----


class Einsum(nn.Module):
    def forward(self, q, k, v):  # [B, T, H, D] in and out, as einsum code often has it
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


class WhereFill(nn.Module):
    """torch.where(keep, s, fill) with fill a float, finfo.min, or a tensor (a program
    constant)."""

    def __init__(self, fill: str):
        super().__init__()
        self.fill = fill

    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-2, -1) * 0.3
        fill = {
            "float": float("-inf"),
            "finfo-min": torch.finfo(s.dtype).min,
            "tensor": torch.tensor(float("-inf")),
        }[self.fill]
        return F.softmax(torch.where(keep, s, fill), dim=-1) @ v


class TwoMasks(nn.Module):
    """T5's spelling: no scale, a position bias and then a padding mask added, fp32 softmax."""

    def forward(self, q, k, v, bias, pad):
        s = torch.matmul(q, k.transpose(3, 2))
        s = s + bias
        s = s + pad
        return torch.matmul(F.softmax(s.float(), dim=-1).type_as(s), v)


def _keep():
    keep = torch.rand(4, 4) > 0.3
    keep[:, 0] = True
    return keep


SPELLINGS = {
    "einsum": (Einsum, lambda: tuple(t.transpose(1, 2) for t in _qkv()), {"scale-mul": 1}),
    "where-float": (lambda: WhereFill("float"), lambda: (*_qkv(), _keep()), {"bool-mask": 1}),
    "where-finfo-min": (lambda: WhereFill("finfo-min"), lambda: (*_qkv(), _keep()), {}),
    "where-tensor": (lambda: WhereFill("tensor"), lambda: (*_qkv(), _keep()), {"bool-mask": 1}),
    "two-masks": (
        TwoMasks,
        lambda: (*_qkv(), torch.randn(1, 2, 4, 4), torch.randn(1, 1, 1, 4)),
        {"additive-mask": 2},
    ),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spellings_fuse(name):
    make, inputs, counts = SPELLINGS[name]
    torch.manual_seed(0)
    args = inputs()
    program = portable.capture(make(), args)
    _check_inference(program, args, 1, **counts)


def test_fp32_softmax_round_trip_in_bfloat16():
    """softmax(s.float()).to(q.dtype) in a bfloat16 program: fused, equal to one bf16 ulp."""

    class RoundTrip(nn.Module):
        def forward(self, q, k, v):
            s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            return F.softmax(s.float(), dim=-1).to(q.dtype) @ v

    args = tuple(t.bfloat16() for t in _qkv())
    program = portable.capture(RoundTrip(), args)
    fused, report = _fuse(program)
    assert report.counts["attention"] == 1 and report.counts["fp32-softmax"] == 2
    want = portable.compile(program)(*args)
    torch.testing.assert_close(portable.compile(fused)(*args), want, rtol=1.6e-2, atol=1e-2)


class Projected(nn.Module):
    """q, k, v from a linear layer, then `inner`: something to train."""

    def __init__(self, inner):
        super().__init__()
        self.qkv, self.inner = nn.Linear(8, 24), inner

    def forward(self, x, *masks):
        return self.inner(*self.qkv(x).chunk(3, -1), *masks)


def _projected_batch(*masks):
    torch.manual_seed(1)
    return (torch.randn(1, 2, 4, 8), *masks)


def _training(inner, batch):
    torch.manual_seed(0)
    loss = lambda model, *b: model(*b).square().mean()  # noqa: E731
    return portable.capture(Projected(inner), batch, loss_fn=loss, optimizer=SGD)


class TrainedBias(nn.Module):
    """TwoMasks with a learned position bias: its gradient comes from attention_backward."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 2, 4, 4))

    def forward(self, q, k, v, pad):
        return TwoMasks()(q, k, v, self.bias, pad)


@pytest.mark.parametrize("name", ["where-tensor", "trained-bias"])
def test_spellings_fuse_in_training(name):
    pad = torch.zeros(1, 1, 1, 4)
    pad[..., -1] = float("-inf")
    inner, batch = {
        "where-tensor": (WhereFill("tensor"), _projected_batch(_keep())),
        "trained-bias": (TrainedBias(), _projected_batch(pad)),
    }[name]
    program = _training(inner, batch)
    fused, _ = _check_training(program, batch, 1)
    if name == "trained-bias":
        assert MASK_GRAD in _ops(fused)


def test_near_misses_say_which_condition_failed():
    # einsum's backward is spelled with other bmm's than the matcher reads: fused as
    # scale_mask_softmax, and the note says why not attention
    batch = _projected_batch()
    fused, report = _fuse(_training(Einsum(), batch), verbose=True)
    (note,) = report.notes
    assert "fused as scale_mask_softmax, not attention" in note
    assert "softmax backward input" in note and "is not dO @ V^T" in note

    class SmallFill(nn.Module):  # -1e4 (old GPT-2) is not a mask fill: exp(-1e4) > 0 in float64
        def forward(self, q, k, v, keep):
            s = q @ k.transpose(-2, -1)
            return F.softmax(torch.where(keep, s, -1e4), dim=-1) @ v

    program = portable.capture(SmallFill(), (*_qkv(), _keep()))
    (note,) = _fuse(program, verbose=True)[1].notes
    assert "where fills -10000, not a mask fill (<= -1e+30)" in note

    class BoolAndAdditive(nn.Module):
        def forward(self, q, k, v, keep, bias):
            s = torch.where(keep, q @ k.transpose(-2, -1), float("-inf")) + bias
            return F.softmax(s, dim=-1) @ v

    program = portable.capture(BoolAndAdditive(), (*_qkv(), _keep(), torch.randn(4, 4)))
    (note,) = _fuse(program, verbose=True)[1].notes
    assert "a bool mask together with an additive mask" in note


@pytest.mark.hf
def test_hf_t5_eager(hf_model):
    """T5: no scale (or * 1.0), position bias + padding mask, an fp32 softmax; in training the
    bias's gradient comes from attention_backward.mask_grad."""
    torch.manual_seed(0)
    model = hf_model("t5", attn_implementation="eager")
    ids, labels = torch.randint(2, 128, (2, 8)), torch.randint(2, 128, (2, 6))
    program = portable.capture(model.eval(), (ids,), kwargs={"decoder_input_ids": labels})
    fused, report = _fuse(program)
    assert report.counts["attention"] == 3 and report.counts["additive-mask"] == 6
    want = portable.compile(program)(ids, labels)
    got = portable.compile(fused)(ids, labels)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    def loss(model, ids, labels):
        return model(input_ids=ids, labels=labels).loss

    program = portable.capture(model.train(), (ids, labels), loss_fn=loss, optimizer=SGD)
    fused, _ = _check_training(program, (ids, labels), 3)
    assert _ops(fused).count(MASK_GRAD) == 2  # the self-attentions (cross-attention has no bias)
