"""Llama: a small Llama-style decoder.

Demonstrates `nn.RMSNorm` (aten.rms_norm), rotary position embeddings in the rotate-half form
with cos/sin tables precomputed as non-persistent buffers, a SwiGLU MLP, and grouped-query
attention (4 query heads sharing 2 key/value heads) through
`F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`. No biases, untied LM
head. Trained with AdamW on next-token cross entropy.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from portable.capture.decorator import portable
from portable.optim import AdamW


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128
    max_seq_len: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    dim: int = 64
    intermediate_size: int = 192  # ~8/3 * dim, rounded up to a multiple of 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


BATCH, SEQ = 2, 16
_VOCAB = LlamaConfig.vocab_size


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (max_seq_len, head_dim), laid out for `rotate_half`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        assert config.dim % config.n_head == 0 and config.n_head % config.n_kv_head == 0
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.dim // config.n_head
        self.q_proj = nn.Linear(config.dim, config.n_head * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        x = x + self.mlp(self.mlp_norm(x))
        return x


@portable(
    example_inputs=lambda: (torch.randint(0, _VOCAB, (BATCH, SEQ)),),
    loss_fn=lambda model, idx, targets: F.cross_entropy(
        model(idx).flatten(0, 1), targets.flatten()
    ),
    example_batch=lambda: (
        torch.randint(0, _VOCAB, (BATCH, SEQ)),
        torch.randint(0, _VOCAB, (BATCH, SEQ)),
    ),
    optimizer=AdamW(lr=1e-3),
)
class Llama(nn.Module):
    """Maps token ids (B, T) to next-token logits (B, T, vocab_size)."""

    def __init__(self, config: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.dim // config.n_head, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))
