"""Larger models. CI runs the small form; PORTABLE_SLOW=full runs GPT-2 small (124M parameters)."""

from __future__ import annotations

import os

import pytest
import torch

import portable

FULL = os.environ.get("PORTABLE_SLOW") == "full"
# GPT-2 small (124M) in full; a 4-layer, 256-wide model in CI's small form.
CONFIG = (
    dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)
    if FULL
    else dict(n_layer=4, n_embd=256, n_head=8, vocab_size=4096)
)


@pytest.mark.slow
def test_gpt2_sized_capture_save_load_run(tmp_path, hf_model):
    torch.manual_seed(0)
    model = hf_model("gpt2", n_positions=128, **CONFIG).eval()
    idx = torch.randint(0, model.config.vocab_size, (1, 128))
    program = portable.capture(model, (idx,))
    n_params = sum(w.numel() for w in program.parameters().values())
    assert n_params == sum(p.numel() for p in model.parameters())  # tied weights counted once
    loaded = portable.load(program.save(tmp_path / "gpt2.portable"))
    with torch.no_grad():
        assert torch.equal(portable.compile(loaded)(idx), model(idx).logits)
