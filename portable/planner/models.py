"""From what the user has to counted costs: a `Transformer` config, a Hugging Face config, or a
captured training-step `Program`.

A `Transformer` or a Hugging Face causal-LM config is built on the `meta` device with one block
(all blocks of these models are the same; `Costs.with_layers` repeats it), captured abstractly
as a training step (AdamW, next-token cross entropy) at micro-batch 2 and 4, and partitioned at
TP 2 with the model's Megatron rules (costs.py, Scaling). A `Program` the user captured is
counted as it is: its costs scale with the micro-batch, and tensor parallelism needs the model
(the program holds one plan's shapes). Counted costs are cached per model in this process.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..capture import capture
from ..errors import PlannerError
from ..ir.plan import Mesh, Plan, ShardingRule
from ..ir.program import Program
from ..optim import AdamW
from ..parallel import column_parallel, head_parallel, row_parallel
from ..passes.spmd_partition import partition
from .costs import Costs, count
from .transformer import Transformer

__all__ = ["BATCHES", "costs_of", "hf_transformer"]

BATCHES = (2, 4)  # the micro-batches the costs are measured at


def costs_of(model: Any, *, seq: int | None = None) -> Costs:
    """Counted costs of `model`: a `Transformer`, a `transformers.PretrainedConfig` (a causal
    LM; `seq` tokens), a captured training-step `Program`, or `Costs` (returned as is)."""
    if isinstance(model, Costs):
        return model
    if isinstance(model, Transformer):
        return _transformer_costs(model if seq is None else _with_seq(model, seq))
    if isinstance(model, Program):
        if model.metadata.get("recipe") is None and model.kind.value != "training_step":
            raise PlannerError(
                f"program {model.name!r} is not a training step",
                fix="capture with loss_fn= (and an optimizer) so the step has a backward",
            )
        if seq is None:
            raise PlannerError("costs of a Program need seq=", fix="pass the sequence length")
        return count([model], seq, batches=(1, 2), source=f"program {model.name}")
    if _is_hf_config(model):
        if seq is None:
            raise PlannerError("a Hugging Face config needs seq=", fix="pass the sequence length")
        return _hf_costs(model, seq)
    raise PlannerError(
        f"cannot plan a {type(model).__name__}",
        fix="pass a planner.Transformer, a transformers config, or a captured training step",
    )


def _with_seq(model: Transformer, seq: int) -> Transformer:
    return dataclasses.replace(model, seq=seq)


def _loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _capture_costs(
    build: Callable[[], torch.nn.Module],
    vocab: int,
    seq: int,
    rules: list[ShardingRule],
    layers: int,
    source: str,
) -> Costs:
    module = build()
    programs: list[Program] = []
    for b in BATCHES:
        ids = torch.zeros(b, seq, dtype=torch.long)
        programs.append(capture(module, (ids, ids), loss_fn=_loss, optimizer=AdamW(lr=1e-4)))
    for program in list(programs):
        per_rank, _ = partition(program.replace(plan=Plan(Mesh({"tp": 2}), rules=tuple(rules))))
        programs.append(per_rank)
    ordered = [programs[0], programs[1], programs[2], programs[3]]
    return count(ordered, seq, batches=BATCHES, source=source).with_layers(layers)


@functools.lru_cache(maxsize=64)
def _transformer_costs(model: Transformer) -> Costs:
    costs = _capture_costs(
        lambda: model.module(layers=1),
        model.vocab,
        model.seq,
        model.tp_rules(),
        model.layers,
        f"Transformer {model.name or ''}".strip(),
    )
    return dataclasses.replace(
        costs,
        hidden=model.hidden,
        kv_width=model.kv_count * model.head_dim,
        experts=model.experts,
        routed=model.routed,
        heads=model.heads,
    )


def _is_hf_config(model: Any) -> bool:
    return type(model).__module__.startswith("transformers.") and hasattr(model, "to_dict")


def hf_transformer(config: Any, seq: int) -> Transformer:
    """The planner's `Transformer` of a Hugging Face Llama-family config (for docs and for the
    shortcut's sizes)."""
    heads = int(config.num_attention_heads)
    return Transformer(
        layers=int(config.num_hidden_layers),
        hidden=int(config.hidden_size),
        heads=heads,
        vocab=int(config.vocab_size),
        seq=seq,
        ffn=int(config.intermediate_size),
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        gated_mlp=True,
        attention="flash",
        norm="rmsnorm",
        bias=False,
        rotary=True,
        dropout=0.0,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        name=str(getattr(config, "name_or_path", "") or type(config).__name__),
    )


def _hf_costs(config: Any, seq: int) -> Costs:
    key = (type(config).__name__, config.to_json_string(use_diff=False), seq)
    return _hf_cached(key, config)


_HF_CACHE: dict[tuple[str, str, int], Costs] = {}


def _hf_cached(key: tuple[str, str, int], config: Any) -> Costs:
    if key in _HF_CACHE:
        return _HF_CACHE[key]
    import transformers

    seq = key[2]
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    if hasattr(one, "layer_types") and one.layer_types is not None:
        one.layer_types = one.layer_types[:1]
    one._attn_implementation = "sdpa"
    one.use_cache = False  # a training step keeps no key/value cache

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            module = transformers.AutoModelForCausalLM.from_config(one, torch_dtype=torch.bfloat16)
        return module

    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    rules = [
        *head_parallel(r"model\.layers\.\d+\.self_attn", heads=heads, kv_heads=kv, axis_size=2),
        *column_parallel(r"model\.layers\.\d+\.mlp\.(gate|up)_proj", bias=False),
        *row_parallel(r"model\.layers\.\d+\.mlp\.down_proj"),
    ]
    costs = _capture_costs(
        build, int(config.vocab_size), seq, rules, int(config.num_hidden_layers), key[0]
    )
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    costs = dataclasses.replace(
        costs, hidden=int(config.hidden_size), kv_width=kv * head_dim, heads=heads
    )
    _HF_CACHE[key] = costs
    return costs
