"""Hugging Face models built from small configs (no downloads) capture and run on `cpu`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import portable

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.hf


def _gpt2():
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _lm_loss(model, idx, targets):
    return F.cross_entropy(model(idx).logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("name", list(MODELS))
def test_inference_identical(name, tmp_path):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    idx = torch.randint(0, 128, (2, 16))
    program = portable.capture(model, (idx,))
    assert [o.name for o in program.signature.outputs] == ["logits"]
    program = portable.load(program.save(tmp_path / "hf.portable"))
    with torch.no_grad():
        want = model(idx).logits
    assert torch.equal(portable.compile(program)(idx), want)
    ops = {portable.opset.op_name(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "portable.attention.default" in ops  # HF's sdpa attention becomes the portable op


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_matches_eager(name):
    torch.manual_seed(0)
    model = MODELS[name]()
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


def test_gpt2_with_dropout_is_refused_for_training():
    cfg = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    batch = (torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8)))
    with pytest.raises(portable.CaptureError) as info:
        portable.capture(model, batch, loss_fn=_lm_loss, optimizer=portable.optim.SGD(lr=0.1))
    message = str(info.value)
    assert "dropout" in message and "transformer.h.0" in message and "modeling_gpt2.py" in message
