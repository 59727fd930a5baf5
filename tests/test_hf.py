"""Hugging Face models built from small configs (no downloads) capture and run on `cpu`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import portable

pytestmark = pytest.mark.hf


MODELS = ["gpt2", "llama"]


def _lm_loss(model, idx, targets):
    return F.cross_entropy(model(idx).logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("name", MODELS)
def test_inference_identical(name, tmp_path, hf_model):
    torch.manual_seed(0)
    model = hf_model(name).eval()
    idx = torch.randint(0, 128, (2, 16))
    program = portable.capture(model, (idx,))
    assert [o.name for o in program.signature.outputs] == ["logits"]
    program = portable.load(program.save(tmp_path / "hf.portable"))
    with torch.no_grad():
        want = model(idx).logits
    assert torch.equal(portable.compile(program)(idx), want)
    ops = {portable.opset.op_name(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "portable.attention.default" in ops  # HF's sdpa attention becomes the portable op


@pytest.mark.parametrize("name", MODELS)
def test_training_step_matches_eager(name, hf_model):
    torch.manual_seed(0)
    model = hf_model(name)
    batch = (torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16)))
    opt = portable.optim.AdamW(lr=1e-3)
    step = portable.compile(portable.capture(model, batch, loss_fn=_lm_loss, optimizer=opt))
    eager = torch.optim.AdamW(model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay)
    model.train()
    for _ in range(2):
        eager.zero_grad()
        loss = _lm_loss(model, *batch)
        loss.backward()
        eager.step()
        result = step(*batch)
        torch.testing.assert_close(result.loss, loss.detach(), rtol=1e-6, atol=0)


def test_gpt2_with_dropout_trains_with_the_program_generator(hf_model):
    model = hf_model("gpt2", n_layer=1, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    batch = (torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8)))
    step = portable.capture(model, batch, loss_fn=_lm_loss, optimizer=portable.optim.SGD(lr=0.1))
    exe = portable.compile(step, backend="cpu")
    first, second = exe(*batch), exe(*batch)
    assert torch.isfinite(first.loss) and int(exe.state["rng.offset"]) == 2
    assert float(first.loss) != float(second.loss)
