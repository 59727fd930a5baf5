"""`Transformer`: a standard decoder-only transformer described by its config, built as a module.

The planner reproduces published runs without the user writing a model: `Transformer(...)`
names the architecture and `Transformer.module()` builds it as an `nn.Module` (on the `meta`
device by default: shapes without values), which the planner captures as a training step like
any user model. The defaults are GPT-3's as Megatron-LM trained it (the published runs in
shared/reference/planner-validation.md): pre-LayerNorm blocks with biases, learned positions,
a fused QKV projection, attention written out as Megatron's core attention (`baddbmm` with the
1/sqrt(d) scale, causal mask, softmax, dropout, `bmm`), a GeLU MLP of width 4h, dropout 0.1 on
the attention probabilities and after each residual branch, and an LM head tied to the token
embedding. Llama-style models set `gated_mlp=True` (SwiGLU of width `ffn`), `norm="rmsnorm"`,
`bias=False`, `rotary=True`, `kv_heads` (grouped-query attention) and `attention="flash"`
(fused attention: `F.scaled_dot_product_attention`, which capture turns into
`portable::attention`). MoE models set `experts` and `top_k`: the block's MLP is then one
expert's (the planner scales its cost by the routed tokens, see costs.py).

Module paths follow examples/gpt.py (`blocks.N.attn.qkv`, `blocks.N.attn.proj`,
`blocks.N.mlp.fc`, `blocks.N.mlp.proj`; gated: `blocks.N.mlp.gate`, `.up`, `.proj`), so the
Megatron tensor-parallel rules of `tp_rules()` apply.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import PlannerError
from ..ir.plan import ShardingRule
from ..parallel import column_parallel, row_parallel, vocab_parallel

__all__ = ["Transformer"]

_ATTENTION = ("eager", "flash")
_NORMS = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer: `layers` blocks of width `hidden` with `heads` attention
    heads, a `vocab`-entry embedding, trained on sequences of `seq` tokens (module docstring
    for the defaults and the Llama / MoE switches)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int | None = None  # MLP width; 4 * hidden by default
    kv_heads: int | None = None  # grouped-query attention; `heads` by default
    gated_mlp: bool = False
    experts: int = 0  # 0: a dense MLP
    top_k: int = 0  # experts per token (2 by default when `experts` is set)
    attention: str = "eager"
    norm: str = "layernorm"
    bias: bool = True
    rotary: bool = False
    dropout: float = 0.1
    tied_embeddings: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlannerError(
                    f"Transformer.{field}={value!r}", fix=f"{field} is a positive integer"
                )
        if self.hidden % self.heads:
            raise PlannerError(
                f"hidden={self.hidden} is not a multiple of heads={self.heads}",
                fix="pick heads that divide hidden",
            )
        if self.heads % self.kv_count:
            raise PlannerError(
                f"heads={self.heads} is not a multiple of kv_heads={self.kv_count}",
                fix="grouped-query attention shares each key/value head by heads/kv_heads heads",
            )
        if self.attention not in _ATTENTION or self.norm not in _NORMS:
            raise PlannerError(
                f"attention={self.attention!r}, norm={self.norm!r}",
                fix=f"attention is one of {_ATTENTION}, norm one of {_NORMS}",
            )
        if self.experts < 0 or self.top_k < 0 or (self.experts and self.top_k > self.experts):
            raise PlannerError(
                f"experts={self.experts}, top_k={self.top_k}",
                fix="experts >= 0 and 1 <= top_k <= experts for a mixture of experts",
            )
        if not 0.0 <= self.dropout < 1.0:
            raise PlannerError(f"dropout={self.dropout}", fix="dropout is in [0, 1)")

    # ------------------------------------------------------------------------ derived sizes

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_count(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def routed(self) -> int:
        """Experts each token runs: `top_k` (2 by default) for MoE, 1 for a dense MLP."""
        return (self.top_k or 2) if self.experts else 1

    @property
    def parameters(self) -> int:
        """Parameter count (all experts of an MoE model)."""
        h, kv = self.hidden, self.kv_count * self.head_dim
        attn = h * (h + 2 * kv) + h * h + (h + 2 * kv + h if self.bias else 0)
        width = self.ffn_width
        mlp = (3 if self.gated_mlp else 2) * h * width
        if self.bias:
            mlp += (2 if self.gated_mlp else 1) * width + h
        norms = (2 if self.norm == "layernorm" else 1) * 2 * h
        router = h * self.experts
        block = attn + mlp * max(self.experts, 1) + norms + router
        embed = self.vocab * h + (0 if self.rotary else self.seq * h)
        head = 0 if self.tied_embeddings else self.vocab * h
        final_norm = (2 if self.norm == "layernorm" else 1) * h
        return self.layers * block + embed + head + final_norm

    # ------------------------------------------------------------------------ the module

    def module(
        self, *, layers: int | None = None, device: str = "meta", dtype: torch.dtype | None = None
    ) -> nn.Module:
        """This transformer as an `nn.Module` with `layers` blocks (all of them by default), on
        `device` (`meta`: no values), parameters in `dtype` (bfloat16 by default)."""
        with torch.device(device):
            model = _Model(self, self.layers if layers is None else layers)
        return model.to(dtype or torch.bfloat16)

    def tp_rules(self, axis: str = "tp") -> list[ShardingRule]:
        """Megatron-LM's tensor-parallel split of every block: QKV and the MLP's first
        projection(s) column-parallel, the attention output and the MLP's last projection
        row-parallel, the embedding (and the head tied to it) split over the vocabulary."""
        first = r"blocks\.\d+\.mlp\.(gate|up)" if self.gated_mlp else r"blocks\.\d+\.mlp\.fc"
        return [
            *column_parallel(r"blocks\.\d+\.attn\.qkv", axis, bias=self.bias),
            *row_parallel(r"blocks\.\d+\.attn\.proj", axis),
            *column_parallel(first, axis, bias=self.bias),
            *row_parallel(r"blocks\.\d+\.mlp\.proj", axis),
            *vocab_parallel(r"embed", axis),
            *([] if self.tied_embeddings else column_parallel(r"head", axis, bias=False)),
        ]


class _RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


def _norm(config: Transformer) -> nn.Module:
    if config.norm == "rmsnorm":
        return _RMSNorm(config.hidden)
    return nn.LayerNorm(config.hidden)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Attention(nn.Module):
    def __init__(self, config: Transformer) -> None:
        super().__init__()
        self.config = config
        self.heads, self.kv, self.dim = config.heads, config.kv_count, config.head_dim
        width = (self.heads + 2 * self.kv) * self.dim
        self.qkv = nn.Linear(config.hidden, width, bias=config.bias)
        self.proj = nn.Linear(config.hidden, config.hidden, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # Megatron's layout: per key/value group [q of its heads | k | v], so a column split
        # of the projection gives each rank whole groups
        group = self.heads // self.kv
        qkv = self.qkv(x).view(b, s, self.kv, (group + 2) * self.dim)
        q, k, v = qkv.split((group * self.dim, self.dim, self.dim), dim=-1)
        q = q.reshape(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if rope is not None:
            q, k = _rotate(q, *rope), _rotate(k, *rope)
        if self.kv != self.heads:
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        if self.config.attention == "flash":
            p = self.config.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:  # Megatron-LM's core attention
            # heads major in the merged (heads * b) dim: a head split stays contiguous
            qf = q.transpose(0, 1).reshape(self.heads * b, s, self.dim)
            kf = k.transpose(0, 1).reshape(self.heads * b, s, self.dim)
            vf = v.transpose(0, 1).reshape(self.heads * b, s, self.dim)
            scores = torch.bmm(qf, kf.transpose(1, 2)) * (1 / math.sqrt(self.dim))
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            probs = self.drop(torch.softmax(scores.masked_fill(causal, -10000.0), dim=-1))
            y = torch.bmm(probs, vf).view(self.heads, b, s, self.dim).transpose(0, 1)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, s, -1)))


class _MLP(nn.Module):
    def __init__(self, config: Transformer) -> None:
        super().__init__()
        h, w, bias = config.hidden, config.ffn_width, config.bias
        self.gated = config.gated_mlp
        if self.gated:
            self.gate = nn.Linear(h, w, bias=bias)
            self.up = nn.Linear(h, w, bias=bias)
        else:
            self.fc = nn.Linear(h, w, bias=bias)
        self.proj = nn.Linear(w, h, bias=bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            hidden = F.silu(self.gate(x)) * self.up(x)
        else:
            hidden = F.gelu(self.fc(x))
        return self.drop(self.proj(hidden))


class _Block(nn.Module):
    def __init__(self, config: Transformer) -> None:
        super().__init__()
        self.norm_1 = _norm(config)
        self.attn = _Attention(config)
        self.norm_2 = _norm(config)
        self.mlp = _MLP(config)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), rope)
        return x + self.mlp(self.norm_2(x))


class _Model(nn.Module):
    """Token ids (b, s) -> logits (b, s, vocab)."""

    def __init__(self, config: Transformer, layers: int) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.position = None if config.rotary else nn.Embedding(config.seq, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(layers))
        self.norm = _norm(config)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tied_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.embed(ids)
        rope = None
        if self.position is not None:
            x = x + self.position(torch.arange(s, device=ids.device))
        else:
            inv = 1.0 / 10000 ** (
                torch.arange(0, self.config.head_dim, 2, device=ids.device) / self.config.head_dim
            )
            angles = torch.outer(torch.arange(s, device=ids.device).float(), inv)
            angles = torch.cat((angles, angles), dim=-1)
            rope = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope)
        return self.head(self.norm(x))
