"""A small Hugging Face Llama (transformers' LlamaForCausalLM) as a `@portable` training spec.

    portable data tokenize docs/parallelism.md --tokenizer bytes --out tokens.bin
    portable train examples/hf_llama.py:TinyLlama --data tokens.bin --steps 200 --out runs/llama

The vocabulary is 256 (the byte tokenizer's ids); sizes are a test-sized Llama with
grouped-query attention (4 heads, 2 key/value heads). Needs `transformers` (the `hf` extra).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from portable.capture.decorator import portable
from portable.optim import AdamW

VOCAB, BATCH, SEQ = 256, 8, 32


def _lm_loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).logits.flatten(0, 1), targets.flatten())


@portable(
    example_inputs=lambda: (torch.randint(0, VOCAB, (BATCH, SEQ)),),
    loss_fn=_lm_loss,
    example_batch=lambda: (
        torch.randint(0, VOCAB, (BATCH, SEQ)),
        torch.randint(0, VOCAB, (BATCH, SEQ)),
    ),
    optimizer=AdamW(lr=1e-3),
    clip_grad_norm=1.0,
)
def TinyLlama() -> torch.nn.Module:  # noqa: N802 (a model name, as SPEC spells it)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)
